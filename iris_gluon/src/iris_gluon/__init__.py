"""Gluon backend of iris: device functions for remote memory access on the symmetric heap."""

from iris_gluon.backend import GluonBackend, GluonDeviceOps, iris

__all__ = ["GluonBackend", "GluonDeviceOps", "iris"]
