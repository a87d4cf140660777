"""iris: a symmetric heap on every rank, and remote memory access from Triton and Gluon kernels.

``import iris`` reads backend metadata only: Triton and the backends are imported on first use.
Inside ``@triton.jit`` kernels, ``iris.load``, ``iris.store``, ``iris.atomic_add`` and the other
device functions of the default backend (``"triton"``) resolve to the functions that backend
exports (its :attr:`Backend.device_api`), so kernels written for upstream iris run unchanged.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from iris.backend import Backend, DeviceOps
from iris.compat import install_aliases
from iris.config import DEFAULT_BACKEND
from iris.context import Context, create
from iris.errors import (
    AsymmetricHeapError,
    BackendNotFoundError,
    CallMismatchError,
    HeapExhaustedError,
    IrisError,
    IrisTimeoutError,
    NotOnHeapError,
    RankFailedError,
)
from iris.registry import available_backends, get_backend, is_backend_available, register_backend
from iris.tools.spawn import spawn

install_aliases()  # upstream iris's module names (iris.x, iris.ops, ...): iris.compat

# Upstream's module ``iris.iris`` (``from iris.iris import DeviceContext``); loading it sets the
# package's attribute ``iris`` to the module, which then becomes the function again, as upstream's.
importlib.import_module("iris.iris")
from iris.context import iris  # noqa: E402

try:
    __version__ = version("iris")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"


#: Upstream iris's top-level names beside its device functions, by the module of iris that holds
#: them; imported on first use, so that ``import iris`` stays light (``iris.logging`` configures the
#: ``iris`` logger as upstream's does, only when its names are used).
UPSTREAM_NAMES = {
    "Iris": "iris.compat.context",
    "do_bench": "iris.timing",
    **{name: "iris.logging" for name in ("set_logger_level", "logger", "DEBUG", "INFO", "WARNING", "ERROR")},
}
#: Upstream iris's submodules of ``iris``, imported on first use as attributes (``iris.hip.get_num_xcc()``).
UPSTREAM_MODULES = ("ccl", "device_utils", "experimental", "hip", "ops")


def __getattr__(name: str) -> Any:
    """Resolve ``iris.load`` and the other device functions of the default backend, and upstream
    iris's other top-level names (:data:`UPSTREAM_NAMES`, :data:`UPSTREAM_MODULES`), on first use
    (PEP 562), so that ``import iris`` imports no backend and no Triton."""
    if name in UPSTREAM_NAMES:
        return getattr(importlib.import_module(UPSTREAM_NAMES[name]), name)
    if name in UPSTREAM_MODULES:
        return importlib.import_module(f"iris.{name}")
    if not name.startswith("_") and is_backend_available(DEFAULT_BACKEND):
        module_name = get_backend(DEFAULT_BACKEND).device_api
        if module_name is not None:
            module = importlib.import_module(module_name)
            if name in module.__all__:
                return getattr(module, name)
    raise AttributeError(f"module 'iris' has no attribute {name!r}")


__all__ = [
    "AsymmetricHeapError",
    "Backend",
    "BackendNotFoundError",
    "CallMismatchError",
    "Context",
    "DeviceOps",
    "HeapExhaustedError",
    "IrisError",
    "IrisTimeoutError",
    "NotOnHeapError",
    "RankFailedError",
    "available_backends",
    "create",
    "iris",
    "is_backend_available",
    "register_backend",
    "spawn",
]
