"""Upstream iris's ``iris.ops`` module: fused matrix products with communication, called as
``iris.ops.<name>(ctx, output, ...)``, their configuration and workspace.

Each function runs ``ctx.ops.<name>`` with upstream's conventions
(:mod:`iris.upstream.ops`); a context made with :func:`iris.create` is taken too, and keeps its
own ``ctx.ops`` (torch.distributed's conventions) for direct calls. The ``*_preamble`` functions
check a call and return the :class:`FusedWorkspace` it is prepared with.
"""

from __future__ import annotations

from iris.upstream.ops import FusedConfig, FusedWorkspace, UpstreamOps, prepare

__all__ = [
    "FusedConfig",
    "FusedWorkspace",
    "all_gather_matmul",
    "all_gather_matmul_preamble",
    "matmul_all_gather",
    "matmul_all_gather_preamble",
    "matmul_all_reduce",
    "matmul_all_reduce_preamble",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_preamble",
]


def _upstream_ops(ctx) -> UpstreamOps:
    ops = ctx.ops
    return ops if isinstance(ops, UpstreamOps) else UpstreamOps(ctx, ops)


def matmul_all_reduce(shmem, C, A, B, async_op=False, config=None, workspace=None) -> FusedWorkspace:
    return _upstream_ops(shmem).matmul_all_reduce(C, A, B, async_op=async_op, config=config, workspace=workspace)


def all_gather_matmul(shmem, output_tensor, A_sharded, B, bias=None, async_op=False, config=None,
                      workspace=None) -> FusedWorkspace:
    return _upstream_ops(shmem).all_gather_matmul(output_tensor, A_sharded, B, bias=bias, async_op=async_op,
                                                  config=config, workspace=workspace)


def matmul_all_gather(shmem, output_tensor, A, B, bias=None, async_op=False, config=None,
                      workspace=None) -> FusedWorkspace:
    return _upstream_ops(shmem).matmul_all_gather(output_tensor, A, B, bias=bias, async_op=async_op, config=config,
                                                  workspace=workspace)


def matmul_reduce_scatter(shmem, C, A, B, async_op=False, config=None, workspace=None) -> FusedWorkspace:
    return _upstream_ops(shmem).matmul_reduce_scatter(C, A, B, async_op=async_op, config=config,
                                                      workspace=workspace)


def _preamble(operation: str, shmem, shape: tuple, dtype, config, workspace) -> FusedWorkspace:
    return prepare(operation, shmem.world_size, config, workspace, shape, dtype)[1]


def matmul_all_reduce_preamble(shmem, C, A, B, config=None, workspace=None) -> FusedWorkspace:
    return _preamble("matmul_all_reduce", shmem, (A.shape[0], B.shape[1], A.shape[1]), A.dtype, config, workspace)


def all_gather_matmul_preamble(shmem, A_sharded, B, config=None) -> FusedWorkspace:
    return _preamble("all_gather_matmul", shmem, (A_sharded.shape[0], B.shape[1], B.shape[0]), A_sharded.dtype,
                     config, None)


def matmul_all_gather_preamble(shmem, A, B, config=None) -> FusedWorkspace:
    return _preamble("matmul_all_gather", shmem, (A.shape[0], B.shape[1], A.shape[1]), A.dtype, config, None)


def matmul_reduce_scatter_preamble(shmem, C, A, B, config=None, workspace=None) -> FusedWorkspace:
    return _preamble("matmul_reduce_scatter", shmem, (A.shape[0], B.shape[1], A.shape[1]), A.dtype, config,
                     workspace)
