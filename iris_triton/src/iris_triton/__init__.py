"""Triton backend of iris: device functions for remote memory access on the symmetric heap.

Inside ``@triton.jit`` kernels use the free functions (``iris_triton.load(ptr, to_rank, from_rank,
heap_bases, ...)``, also reachable as ``iris.load``) or the :class:`DeviceContext` aggregate.
"""

from iris_triton.backend import TritonBackend, TritonDeviceOps
from iris_triton.context import DeviceContext
from iris_triton.device import (
    atomic_add,
    atomic_and,
    atomic_cas,
    atomic_max,
    atomic_min,
    atomic_or,
    atomic_sub,
    atomic_xchg,
    atomic_xor,
    copy,
    get,
    load,
    put,
    signal,
    store,
    translate,
    wait_until,
)

__all__ = [
    "DeviceContext",
    "TritonBackend",
    "TritonDeviceOps",
    "atomic_add",
    "atomic_and",
    "atomic_cas",
    "atomic_max",
    "atomic_min",
    "atomic_or",
    "atomic_sub",
    "atomic_xchg",
    "atomic_xor",
    "copy",
    "get",
    "load",
    "put",
    "signal",
    "store",
    "translate",
    "wait_until",
]
