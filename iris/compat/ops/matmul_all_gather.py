"""Upstream iris's ``iris.ops.matmul_all_gather``: ``out`` := every rank's ``A @ B``, by rows."""

from iris.compat.fused_ops import FusedWorkspace, prepare, upstream_ops

__all__ = ["matmul_all_gather", "matmul_all_gather_preamble"]


def matmul_all_gather(shmem, output_tensor, A, B, bias=None, async_op=False, config=None,
                      workspace=None) -> FusedWorkspace:
    return upstream_ops(shmem).matmul_all_gather(output_tensor, A, B, bias=bias, async_op=async_op, config=config,
                                                 workspace=workspace)


def matmul_all_gather_preamble(shmem, A, B, config=None) -> FusedWorkspace:
    return prepare("matmul_all_gather", shmem.world_size, config, None, (A.shape[0], B.shape[1], A.shape[1]),
                   A.dtype)[1]
