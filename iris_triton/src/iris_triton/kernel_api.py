"""What kernels reach as ``iris.<name>`` (the Triton backend's ``Backend.device_api``): the device
functions (:data:`iris_triton.device.DEVICE_FUNCTIONS`), the :class:`DeviceContext` aggregate and the
``TraceEvent`` ids, as kernels written for upstream iris use them."""

from iris_triton import device
from iris_triton.context import DeviceContext
from iris_triton.device import *  # noqa: F403 (exactly the device functions: iris_triton.device.__all__)
from iris_triton.tracing import TraceEvent

__all__ = ["DeviceContext", "TraceEvent", *device.__all__]
