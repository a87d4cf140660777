"""``ctx.ops`` (:mod:`~iris_triton.operations.fused_ops`): matrix products fused with their
communication (:mod:`~iris_triton.operations.fused`, :mod:`~iris_triton.operations.gemm`,
:mod:`~iris_triton.operations.copy_engine`), all_reduce + RMSNorm
(:mod:`~iris_triton.operations.rmsnorm`) and MoE routing (:mod:`~iris_triton.operations.moe`)."""
