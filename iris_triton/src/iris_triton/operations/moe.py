"""Expert-parallel MoE token routing: ``ctx.ops.moe_dispatch`` and ``ctx.ops.moe_combine``.

Experts are split evenly over the ranks: rank ``r`` holds the ``L = E / W`` experts
``[r * L, (r + 1) * L)``. Every shape is static and every count stays on the device, so a call
needs no host synchronisation and can be captured in a CUDA graph (after one eager call of the
largest size, which sizes the workspaces of the collectives it runs on).

Dispatch, on each rank:

1. The ``(token, expert)`` pairs of ``topk_ids`` are sorted by expert, then token, with torch ops
   that do not synchronise (a sort, cumulative sums, scatters). A token that names one expert
   twice is sent there once (combine adds both weights); ``-1`` routes a slot nowhere. Each sent
   row packs the token's index, its fp8 scale and its data (:data:`HEADER_BYTES`).
2. One ``all_gather`` of every rank's per-expert counts (and whether its ids were in range) gives
   every rank the whole routing table: every rank reaches the same verdict on it. A table where
   an expert would receive more than ``capacity`` rows, or where a rank passed ids out of range,
   fails the call on every rank: nothing is sent (the send counts become 0), the failure is
   recorded in the fault words naming the rank concerned, and the result is poisoned.
3. ``all_to_all_vdev`` (:mod:`iris_triton.collectives.all_to_all_v`) moves the rows, packed by destination
   rank; each rank receives them in (source rank, expert, token) order.
4. The receiver copies each received row's data into its expert's slot (one scatter, of the rows
   received only) and gathers the small fields into ``[L, capacity]``; each expert's rows are in
   (source rank, source token index) order.

Combine runs it backwards: gather each received row's expert output back into received order,
``all_to_all_vdev`` it back to its source (where it lands at the row it was sent from), and sum
``topk_weights[t, j] * out[row of (t, j)]`` over ``j`` in float32.

Layout, and why ``[L, capacity, hidden]`` with device counts rather than a flat buffer: each
expert's rows start at a fixed place, so a grouped (masked) GEMM takes the tensor as it is and
its shape never depends on the routing. The price is memory for the worst case: the default
capacity, ``W * T`` (every rank's every token, once per expert), always holds.

A failure (a peer that never calls, a routing that overflows, ids out of range) fills the
result's tensors (or combine's output) with all-ones bits: NaN, integers -1
(:func:`finish_kernel`), and the host raises IrisTimeoutError at the call (CPU ranks) or at the
next iris call (GPUs).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from iris.errors import IrisError
from iris_triton.device.context import DeviceContext
from iris_triton.protocol.waits import failed, failure_code, record_failure

__all__ = ["DTYPES", "FP8_MAX", "HEADER_BYTES", "MoeDispatch", "MoeHandle", "combine", "dispatch", "finish_kernel"]

#: Element types of ``tokens`` and of combine's expert outputs.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The largest finite float8_e4m3fn: a token's scale is its largest magnitude over this.
FP8_MAX = 448.0
#: Bytes in front of each moved row's data: the source token's index (int32), its fp8 scale (float32).
HEADER_BYTES = 8
#: Moved rows are padded to a multiple of this many bytes (they move as int32 words).
ROW_ALIGNMENT = 16
#: Bytes one program of :func:`finish_kernel` poisons per step.
POISON_BLOCK = 1024


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
    all-ones bits (NaN, integers -1)."""

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


@triton.jit
def finish_kernel(context, out, numel, verdict, RANK: tl.constexpr, WORLD: tl.constexpr, RECORD: tl.constexpr,
                  IDS_CODE: tl.constexpr, CAPACITY_CODE: tl.constexpr, BLOCK: tl.constexpr):
    """The end of a call: with ``RECORD``, record the routing table's verdict (``verdict``: int32
    [2 * WORLD], the ranks that passed ids out of range, then those with an expert over
    capacity); then, if the verdict or any earlier failure of this rank failed the call, fill
    ``out`` (``numel`` bytes) with all-ones bits. No wait: every rank has the same verdict."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    lanes = tl.arange(0, BLOCK)
    bad = failed(dctx)
    if RECORD:
        found = tl.sum(tl.load(verdict + lanes, mask=lanes < 2 * WORLD, other=0), axis=0) != 0
        if tl.program_id(0) == 0:
            for q in tl.static_range(WORLD):
                if tl.load(verdict + q) != 0:
                    record_failure(dctx, q, IDS_CODE)
                if tl.load(verdict + WORLD + q) != 0:
                    record_failure(dctx, q, CAPACITY_CODE)
        bad = bad | found
    if bad:
        for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
            tl.store(out + start + lanes, tl.full((BLOCK,), -1, tl.int8), mask=start + lanes < numel)


def _finish(ctx, out: torch.Tensor, verdict: torch.Tensor | None) -> None:
    """Launch :func:`finish_kernel` over ``out``'s bytes (``verdict``: None in combine, which
    records nothing: its failures are those of the collectives it runs on)."""
    flat = out.view(-1).view(torch.int8)
    programs = max(1, min(ctx.programs, triton.cdiv(flat.numel(), POISON_BLOCK)))
    finish_kernel[(programs,)](
        ctx.get_device_context(), flat, flat.numel(), ctx.faults if verdict is None else verdict, RANK=ctx.rank,
        WORLD=ctx.world_size, RECORD=verdict is not None, IDS_CODE=failure_code("moe_dispatch", "expert_ids"),
        CAPACITY_CODE=failure_code("moe_dispatch", "expert_capacity"), BLOCK=POISON_BLOCK)


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


def _packed_rows(tokens: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, int]:
    """Every token as one row of bytes: its index (int32), its fp8 scale (float32; 0 without
    fp8), its data (fp8 or as given), zeros to :data:`ROW_ALIGNMENT`. ``(rows, data bytes)``."""
    T, H = tokens.shape
    if fp8:
        x = tokens.float()
        amax = x.abs().amax(dim=1)
        scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        data = (x / scales[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        scales, data = torch.zeros(T, device=tokens.device), tokens.contiguous().view(torch.uint8)
    data_bytes = data.shape[1]
    row_bytes = triton.cdiv(HEADER_BYTES + data_bytes, ROW_ALIGNMENT) * ROW_ALIGNMENT
    rows = torch.zeros(T, row_bytes, dtype=torch.uint8, device=tokens.device)
    rows[:, 0:4] = torch.arange(T, dtype=torch.int32, device=tokens.device).view(torch.uint8).view(T, 4)
    rows[:, 4:8] = scales.view(torch.uint8).view(T, 4)
    rows[:, HEADER_BYTES:HEADER_BYTES + data_bytes] = data
    return rows, data_bytes


def dispatch(ops, tokens: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             capacity: int | None, fp8: bool) -> MoeDispatch:
    """``ctx.ops.moe_dispatch`` (:mod:`iris_triton.operations.moe_kernels`)."""
    from iris_triton.operations import moe_kernels

    ctx = ops._context
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
