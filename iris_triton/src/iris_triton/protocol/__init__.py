"""What iris's kernels agree on with their peers: bounded waits and the fault words they record
(:mod:`~iris_triton.protocol.waits`), per-program call counts (:mod:`~iris_triton.protocol.calls`),
the device-side barrier (:mod:`~iris_triton.protocol.barrier`) and the element-wise reductions
(:mod:`~iris_triton.protocol.reductions`)."""
