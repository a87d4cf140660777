"""Upstream iris's ``iris.ops.matmul_all_reduce``: ``C`` := the sum over ranks of ``A @ B``."""

from iris.compat.fused_ops import FusedWorkspace, prepare, upstream_ops

__all__ = ["matmul_all_reduce", "matmul_all_reduce_preamble"]


def matmul_all_reduce(shmem, C, A, B, async_op=False, config=None, workspace=None) -> FusedWorkspace:
    return upstream_ops(shmem).matmul_all_reduce(C, A, B, async_op=async_op, config=config, workspace=workspace)


def matmul_all_reduce_preamble(shmem, C, A, B, config=None, workspace=None) -> FusedWorkspace:
    return prepare("matmul_all_reduce", shmem.world_size, config, workspace, (A.shape[0], B.shape[1], A.shape[1]),
                   A.dtype)[1]
