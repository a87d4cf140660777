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
)
from iris.registry import available_backends, is_backend_available, register_backend
from iris.spawn import spawn

try:
    __version__ = version("iris")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "AsymmetricHeapError",
    "Backend",
    "BackendNotFoundError",
    "DeviceOps",
    "HeapExhaustedError",
    "IrisError",
    "IrisTimeoutError",
    "NotOnHeapError",
    "available_backends",
    "create",
    "iris",
    "is_backend_available",
    "register_backend",
    "spawn",
]
