"""iris: a symmetric heap on every rank, and remote memory access from Triton and Gluon kernels.

``import iris`` reads backend metadata only: Triton and the backends are imported on first use.
Inside ``@triton.jit`` kernels, ``iris.load``, ``iris.store``, ``iris.atomic_add`` and the other
device functions of the Triton backend resolve to :mod:`iris_triton`, so kernels written for
upstream iris run unchanged.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from iris.backend import Backend, DeviceOps
from iris.context import create, iris
from iris.errors import (
    AsymmetricHeapError,
    BackendNotFoundError,
    HeapExhaustedError,
    IrisError,
    IrisTimeoutError,
    NotOnHeapError,
    RankFailedError,
)
from iris.registry import available_backends, is_backend_available, register_backend
from iris.spawn import spawn

try:
    __version__ = version("iris")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

#: Device functions reachable as ``iris.<name>`` inside ``@triton.jit`` kernels.
_TRITON_DEVICE_NAMES = frozenset({
    "translate", "load", "store", "get", "put", "copy", "atomic_add", "atomic_sub", "atomic_xchg",
    "atomic_and", "atomic_or", "atomic_xor", "atomic_min", "atomic_max", "atomic_cas", "signal",
    "wait_until", "DeviceContext",
})


def __getattr__(name: str) -> Any:
    """Resolve ``iris.load`` and the other Triton device functions on first use (PEP 562), so
    that ``import iris`` stays free of Triton."""
    if name in _TRITON_DEVICE_NAMES:
        import iris_triton

        return getattr(iris_triton, name)
    raise AttributeError(f"module 'iris' has no attribute {name!r}")


__all__ = [
    "AsymmetricHeapError",
    "Backend",
    "BackendNotFoundError",
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
