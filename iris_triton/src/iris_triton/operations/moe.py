"""Expert-parallel MoE token routing: ``ctx.ops.moe_dispatch`` and ``ctx.ops.moe_combine``.

Experts are split evenly over the ranks: rank ``r`` holds the ``L = E / W`` experts
``[r * L, (r + 1) * L)``. Every shape is static and every count stays on the device, so a call
needs no host synchronisation and can be captured in a CUDA graph (after one eager call of the
largest size, which sizes the workspaces).

Both run on dedicated kernels (:mod:`iris_triton.operations.moe_kernels`): dispatch reads each
token once and writes it straight into the receive buffers of the ranks that own its experts, in
the expert-major layout ``[L, capacity, hidden]`` with device counts (two launches: routing,
push); combine sends each expert output received from a peer straight back to its
token's rank and sums ``topk_weights[t, j] * out[(t, j)]`` there in float32, reading the outputs of
a rank's own tokens where they are (two launches). A token that names one
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

import dataclasses

import torch

from iris.calls.handles import lookup
from iris.calls.operators import keep_in_program_order
from iris.errors import IrisError

__all__ = ["DTYPES", "FP8_MAX", "MoeDispatch", "MoeHandle", "buffer_versions", "combine", "compiled_combine",
           "compiled_dispatch", "dispatch"]

#: Element types of ``tokens`` and of combine's expert outputs.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The largest finite float8_e4m3fn: a token's scale is its largest magnitude over this.
FP8_MAX = 448.0
# The result classes are frozen dataclasses (not attrs classes as elsewhere): torch.compile traces
# their construction, which it cannot for attrs' generated __init__.


@dataclasses.dataclass(frozen=True, eq=False)
class MoeHandle:
    """What :func:`combine` needs to send the expert outputs back (opaque; from
    :attr:`MoeDispatch.handle`): the dispatch's context and arguments, its slot of the receive
    buffers and its state on the device."""

    ops: object
    """The ``ctx.ops`` object of the dispatch (combine runs on the same context)."""
    num_experts: int
    capacity: int
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    pair_slots: torch.Tensor
    """int32 [T, k]: each pair's slot among the ``[L, capacity]`` rows of its expert's rank (-1: sent
    nowhere), where combine finds its expert's output."""
    call: torch.Tensor
    """int32 [1]: the dispatch's number, counted on the device."""
    counts: torch.Tensor
    slot: torch.Tensor
    """uint8: the dispatch's slot of the receive buffers (:func:`moe_kernels.carve_slot`)."""
    sequence: int | None
    """The dispatch's number on the host, to refuse a stale combine at once; None in compiled code,
    where the device refuses it."""
    plan: object = None
    """The dispatch's plan (:mod:`iris_triton.operations.moe_plans`), which plans its combines;
    None where it has none (compiled code, the interpreter's quantized fp8)."""
    buffers: tuple | None = None
    """The versions of the workspaces its tensors are views of (:func:`buffer_versions`): a
    combine refuses the handle once one was replaced. None in compiled code."""


@dataclasses.dataclass(frozen=True, eq=False)
class MoeDispatch:
    """The tokens one rank's experts received (:func:`dispatch`). Slot ``[e, i]`` for ``i <
    counts[e]`` holds a row for local expert ``e`` (global expert ``rank * L + e``), in
    (source rank, source token index) order. The slots after them are not written in ``tokens``
    (whatever the memory held: a grouped GEMM masks them by ``counts``) and hold -1 in
    ``source_rank`` / ``source_index`` (0 in ``scales``). After a failed call every tensor holds
    all-ones bits (NaN, integers -1). Every tensor is a view of the context's buffers (``counts``
    once the shape has a plan), valid until the dispatch after next or until a dispatch of more
    tokens, experts or capacity grows them."""

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
    """``ctx.ops.moe_dispatch``, eagerly (:mod:`iris_triton.operations.moe_kernels`)."""
    from iris_triton.operations import moe_kernels

    ctx = ops._context
    _check_dispatch(ctx, tokens, topk_ids, topk_weights, num_experts, capacity, fp8)
    rows = ctx.world_size * tokens.shape[0] if capacity is None else capacity
    slot, counts, pair_slots, call, sequence, plan = moe_kernels.dispatch(ops, tokens, topk_ids, topk_weights,
                                                                         num_experts, rows, fp8)
    if plan is not None:
        plan.keep_for(tokens, topk_ids, topk_weights, num_experts, capacity, fp8)
    return _result(ops, tokens, topk_ids, topk_weights, num_experts, rows, fp8, slot, counts, pair_slots, call,
                   sequence, plan)


def compiled_dispatch(ops, tokens, topk_ids, topk_weights, num_experts, *, capacity=None, fp8=False) -> MoeDispatch:
    """``ctx.ops.moe_dispatch`` under torch.compile: the operator ``torch.ops.iris.moe_dispatch``
    (which runs the eager call), its slot carved into the result as the eager call does."""
    capacity = ops._world_size * tokens.shape[0] if capacity is None else capacity
    slot, counts, pair_slots, call = torch.ops.iris.moe_dispatch(tokens, topk_ids, topk_weights, ops._iris_handle,
                                                                num_experts, capacity, fp8)
    return _result(ops, tokens, topk_ids, topk_weights, num_experts, capacity, fp8, slot, counts, pair_slots, call,
                   None, None)


def _result(ops, tokens, topk_ids, topk_weights, num_experts, capacity, fp8, slot, counts, pair_slots, call,
            sequence, plan) -> MoeDispatch:
    from iris_triton.operations.moe_kernels import carve_slot, carved

    dtype = torch.float8_e4m3fn if fp8 else tokens.dtype
    if sequence is None:  # compiled code: the slot is the operator's result, traced
        buffers = carve_slot(slot, ops._world_size, num_experts, capacity, tokens.shape[1], dtype)
    else:
        buffers = carved(ops, slot, ops._world_size, num_experts, capacity, tokens.shape[1], dtype)
    handle = MoeHandle(ops=ops, num_experts=num_experts, capacity=capacity, topk_ids=topk_ids,
                       topk_weights=topk_weights, pair_slots=pair_slots, call=call, counts=counts, slot=slot,
                       sequence=sequence, plan=plan,
                       buffers=None if sequence is None else buffer_versions(ops._context, planned=False))
    return MoeDispatch(tokens=buffers["data"], scales=buffers["scales"] if fp8 else None, counts=counts,
                       source_rank=buffers["source_rank"], source_index=buffers["source_index"], handle=handle)


# -- combine -----------------------------------------------------------------------------------------


def _handle_of(ops, handle) -> MoeHandle:
    if isinstance(handle, MoeDispatch):
        handle = handle.handle
    if not isinstance(handle, MoeHandle):
        raise TypeError(f"moe_combine: handle must be the result of ctx.ops.moe_dispatch (or its .handle), got "
                        f"{type(handle).__name__}")
    if handle.ops is not ops:
        raise IrisError("moe_combine: handle comes from a dispatch on another context or group; combine on the "
                        "ctx.ops that dispatched")
    return handle


def combine(ops, expert_out: torch.Tensor, handle) -> torch.Tensor:
    """``ctx.ops.moe_combine``, eagerly: ``[T, hidden]`` in ``expert_out``'s dtype, token ``t`` :=
    ``sum_j topk_weights[t, j] * expert_out[slot of (t, j)]`` (float32 sums)."""
    from iris_triton.operations import moe_kernels

    ctx = ops._context
    handle = _handle_of(ops, handle)
    current = None if handle.buffers is None else buffer_versions(ctx, handle.buffers[1] is not None)
    if current != handle.buffers:
        replaced, grew = ("receive buffers", "tokens, experts or capacity") if current[0] != handle.buffers[0] else \
            ("state (kept in a workspace by its plan)", "tokens or experts")
        raise IrisError(f"moe_combine: its dispatch's {replaced} were replaced since by larger ones (dispatch "
                        f"{handle.sequence}; a later dispatch of more {grew} grew them); combine a dispatch before "
                        f"dispatching a larger one, or clone what must live longer")
    if handle.sequence is not None and ops._moe_calls - handle.sequence > 2:
        raise IrisError(f"moe_combine: its dispatch's receive buffers were reused by the dispatch two calls after it "
                        f"(dispatch {handle.sequence}, {ops._moe_calls - handle.sequence - 1} dispatches since); a "
                        f"dispatch's results are views of buffers that alternate between calls: combine it before the "
                        f"dispatch after next, or clone what must live longer")
    _tensor("expert_out", expert_out, ctx, DTYPES, 3)
    L = handle.num_experts // ctx.world_size
    if expert_out.shape[:2] != (L, handle.capacity):
        raise IrisError(f"moe_combine: expert_out has shape {tuple(expert_out.shape)}; it needs [local experts, "
                        f"capacity, hidden] = [{L}, {handle.capacity}, hidden], as the dispatch's tokens")
    out, launches = moe_kernels.combine(ops, expert_out, handle.topk_ids, handle.topk_weights, handle.pair_slots,
                                        handle.call, handle.counts, handle.slot, handle.num_experts, handle.capacity)
    if handle.plan is not None and expert_out.is_contiguous():  # its plan launches expert_out as it is
        handle.plan.keep_combine(expert_out, launches, handle, out)
    return out


def compiled_combine(ops, expert_out, handle) -> torch.Tensor:
    """``ctx.ops.moe_combine`` under torch.compile: the operator ``torch.ops.iris.moe_combine``
    (which runs the eager call) on the handle's tensors, checked as the eager call checks it."""
    handle = _handle_of(ops, handle)
    return torch.ops.iris.moe_combine(expert_out, handle.topk_ids, handle.topk_weights, handle.pair_slots, handle.call,
                                      handle.counts, handle.slot, ops._iris_handle, handle.num_experts,
                                      handle.capacity)


# -- the custom operators (torch.ops.iris.moe_dispatch / moe_combine) ------------------------------------
# Each runs the eager method on the ctx.ops object its handle names, and keeps its place in program
# order (iris.calls.operators). An operator's outputs may not alias each other, so dispatch's
# returns its slot of the receive buffers whole, which compiled code carves (carve_slot).


@torch.library.custom_op("iris::moe_dispatch", mutates_args=())
def _dispatch_operator(tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, handle: int,
                       num_experts: int, capacity: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    ops = lookup(handle)
    made = ops.moe_dispatch(tokens, topk_ids, topk_weights, num_experts, capacity=capacity, fp8=fp8).handle
    # A planned dispatch keeps its counts, pair slots and number in a workspace: the operator's
    # results may not alias one another, and a compiled combine tells a stale dispatch by its number
    # alone.
    return made.slot, _fresh(made.counts), _fresh(made.pair_slots), _fresh(made.call)


def buffer_versions(ctx, planned: bool = True) -> tuple[int, int | None]:
    """The versions of the workspaces a dispatch's results view: its receive buffers and, for a
    dispatch made by its plan (``planned``), its state (pair slots, number), which otherwise are
    tensors of its own (:meth:`iris.collectives.workspaces.Workspaces.version`)."""
    return ctx.workspaces.version("moe_slots"), ctx.workspaces.version("moe_state") if planned else None


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy of it where it is a view (of a workspace)."""
    return tensor if tensor._base is None else tensor.clone()


@_dispatch_operator.register_fake
def _dispatch_shapes(tokens, topk_ids, topk_weights, handle, num_experts, capacity, fp8):
    from iris_triton.operations.moe_kernels import slot_bytes

    world = lookup(handle)._world_size
    size = slot_bytes(world, num_experts, capacity, tokens.shape[1], 1 if fp8 else tokens.element_size())
    return (tokens.new_empty(size, dtype=torch.uint8), tokens.new_empty(num_experts // world, dtype=torch.int32),
            tokens.new_empty(topk_ids.shape, dtype=torch.int32), tokens.new_empty(1, dtype=torch.int32))


@torch.library.custom_op("iris::moe_combine", mutates_args=())
def _combine_operator(expert_out: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      pair_slots: torch.Tensor, call: torch.Tensor, counts: torch.Tensor, slot: torch.Tensor,
                      handle: int, num_experts: int, capacity: int) -> torch.Tensor:
    ops = lookup(handle)
    made = MoeHandle(ops=ops, num_experts=num_experts, capacity=capacity, topk_ids=topk_ids, topk_weights=topk_weights,
                     pair_slots=pair_slots, call=call, counts=counts, slot=slot, sequence=None)
    return ops.moe_combine(expert_out, made)


@_combine_operator.register_fake
def _combine_shapes(expert_out, topk_ids, topk_weights, pair_slots, call, counts, slot, handle, num_experts, capacity):
    return expert_out.new_empty((topk_ids.shape[0], expert_out.shape[2]))


keep_in_program_order("moe_dispatch")
keep_in_program_order("moe_combine")
