"""Gluon backend of iris: ``IrisDeviceCtx``, the device API of one rank inside ``@gluon.jit``
kernels, and the backend that compiles iris's kernels with Gluon."""

from iris_gluon.backend import GluonBackend, GluonContext, GluonDeviceOps, iris
from iris_gluon.context import IrisDeviceCtx
from iris_gluon.layouts import block_layout, warp_layout

__all__ = ["GluonBackend", "GluonContext", "GluonDeviceOps", "IrisDeviceCtx", "block_layout", "iris", "warp_layout"]
