"""The Gluon front end: iris's kernel sources compiled with ``gluon.jit`` and ``IrisDeviceCtx``."""

from triton.experimental import gluon

from iris_gluon.context import IrisDeviceCtx
from iris_triton.device.frontend import Frontend

__all__ = ["GLUON"]

GLUON = Frontend(name="gluon", jit=gluon.jit, device_context=IrisDeviceCtx)
