"""All-reduce fused with the residual add and RMSNorm of a transformer layer
(``ctx.ops.all_reduce_rmsnorm``):

    s = all_reduce(x) + residual            (sum over ranks, in float32)
    out = rms_norm(s, (hidden,), weight, eps)  (in float32, stored in out's dtype)
    residual_out = s                       (optional, in x's dtype)

One kernel source, :func:`all_reduce_rmsnorm_kernel`, compiled by the context's front end (a
Triton kernel for the Triton backend, a Gluon kernel for the Gluon backend), runs one of two
methods in one launch:

- ``"one_shot"``: every rank pushes its rows of ``x`` into its region of every peer's workspace
  slot and signals; then every rank reduces every row itself (its own ``x`` and what the peers
  pushed, in rank order, so every rank gets the same bits), adds the residual and normalises.
  One exchange of signals; each rank receives ``world_size - 1`` copies of the whole input.
- ``"two_shot"``: the rows are split among the ranks (``share = ceil(tokens / world_size)``
  rows each, rank r owning rows ``[r * share, (r + 1) * share)``). Each rank pushes every peer
  the rows that peer owns; each then reduces its own rows, adds the residual, normalises, and
  pushes the finished rows of ``out`` (and ``residual_out``) to every peer, which copies them
  into place once signalled. Two exchanges; each rank receives only about twice its share.

Rows are normalised whole, so a row is one program's: program ``p`` of a grid of ``P`` handles
rows ``p, p + P, ...`` (two-shot: of every rank's share), in chunks of ``BLOCK`` elements; a row
of more than one chunk is summed twice (once for its mean square, once for its output), which
keeps only one chunk in registers. Program ``p`` synchronises with program ``p`` of its peers
on the collectives' sync words (:mod:`iris_triton.protocol.calls`, as :mod:`iris_triton.collectives.kernels` does: call
numbers, signal counts, headers), and reads only what the same program of its peers pushed.

The workspace (``ctx.workspaces``, named :data:`WORKSPACE`) has two slots used on alternate
calls, each of one region per source rank, laid out by the workspace's size, not the call's
(:meth:`iris.collectives.workspaces.Workspaces.slot_regions`); a rank's call ``k + 2`` reuses the slot of
call ``k`` only after call ``k + 1`` exchanged signals with every peer, which they sent after
finishing call ``k``. Nothing runs on the host per call beyond the checks: the counts live on
the heap and the kernel advances them, so calls can be captured in CUDA graphs.

Failures follow the collectives' rule (:mod:`iris_triton.protocol.waits`): every wait is bounded by the
context's timeout and records a give-up in the fault words; a peer that announced a different
call (another method, shape, dtype, or with and without ``residual_out``) is recorded as a
mismatch; then the program fills the rows it writes of ``out`` and ``residual_out`` with NaN (not
the others: another program may still push rows of an ``x`` they alias), and the host raises at
the call (CPU ranks: then it fills all of both) or at the next iris call (GPUs).
"""

from __future__ import annotations

import numbers
import zlib

import torch
import triton
import triton.language as tl

from iris.calls.repeats import offer
from iris.errors import IrisError
from iris_triton.protocol.calls import announce, header_value, headers_of
from iris_triton.collectives.kernels import (MAX_WORKSPACE_ELEMENTS, _finish, _program_state, _signal_peers,
                                             _wait_peers)
from iris_triton.protocol.reductions import own_block, reduce_in_rank_order, stacked_block
from iris_triton.device.tracing import OPERATION_EVENT
from iris_triton.tuning import ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO, RMSNORM_SHAPES
from iris_triton.protocol.waits import failed, peers_announced, poison_blocks, site_code

__all__ = ["DTYPES", "METHODS", "WORKSPACE", "all_reduce_rmsnorm", "all_reduce_rmsnorm_kernel", "choose_method"]

#: What ``method=`` accepts (None: :func:`choose_method`).
METHODS = ("one_shot", "two_shot")
#: Element types of x, residual, out and residual_out (one of them for all four) and of weight.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: The workspace the kernel's data moves through.
WORKSPACE = "all_reduce_rmsnorm"
SITE = "all_reduce_rmsnorm"


# -- device helpers (compiled in the caller's language) ------------------------------------------------


@triton.jit
def _row_chunk(dctx, x, residual, received, row, r, c, hidden, region, RANK: tl.constexpr, WORLD: tl.constexpr,
               BLOCK: tl.constexpr):
    """``(s, offs, mask)`` of chunk ``c`` of row ``row``: every rank's ``x`` (this rank's own,
    peer q's from ``received + q * region`` at row ``r`` of the region) summed in float32 in rank
    order, plus the residual; 0 outside the row."""
    offs = dctx.block_offsets(x, c * BLOCK, BLOCK)
    mask = offs < hidden
    acc, _ = reduce_in_rank_order(own_block, stacked_block,
                                  (x + row * hidden, received + r * hidden, offs, mask, region), RANK, WORLD, "sum")
    s = acc + tl.load(residual + row * hidden + offs, mask=mask).to(tl.float32)
    return tl.where(mask, s, 0.0), offs, mask


@triton.jit
def _store_chunk(dctx, s, rstd, offs, mask, weight, out, residual_out, slot, row, r, hidden, region, part,
                 RANK: tl.constexpr, WORLD: tl.constexpr, TWO_SHOT: tl.constexpr, RESIDUAL_OUT: tl.constexpr):
    """Chunk ``offs`` of row ``row``: ``out`` := ``s`` normalised and scaled, ``residual_out``
    := ``s``; two-shot: both also into every peer's region ``RANK`` (parts 1 and 2, row ``r``)."""
    y = (s * rstd * tl.load(weight + offs, mask=mask).to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + row * hidden + offs, y, mask=mask)
    kept = s.to(residual_out.dtype.element_ty)
    if RESIDUAL_OUT:
        tl.store(residual_out + row * hidden + offs, kept, mask=mask)
    if TWO_SHOT:
        mine = slot + RANK * region + r * hidden + offs
        for q in tl.static_range(WORLD):
            if q != RANK:
                dctx.store(mine + part, y, q, mask=mask)
                if RESIDUAL_OUT:
                    dctx.store(mine + 2 * part, kept, q, mask=mask)


@triton.jit
def _normalize_row(dctx, x, residual, weight, out, residual_out, slot, row, r, hidden, region, part, eps,
                   RANK: tl.constexpr, WORLD: tl.constexpr, TWO_SHOT: tl.constexpr, RESIDUAL_OUT: tl.constexpr,
                   BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Row ``row`` (row ``r`` of the regions) reduced, added to the residual and normalised.
    Chunk 0 stays in registers between the two passes; the others are summed again."""
    s, offs, mask = _row_chunk(dctx, x, residual, slot, row, r, 0, hidden, region, RANK, WORLD, BLOCK)
    squares = s * s
    for c in range(1, CHUNKS):
        t, _, _ = _row_chunk(dctx, x, residual, slot, row, r, c, hidden, region, RANK, WORLD, BLOCK)
        squares += t * t
    rstd = tl.rsqrt(tl.sum(squares, axis=0) / hidden + eps)
    _store_chunk(dctx, s, rstd, offs, mask, weight, out, residual_out, slot, row, r, hidden, region, part, RANK,
                 WORLD, TWO_SHOT, RESIDUAL_OUT)
    for c in range(1, CHUNKS):
        t, o, m = _row_chunk(dctx, x, residual, slot, row, r, c, hidden, region, RANK, WORLD, BLOCK)
        _store_chunk(dctx, t, rstd, o, m, weight, out, residual_out, slot, row, r, hidden, region, part, RANK,
                     WORLD, TWO_SHOT, RESIDUAL_OUT)


@triton.jit
def _push_rows(dctx, x, slot, tokens, share, hidden, region, RANK: tl.constexpr, WORLD: tl.constexpr,
               TWO_SHOT: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """This program's rows of ``x`` into every peer's region ``RANK`` (part 0): one-shot every
    row, two-shot the rows of the peer's share."""
    for r in range(tl.program_id(0), share, tl.num_programs(0)):
        for c in range(CHUNKS):
            offs = dctx.block_offsets(x, c * BLOCK, BLOCK)
            target = slot + RANK * region + r * hidden + offs
            if TWO_SHOT:
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        mask = offs < tl.where(q * share + r < tokens, hidden, 0)  # no columns past the last token
                        dctx.store(target, tl.load(x + (q * share + r) * hidden + offs, mask=mask), q, mask=mask)
            else:
                mask = offs < hidden
                v = tl.load(x + r * hidden + offs, mask=mask)
                for q in tl.static_range(WORLD):
                    if q != RANK:
                        dctx.store(target, v, q, mask=mask)


@triton.jit
def _collect_rows(dctx, out, residual_out, slot, tokens, share, hidden, region, part, RANK: tl.constexpr,
                  WORLD: tl.constexpr, RESIDUAL_OUT: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Two-shot, last: the finished rows every peer pushed (parts 1 and 2 of its region) into
    place in ``out`` and ``residual_out``."""
    for r in range(tl.program_id(0), share, tl.num_programs(0)):
        for q in tl.static_range(WORLD):
            if q != RANK:
                row = q * share + r
                for c in range(CHUNKS):
                    offs = dctx.block_offsets(out, c * BLOCK, BLOCK)
                    mask = offs < tl.where(row < tokens, hidden, 0)
                    source = slot + q * region + r * hidden + offs
                    tl.store(out + row * hidden + offs, tl.load(source + part, mask=mask), mask=mask)
                    if RESIDUAL_OUT:
                        tl.store(residual_out + row * hidden + offs, tl.load(source + 2 * part, mask=mask),
                                 mask=mask)


@triton.jit
def _poison_rows(dctx, out, residual_out, tokens, share, hidden, RANK: tl.constexpr, WORLD: tl.constexpr,
                 TWO_SHOT: tl.constexpr, RESIDUAL_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """All-ones bits (NaN) into the rows of ``out`` and ``residual_out`` this program writes,
    and no others (another program may still push rows of ``x`` that alias them)."""
    for r in range(tl.program_id(0), share, tl.num_programs(0)):
        for q in tl.static_range(WORLD if TWO_SHOT else 1):
            row = q * share + r
            if row < tokens:
                poison_blocks(dctx, out + row * hidden, hidden, hidden, 0, 1, BLOCK)
                if RESIDUAL_OUT:
                    poison_blocks(dctx, residual_out + row * hidden, hidden, hidden, 0, 1, BLOCK)


# -- the kernel source ---------------------------------------------------------------------------------


def all_reduce_rmsnorm_kernel(context, x, residual, weight, out, residual_out, ws, sync, programs, tokens, share,
                              hidden, region, eps, signature, CTX: tl.constexpr,
                              TRACING: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, TWO_SHOT: tl.constexpr,
                              RESIDUAL_OUT: tl.constexpr, SITE: tl.constexpr, BLOCK: tl.constexpr,
                              CHUNKS: tl.constexpr):
    """One call by the protocol above, for ``tokens`` rows of ``hidden`` elements (``CHUNKS``
    chunks of ``BLOCK``); ``share`` is the rows a rank normalises (one-shot: ``tokens``);
    ``ws`` is the workspace, two slots of ``WORLD`` regions of ``region`` elements each (two-shot:
    three parts of ``share * hidden``: pushed ``x``, finished ``out``, finished
    ``residual_out``). Without ``RESIDUAL_OUT``, ``residual_out`` is never written."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    call, count, flags = _program_state(sync, programs)
    span = dctx.tracing.begin(OPERATION_EVENT + SITE, op=call,
                              nbytes=tokens * hidden * (x.dtype.element_ty.primitive_bitwidth // 8))
    headers = headers_of(sync, programs, call, WORLD)
    announced = header_value(call, signature)
    announce(dctx, headers, announced, RANK, WORLD)
    slot = ws + (call & 1) * WORLD * region
    part = share * hidden
    alive = not failed(dctx)  # a failed context sends peers nothing, and its outputs are NaN
    if alive:
        _push_rows(dctx, x, slot, tokens, share, hidden, region, RANK, WORLD, TWO_SHOT, BLOCK, CHUNKS)
    count += 1
    _signal_peers(dctx, flags, count, RANK, WORLD)
    ok = alive & _wait_peers(dctx, flags, count, headers, announced, RANK, WORLD, SITE)
    ok = ok & peers_announced(dctx, headers, announced, RANK, WORLD, SITE, False)
    if ok:  # nothing computed from another call's data may reach out, or a peer
        first = RANK * share if TWO_SHOT else 0
        for r in range(tl.program_id(0), share, tl.num_programs(0)):
            if first + r < tokens:
                _normalize_row(dctx, x, residual, weight, out, residual_out, slot, first + r, r, hidden, region,
                               part, eps, RANK, WORLD, TWO_SHOT, RESIDUAL_OUT, BLOCK, CHUNKS)
    if TWO_SHOT:
        count += 1
        if ok:
            _signal_peers(dctx, flags, count, RANK, WORLD)
        ok = ok & _wait_peers(dctx, flags, count, headers, announced, RANK, WORLD, SITE)
        if ok:
            _collect_rows(dctx, out, residual_out, slot, tokens, share, hidden, region, part, RANK, WORLD,
                          RESIDUAL_OUT, BLOCK, CHUNKS)
    _finish(dctx, sync, programs, call, count)
    if not ok:
        _poison_rows(dctx, out, residual_out, tokens, share, hidden, RANK, WORLD, TWO_SHOT, RESIDUAL_OUT, BLOCK)
    dctx.tracing.end(span)


# -- launching -----------------------------------------------------------------------------------------


def choose_method(world_size: int, nbytes: int) -> str:
    """The built-in method for ``nbytes`` of ``x`` per rank on ``world_size`` ranks
    (:data:`iris_triton.tuning.ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO`), where the context's tuning
    (``ctx.tuning``, :mod:`iris.tuning`) has none for the call."""
    limits = ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO
    return "one_shot" if nbytes <= limits.get(world_size, limits[None]) else "two_shot"


def _check(ctx, out, x, residual, weight, eps, residual_out, method) -> None:
    """An IrisError (TypeError for a non-tensor) saying what is wrong with the arguments."""
    name = "all_reduce_rmsnorm"
    tensors = {"out": out, "x": x, "residual": residual, "weight": weight}
    if residual_out is not None:
        tensors["residual_out"] = residual_out
    for what, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != ctx.device:
            raise IrisError(f"{name}: {what} is on {tensor.device}, but this context runs on {ctx.device}; move it "
                            f"with .to({str(ctx.device)!r})")
        if tensor.dtype not in DTYPES:
            raise IrisError(f"{name}: {what} has dtype {tensor.dtype}; supported: torch.bfloat16, torch.float16, "
                            f"torch.float32")
        if not tensor.is_contiguous():
            fix = "a contiguous output (torch.empty_like(x))" if what in ("out", "residual_out") else \
                f"{what}.contiguous()"
            raise IrisError(f"{name}: {what} is not contiguous; pass {fix}")
    if x.dim() != 2:
        raise IrisError(f"{name}: x must be [tokens, hidden] (2-D), got shape {tuple(x.shape)}")
    for what in ("out", "residual", "residual_out"):
        if what in tensors and tensors[what].shape != x.shape:
            raise IrisError(f"{name}: {what} has shape {tuple(tensors[what].shape)}; expected x's shape "
                            f"{tuple(x.shape)}")
        if what in tensors and tensors[what].dtype != x.dtype:
            raise IrisError(f"{name}: {what} has dtype {tensors[what].dtype}, x {x.dtype}; use x's dtype")
    if tuple(weight.shape) != (x.shape[1],):
        raise IrisError(f"{name}: weight has shape {tuple(weight.shape)}; expected ({x.shape[1]},), one per element "
                        f"of a row of x")
    if residual_out is not None and residual_out.data_ptr() == out.data_ptr() and out.numel():
        raise IrisError(f"{name}: residual_out and out are the same memory; pass separate tensors")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise IrisError(f"{name}: eps must be a number >= 0, got {eps!r}")
    if method is not None and method not in METHODS:
        raise IrisError(f"{name}: method={method!r} is not one of {', '.join(METHODS)} (or None to choose by size)")


def _signature(method: str, x: torch.Tensor, residual_out: torch.Tensor | None) -> int:
    """16 bits (never 0) that every rank's identical call shares: what decides the data's layout."""
    what = (SITE, method, tuple(x.shape), str(x.dtype), residual_out is not None)
    return zlib.crc32(repr(what).encode()) & 0xFFFF | 1


def all_reduce_rmsnorm(ctx, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, residual_out: torch.Tensor | None = None, *,
                       method: str | None = None) -> torch.Tensor:
    """Launch the fused all-reduce + residual add + RMSNorm on ``ctx`` (see the module) and
    return ``out``. Collective: every rank calls it with tensors of the same shapes and dtype,
    the same ``method`` and with or without ``residual_out`` alike."""
    _check(ctx, out, x, residual, weight, eps, residual_out, method)
    tokens, hidden = x.shape
    world, size = ctx.world_size, x.element_size()
    method = method or ctx.tuning.method("all_reduce_rmsnorm", METHODS, world, x.dtype, (hidden,), tokens) or \
        choose_method(world, x.numel() * size)
    if x.numel() == 0:
        return out
    two_shot = method == "two_shot"
    share = triton.cdiv(tokens, world) if two_shot else tokens
    parts = (3 if residual_out is not None else 2) if two_shot else 1
    if 2 * world * parts * share * hidden > MAX_WORKSPACE_ELEMENTS:
        raise IrisError(f"all_reduce_rmsnorm: {tokens} x {hidden} elements per rank is too large for one call "
                        f"(workspace offsets are 32-bit); split the tokens into smaller calls")
    signature = _signature(method, x, residual_out)
    outer = ctx._describe_call("ops.all_reduce_rmsnorm", signature, describe(x, residual_out, method))
    try:
        _launch(ctx, out, x, residual, weight, eps, residual_out, two_shot, share, parts, signature)
    finally:
        ctx._end_call(outer)
    return out


def describe(x: torch.Tensor, residual_out: torch.Tensor | None, method: str) -> str:
    """A call as errors name it (what its signature covers)."""
    return (f"all_reduce_rmsnorm(x {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}, residual_out "
            f"{'given' if residual_out is not None else 'None'}, method={method})")


def _launch(ctx, out, x, residual, weight, eps, residual_out, two_shot: bool, share: int, parts: int,
            signature: int) -> None:
    """The kernel's launch for :func:`all_reduce_rmsnorm`'s call."""
    tokens, hidden = x.shape
    world, size = ctx.world_size, x.element_size()
    space, region_bytes = ctx.workspaces.slot_regions(WORKSPACE, parts * share * hidden * size, fill=None)
    if 2 * world * (region_bytes // size) > MAX_WORKSPACE_ELEMENTS:  # grown by an earlier call of wider elements
        raise IrisError(f"all_reduce_rmsnorm: the workspace, grown by the largest call so far, holds more {x.dtype} "
                        f"elements than 32-bit offsets reach; make the largest calls in this dtype, or smaller ones")
    shape = RMSNORM_SHAPES[ctx.kernel_device_type]
    block = min(triton.next_power_of_2(hidden), shape["MAX_BLOCK"])
    options = {"num_warps": max(1, min(shape["MAX_WARPS"], block // shape["ELEMENTS_PER_WARP"]))} \
        if "MAX_WARPS" in shape else {}
    front = ctx.frontend
    outputs = (out,) if residual_out is None else (out, residual_out)
    with ctx._call("ops.all_reduce_rmsnorm", outputs):  # on a failure, the host poisons every row of both
        repeat = front.launch(
            all_reduce_rmsnorm_kernel, (max(1, min(ctx.programs, share)),), context=ctx.get_device_context(), x=x,
            residual=residual, weight=weight, out=out, residual_out=out if residual_out is None else residual_out,
            ws=space[:2 * world * region_bytes].view(x.dtype), sync=ctx.collective_sync(), programs=ctx.programs,
            tokens=tokens, share=share, hidden=hidden, region=region_bytes // size, eps=float(eps),
            signature=signature, CTX=front.device_context,
            TRACING=ctx.tracing.enabled, RANK=ctx.rank, WORLD=world,
            TWO_SHOT=two_shot, RESIDUAL_OUT=residual_out is not None, SITE=site_code(SITE), BLOCK=block,
            CHUNKS=triton.cdiv(hidden, block), **options)
    offer(ctx, repeat)  # what an identical call runs (iris.calls.repeats)
