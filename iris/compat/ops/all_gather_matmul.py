"""Upstream iris's ``iris.ops.all_gather_matmul``: ``out`` := ``[A_0 | A_1 | ...] @ B``, ``A``
sharded by columns."""

from iris.compat.fused_ops import FusedWorkspace, prepare, upstream_ops

__all__ = ["all_gather_matmul", "all_gather_matmul_preamble"]


def all_gather_matmul(shmem, output_tensor, A_sharded, B, bias=None, async_op=False, config=None,
                      workspace=None) -> FusedWorkspace:
    return upstream_ops(shmem).all_gather_matmul(output_tensor, A_sharded, B, bias=bias, async_op=async_op,
                                                 config=config, workspace=workspace)


def all_gather_matmul_preamble(shmem, A_sharded, B, config=None) -> FusedWorkspace:
    return prepare("all_gather_matmul", shmem.world_size, config, None, (A_sharded.shape[0], B.shape[1], B.shape[0]),
                   A_sharded.dtype)[1]
