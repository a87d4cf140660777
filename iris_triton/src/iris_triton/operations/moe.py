"""Expert-parallel MoE token routing: ``ctx.ops.moe_dispatch`` and ``ctx.ops.moe_combine``.

Experts are split evenly over the ranks: rank ``r`` holds the ``L = E / W`` experts
``[r * L, (r + 1) * L)``. Every shape is static and every count stays on the device, so a call
needs no host synchronisation and can be captured in a CUDA graph (after one eager call of the
largest size, which sizes the workspaces).

Both run on dedicated kernels (:mod:`iris_triton.operations.moe_kernels`): dispatch reads each
token once and writes it straight into the receive buffers of the ranks that own its experts, in
the expert-major layout ``[L, capacity, hidden]`` with device counts (three launches: routing,
push, finish); combine sends each expert output straight back to its token's rank and sums
``topk_weights[t, j] * out[(t, j)]`` there in float32 (two launches). A token that names one
expert twice is sent there once (combine adds both weights); ``-1`` routes a slot nowhere.

Layout, and why ``[L, capacity, hidden]`` with device counts rather than a flat buffer: each
expert's rows start at a fixed place, so a grouped (masked) GEMM takes the tensor as it is and
its shape never depends on the routing. The price is memory for the worst case: the default
capacity, ``W * T`` (every rank's every token, once per expert), always holds.

A dispatch's results are views of the context's receive buffers, which alternate between calls:
they stay valid until the dispatch after next (combine a dispatch before then; clone what must
live longer). A combine whose buffers a later dispatch reused is refused.

A failure (a peer that never calls, a routing that overflows, ids out of range) fills the
result's tensors (or combine's output) with all-ones bits: NaN, integers -1, and the host raises
IrisTimeoutError at the call (CPU ranks) or at the next iris call (GPUs).
"""

from __future__ import annotations

import attrs
import torch

from iris.errors import IrisError

__all__ = ["DTYPES", "FP8_MAX", "MoeDispatch", "MoeHandle", "combine", "dispatch"]

#: Element types of ``tokens`` and of combine's expert outputs.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The largest finite float8_e4m3fn: a token's scale is its largest magnitude over this.
FP8_MAX = 448.0
@attrs.frozen(eq=False)
class MoeHandle:
    """What :func:`combine` needs to send the expert outputs back (opaque; from
    :attr:`MoeDispatch.handle`)."""

    ops: object
    """The ``ctx.ops`` object of the dispatch (combine runs on the same context)."""
    num_experts: int
    capacity: int
    kernels: dict
    """The dispatch's state on the device (:func:`iris_triton.operations.moe_kernels.dispatch`)."""


@attrs.frozen(eq=False)
class MoeDispatch:
    """The tokens one rank's experts received (:func:`dispatch`). Slot ``[e, i]`` for ``i <
    counts[e]`` holds a row for local expert ``e`` (global expert ``rank * L + e``), in
    (source rank, source token index) order. The slots after them are not written in ``tokens``
    (whatever the memory held: a grouped GEMM masks them by ``counts``) and hold -1 in
    ``source_rank`` / ``source_index`` (0 in ``scales``). After a failed call every tensor holds
    all-ones bits (NaN, integers -1). Every tensor but ``counts`` is a view of the context's
    receive buffers, valid until the dispatch after next."""

    tokens: torch.Tensor
    """[L, capacity, hidden]: the tokens' dtype, or float8_e4m3fn with ``fp8=True``."""
    scales: torch.Tensor | None
    """float32 [L, capacity] with ``fp8=True`` (token = tokens.float() * scales[..., None]), else None."""
    counts: torch.Tensor
    """int32 [L]: the rows each local expert received."""
    source_rank: torch.Tensor
    """int32 [L, capacity]: the rank each row came from."""
    source_index: torch.Tensor
    """int32 [L, capacity]: the row's token index on that rank."""
    handle: MoeHandle


# -- checks ------------------------------------------------------------------------------------------


def _tensor(what: str, tensor, ctx, dtypes: tuple, dims: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"moe: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != ctx.device:
        raise IrisError(f"moe: {what} is on {tensor.device}, but this context runs on {ctx.device}; move it with "
                        f".to({str(ctx.device)!r})")
    if tensor.dim() != dims:
        raise IrisError(f"moe: {what} must have {dims} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise IrisError(f"moe: {what} has dtype {tensor.dtype}; supported: "
                        f"{', '.join(str(d) for d in dtypes)}")


def _check_dispatch(ctx, tokens, topk_ids, topk_weights, num_experts, capacity, fp8) -> None:
    world = ctx.world_size
    _tensor("tokens", tokens, ctx, DTYPES, 2)
    _tensor("topk_ids", topk_ids, ctx, (torch.int32, torch.int64), 2)
    _tensor("topk_weights", topk_weights, ctx, (torch.float32,), 2)
    T = tokens.shape[0]
    if T == 0 or tokens.shape[1] == 0:
        raise IrisError(f"moe_dispatch: tokens has shape {tuple(tokens.shape)}; it needs at least one token and one "
                        f"element per token (a rank with nothing to send passes topk_ids of -1)")
    if topk_ids.shape[0] != T or topk_ids.shape[1] == 0:
        raise IrisError(f"moe_dispatch: topk_ids has shape {tuple(topk_ids.shape)}; it needs one row per token "
                        f"({T}) and at least one expert per row")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise IrisError(f"moe_dispatch: topk_weights has shape {tuple(topk_weights.shape)}; it must match topk_ids "
                        f"{tuple(topk_ids.shape)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise IrisError(f"moe_dispatch: num_experts must be a positive int, got {num_experts!r}")
    if num_experts % world:
        raise IrisError(f"moe_dispatch: num_experts={num_experts} is not divisible by the world size {world}; the "
                        f"experts are split evenly over the ranks: use a multiple of {world}")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise IrisError(f"moe_dispatch: capacity must be a positive int (rows per expert) or None (the most an "
                        f"expert can receive, world_size * num_tokens = {world * T}), got {capacity!r}")
    if not isinstance(fp8, bool):
        raise IrisError(f"moe_dispatch: fp8 must be True or False, got {fp8!r}")
    if ctx.config.debug:  # a host synchronisation and exchange: only in debug mode (the device checks anyway)
        ids = topk_ids.cpu()
        bad = ctx.comm.all_gather_object(bool(((ids < -1) | (ids >= num_experts)).any()))
        if any(bad):
            raise IrisError(f"moe_dispatch: topk_ids on world rank(s) {[q for q, b in enumerate(bad) if b]} hold ids "
                            f"outside [-1, {num_experts}) (-1: the slot goes to no expert); check the router's output")


# -- dispatch ----------------------------------------------------------------------------------------


def dispatch(ops, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             capacity: int | None, fp8: bool) -> MoeDispatch:
    """``ctx.ops.moe_dispatch`` (:mod:`iris_triton.operations.moe_kernels`)."""
    from iris_triton.operations import moe_kernels

    ctx = ops._context
    _check_dispatch(ctx, tokens, topk_ids, topk_weights, num_experts, capacity, fp8)
    capacity = ctx.world_size * tokens.shape[0] if capacity is None else capacity
    (data, scales, counts, source_rank, source_index, _), state = moe_kernels.dispatch(
        ops, tokens, topk_ids, topk_weights, num_experts, capacity, fp8)
    handle = MoeHandle(ops=ops, num_experts=num_experts, capacity=capacity, kernels=state)
    return MoeDispatch(tokens=data, scales=scales, counts=counts, source_rank=source_rank, source_index=source_index,
                       handle=handle)


# -- combine -----------------------------------------------------------------------------------------


def combine(ops, expert_out: torch.Tensor, handle) -> torch.Tensor:
    """``ctx.ops.moe_combine``: ``[T, hidden]`` in ``expert_out``'s dtype, token ``t`` :=
    ``sum_j topk_weights[t, j] * expert_out[slot of (t, j)]`` (float32 sums)."""
    ctx = ops._context
    if isinstance(handle, MoeDispatch):
        handle = handle.handle
    if not isinstance(handle, MoeHandle):
        raise TypeError(f"moe_combine: handle must be the result of ctx.ops.moe_dispatch (or its .handle), got "
                        f"{type(handle).__name__}")
    if handle.ops is not ops:
        raise IrisError("moe_combine: handle comes from a dispatch on another context or group; combine on the "
                        "ctx.ops that dispatched")
    _tensor("expert_out", expert_out, ctx, DTYPES, 3)
    L = handle.num_experts // ctx.world_size
    if expert_out.shape[:2] != (L, handle.capacity):
        raise IrisError(f"moe_combine: expert_out has shape {tuple(expert_out.shape)}; it needs [local experts, "
                        f"capacity, hidden] = [{L}, {handle.capacity}, hidden], as the dispatch's tokens")
    from iris_triton.operations import moe_kernels

    out = moe_kernels.combine(expert_out, handle.kernels)
    return out
