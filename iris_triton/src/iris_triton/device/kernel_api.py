"""What kernels reach as ``iris.<name>`` (the Triton backend's ``Backend.device_api``): the device
functions (:data:`iris_triton.device.functions.DEVICE_FUNCTIONS`), the :class:`DeviceContext` aggregate and the
``TraceEvent`` ids, as kernels written for upstream iris use them."""

from iris_triton.device import functions as device
from iris_triton.device.context import DeviceContext
from iris_triton.device.functions import *  # noqa: F403 (exactly the device functions: iris_triton.device.functions.__all__)
from iris_triton.device.tracing import TraceEvent

__all__ = ["DeviceContext", "TraceEvent", *device.__all__]
