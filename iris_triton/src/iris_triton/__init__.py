"""Triton backend of iris: device functions for remote memory access on the symmetric heap.

Inside ``@triton.jit`` kernels use the free functions (``iris_triton.load(ptr, to_rank, from_rank,
heap_bases, ...)``, also reachable as ``iris.load``) or the :class:`DeviceContext` aggregate.
The device functions are those listed in :data:`DEVICE_FUNCTIONS` (``iris_triton.device.functions.__all__``),
re-exported here as they are.
"""

from iris_triton.backend import TritonBackend, TritonContext, TritonDeviceOps
from iris_triton.device.context import DeviceContext
from iris_triton.device.functions import *  # noqa: F403 (exactly the device functions: iris_triton.device.functions.__all__)
from iris_triton.device.functions import DEVICE_FUNCTIONS

__all__ = ["DEVICE_FUNCTIONS", "DeviceContext", "TritonBackend", "TritonContext", "TritonDeviceOps"]
__all__ += list(DEVICE_FUNCTIONS)
