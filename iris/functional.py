"""Functional collectives and fused operations: each returns a new tensor and leaves its inputs
unchanged, as torch's ``torch.distributed._functional_collectives`` do.

This is the traceable spelling for ``torch.compile``: every function is one custom operator
(``torch.ops.iris.<name>``, :mod:`iris.custom_ops`), so the compiled graph has no break and
the compiler sees a pure function of its inputs::

    import iris.functional as F

    @torch.compile(fullgraph=True)
    def layer(x, w1, w2):
        h = F.all_gather_matmul(x, w1, ctx)          # (world * m) x N
        return F.all_reduce(torch.relu(h) @ w2, ctx)

``ctx`` is a context (its collectives with torch.distributed's conventions, and its ``ops``),
or a ``ctx.ccl`` / ``ctx.ops`` object. ``group=`` runs the call among a group's ranks. The
in-place methods ``ctx.ccl.all_reduce(t)`` and ``ctx.ops.all_gather_matmul(out, ...)`` compile
too (they route to the in-place operators); these functions are for code written in the
functional style.
"""

from __future__ import annotations

import torch

from iris.custom_ops import _op_name, _split_list

__all__ = ["all_gather", "all_gather_matmul", "all_reduce", "all_reduce_rmsnorm", "all_to_all", "all_to_all_single",
           "broadcast", "matmul_all_gather", "matmul_all_reduce", "matmul_reduce_scatter", "reduce", "reduce_scatter"]


def _collectives(ctx, group):
    """The handle of the Collectives object that runs a call of ``ctx`` with ``group=``."""
    collectives = ctx._torch_ccl if hasattr(ctx, "_torch_ccl") else ctx
    if group is not None:
        collectives = collectives._for_group(group)
    return collectives._iris_handle


def _fused(ctx, group):
    """The handle of the FusedOps object that runs a call of ``ctx`` with ``group=``."""
    ops = ctx.ops if hasattr(ctx, "_torch_ccl") else ctx
    ops = getattr(ops, "_ops", ops)  # a context with upstream's conventions wraps the FusedOps
    if group is not None:
        ops = ops._for_group(group)
    return ops._iris_handle


def all_reduce(tensor: torch.Tensor, ctx, op="sum", *, algorithm: str | None = None, group=None) -> torch.Tensor:
    """The reduction (sum, max, min, ...) of ``tensor`` over the ranks, as a new tensor."""
    return torch.ops.iris.all_reduce(tensor, _collectives(ctx, group), _op_name(op), algorithm)


def reduce(tensor: torch.Tensor, ctx, dst: int = 0, op="sum", *, algorithm: str | None = None,
           group=None) -> torch.Tensor:
    """On rank ``dst``, the reduction of ``tensor`` over the ranks; elsewhere a copy of ``tensor``."""
    return torch.ops.iris.reduce(tensor, _collectives(ctx, group), dst, _op_name(op), algorithm)


def all_to_all_single(tensor: torch.Tensor, ctx, output_split_sizes=None, input_split_sizes=None, *,
                      algorithm: str | None = None, group=None) -> torch.Tensor:
    """torch's ``all_to_all_single``: ``input_split_sizes[j]`` rows of ``tensor`` go to rank j; the
    result holds ``output_split_sizes[i]`` rows from each rank i, in rank order (None: equal splits)."""
    return torch.ops.iris.all_to_all_single(tensor, _collectives(ctx, group), _split_list(output_split_sizes),
                                            _split_list(input_split_sizes), algorithm)


def all_gather(tensor: torch.Tensor, ctx, *, algorithm: str | None = None, group=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order (shape ``(world * d0, ...)``)."""
    return torch.ops.iris.all_gather(tensor, _collectives(ctx, group), algorithm)


def reduce_scatter(tensor: torch.Tensor, ctx, op="sum", *, algorithm: str | None = None,
                   group=None) -> torch.Tensor:
    """This rank's block of dim 0 of the reduction of ``tensor`` over the ranks (shape
    ``(d0 / world, ...)``; dim 0 must divide by the world size)."""
    return torch.ops.iris.reduce_scatter(tensor, _collectives(ctx, group), _op_name(op), algorithm)


def all_to_all(tensor: torch.Tensor, ctx, *, algorithm: str | None = None, group=None) -> torch.Tensor:
    """Segment j of ``tensor`` (``world`` equal segments of its elements) sent to rank j, which
    keeps it as its segment of this rank's number."""
    return torch.ops.iris.all_to_all(tensor, _collectives(ctx, group), algorithm)


def broadcast(tensor: torch.Tensor, ctx, src: int = 0, *, algorithm: str | None = None, group=None) -> torch.Tensor:
    """Rank ``src``'s ``tensor``, on every rank."""
    return torch.ops.iris.broadcast(tensor, _collectives(ctx, group), src, algorithm)


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, ctx, *, method: str | None = None,
                      group=None) -> torch.Tensor:
    """``all_gather(a_shard) @ b`` (``(world * m) x N``), the gather overlapped with the product."""
    return torch.ops.iris.all_gather_matmul(a_shard, b, _fused(ctx, group), method)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, ctx, *, method: str | None = None,
                          group=None) -> torch.Tensor:
    """This rank's block of rows of ``a @ b`` summed over the ranks (``(M / world) x N``)."""
    return torch.ops.iris.matmul_reduce_scatter(a, b, _fused(ctx, group), method)


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, ctx, *, method: str | None = None,
                      group=None) -> torch.Tensor:
    """``a @ b`` summed over the ranks (``M x N``)."""
    return torch.ops.iris.matmul_all_reduce(a, b, _fused(ctx, group), method)


def matmul_all_gather(a: torch.Tensor, b: torch.Tensor, ctx, *, method: str | None = None,
                      group=None) -> torch.Tensor:
    """Every rank's ``a @ b`` stacked in rank order (``(world * m) x N``)."""
    return torch.ops.iris.matmul_all_gather(a, b, _fused(ctx, group), method)


def all_reduce_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, ctx, eps: float = 1e-6, *,
                       keep_residual: bool = False, method: str | None = None, group=None):
    """``rms_norm(s, (hidden,), weight, eps)`` with ``s = all_reduce(x) + residual`` (``x`` and
    ``residual``: ``tokens x hidden``), as a new tensor; with ``keep_residual=True`` the pair
    ``(normed, s)``, ``s`` being the updated residual stream (``ctx.ops.all_reduce_rmsnorm``'s
    ``residual_out``). One fused kernel (docs/all_reduce_rmsnorm.md)."""
    normed, summed = torch.ops.iris.all_reduce_rmsnorm(x, residual, weight, _fused(ctx, group), float(eps),
                                                       keep_residual, method)
    return (normed, summed) if keep_residual else normed
