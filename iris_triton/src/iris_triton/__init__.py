"""Triton backend of iris: device functions for remote memory access on the symmetric heap."""

from iris_triton.backend import TritonBackend, TritonDeviceOps

__all__ = ["TritonBackend", "TritonDeviceOps"]
