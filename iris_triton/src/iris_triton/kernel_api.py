"""What kernels reach as ``iris.<name>`` (the Triton backend's ``Backend.device_api``): the device
functions (:data:`iris_triton.device.DEVICE_FUNCTIONS`) and the :class:`DeviceContext` aggregate, as
kernels written for upstream iris use them."""

from iris_triton import device
from iris_triton.context import DeviceContext
from iris_triton.device import *  # noqa: F403 (exactly the device functions: iris_triton.device.__all__)

__all__ = ["DeviceContext", *device.__all__]
