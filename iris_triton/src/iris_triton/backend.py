"""The Triton backend's registration and host side."""

from __future__ import annotations

import os

from iris.backend import Backend, DeviceOps
from iris.errors import IrisError

__all__ = ["TritonBackend", "TritonDeviceOps"]


class TritonDeviceOps(DeviceOps):
    """Host side of the Triton backend. On CPU ranks, kernels run in Triton's interpreter."""

    def _setup(self) -> None:
        super()._setup()
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise IrisError(
                "CPU ranks run Triton kernels in Triton's interpreter, which needs TRITON_INTERPRET=1 "
                "set before Triton is imported; launch with iris.spawn(...) or `iris run`, or export "
                "TRITON_INTERPRET=1"
            )


TritonBackend = Backend(name="triton", device_ops=TritonDeviceOps, device_types={"cuda", "cpu"})
