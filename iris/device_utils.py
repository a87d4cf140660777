"""Kernel intrinsics under upstream iris's module name: ``read_realtime``, ``get_cu_id``,
``get_xcc_id`` and ``get_se_id``.

They are ``@triton.jit`` functions of the Triton backend (:mod:`iris_triton.device_utils`, which
documents what each returns on a GPU and in the interpreter), re-exported here so that upstream
code such as ``from iris.device_utils import read_realtime`` runs unchanged. Importing this module
imports Triton; ``import iris`` alone does not.
"""

from __future__ import annotations

from iris.errors import BackendNotFoundError

try:
    from iris_triton.device_utils import get_cu_id, get_se_id, get_xcc_id, read_realtime
except ModuleNotFoundError as error:
    if error.name not in ("iris_triton", "iris_triton.device_utils"):
        raise  # something iris_triton itself needs is missing: that error says what
    raise BackendNotFoundError(
        "iris.device_utils comes from iris's Triton backend, which is not installed: pip install iris-triton"
    ) from error

__all__ = ["get_cu_id", "get_se_id", "get_xcc_id", "read_realtime"]
