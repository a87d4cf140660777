"""The device API kernels call: remote memory access on the symmetric heap
(:mod:`~iris_triton.device.functions`), the device contexts (:mod:`~iris_triton.device.context`),
device-side tracing and clocks, and how one kernel source is compiled as Triton or Gluon
(:mod:`~iris_triton.device.frontend`, :mod:`~iris_triton.device.compiled`)."""
