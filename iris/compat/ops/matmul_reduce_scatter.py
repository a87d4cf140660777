"""Upstream iris's ``iris.ops.matmul_reduce_scatter``: ``C`` (full shape) := on this rank's tiles,
the sum over ranks of ``A @ B``; zero elsewhere."""

from iris.compat.fused_ops import FusedWorkspace, prepare, upstream_ops

__all__ = ["matmul_reduce_scatter", "matmul_reduce_scatter_preamble"]


def matmul_reduce_scatter(shmem, C, A, B, async_op=False, config=None, workspace=None) -> FusedWorkspace:
    return upstream_ops(shmem).matmul_reduce_scatter(C, A, B, async_op=async_op, config=config, workspace=workspace)


def matmul_reduce_scatter_preamble(shmem, C, A, B, config=None, workspace=None) -> FusedWorkspace:
    return prepare("matmul_reduce_scatter", shmem.world_size, config, workspace,
                   (A.shape[0], B.shape[1], A.shape[1]), A.dtype)[1]
