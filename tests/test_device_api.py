"""The device API across real ranks, one conformance suite for every backend: every device
function, both as ``iris.<name>`` free functions and as methods of the backend's device context
(Triton's ``DeviceContext``, Gluon's ``IrisDeviceCtx``). Each kernel below is one source that the
backend's front end compiles (``_launch``); a backend whose kernels cannot run on the ranks
available is skipped by that capability (Gluon needs GPUs).

Ranks are GPUs when there are enough of them, else CPU processes whose kernels run in Triton's
interpreter. Starting ranks costs seconds and interpreted kernels are slow, so one module-level
worker per world size makes all the checks on tiny, ragged sizes and returns what it saw as
``{check name: True | False | error text}``; the tests below assert on that report by section, so
a failure names the check, the rank and the dtype.

Data is random (seeded torch generators, seeded by the writing rank so every reader can
recompute it) and compared with ``torch.equal`` against the expected tensor built in torch.
"""

from __future__ import annotations

import ast
import inspect
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import iris
import iris_triton
from iris.errors import IrisTimeoutError
from iris.testing import RankReport, backend_rank_device, seeded_generator, spawn_reports
from iris_triton.device.clock import now_ns
from iris_triton.device.context import DeviceContext, method_source
from iris_triton.protocol.waits import failed

REPO = Path(__file__).resolve().parents[1]

BLOCK = 32
N = 37  # two programs of BLOCK: the second one's mask has a ragged tail of 5
PAD = 64  # buffers span the whole grid, so what masked-off lanes did (or did not) write is visible
OTHER = -3.0  # ``other`` of the masked loads (a float: Triton 3.6's interpreter casts an int ``other`` to
#               bfloat16 bit-wise, a bug of the interpreter, not of iris)
DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32)
SEMS = ("relaxed", "acquire", "release", "acq_rel")
SCOPES = ("cta", "gpu", "sys")
COMBOS = [(sem, scope) for sem in SEMS for scope in SCOPES]
APIS = ("free", "ctx")
#: Atomic rows per dtype: each op runs on its own row of a [rows, PAD] buffer on the target rank.
ATOMIC_ROWS = {
    torch.int32: ("add", "sub", "min", "max", "and", "or", "xor", "xchg", "cas"),
    torch.int64: ("add", "sub", "min", "max", "and", "or", "xor", "xchg", "cas"),
    torch.float32: ("add", "sub", "min", "max", "xchg"),  # xchg: through integers in the interpreter
}
RING_ROUNDS = 4
BARRIER_ROUNDS = 5
#: Seconds every wait of the ranks' context may last (``create(timeout=...)``).
RANK_TIMEOUT = 60
#: Nanoseconds of the waits that must time out (the interpreter reads a flag in about a millisecond).
SHORT_TIMEOUT_NS = 50_000_000
#: Nanoseconds of the wait whose give-up is timed inside the kernel, and how much later than its
#: timeout it may give up: generous, as an interpreted spin or a descheduled rank takes long.
TIMED_WAIT_NS = 300_000_000
TIMED_WAIT_SLACK_NS = 3_000_000_000
#: (CMP, flag minus compared value, expected result) for wait_until against a flag holding V.
CMP_CASES = [
    ("eq", 0, True), ("eq", -1, False), ("ne", -1, True), ("ne", 0, False),
    ("gt", 1, True), ("gt", 0, False), ("ge", 0, True), ("ge", -1, False),
    ("lt", -1, True), ("lt", 0, False), ("le", 0, True), ("le", 1, False),
]


# -- kernels: data movement ---------------------------------------------------------------------------------


def _move_free_kernel(context, src, loaded_next, loaded_prev, loaded_self, got, put_dst, stored_dst, copied_dst,
                      heap_bases, n, nxt, prv, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                      OTHER: tl.constexpr, BLOCK: tl.constexpr):
    offs = CTX.initialize(context, RANK, WORLD).block_offsets(src, tl.program_id(0) * BLOCK, BLOCK)
    mask = offs < n
    # Loads store all lanes, so the masked-off ones show ``other``.
    tl.store(loaded_next + offs, iris.load(src + offs, RANK, nxt, heap_bases, mask=mask, other=OTHER))
    tl.store(loaded_prev + offs, iris.load(src + offs, RANK, prv, heap_bases, mask=mask, other=OTHER,
                                           cache_modifier=".cg"))
    tl.store(loaded_self + offs, iris.load(src + offs, RANK, RANK, heap_bases, mask=mask, other=OTHER))
    iris.get(src + offs, got + offs, RANK, prv, heap_bases, mask=mask)  # prv's src -> my got (I am from_rank)
    iris.put(src + offs, put_dst + offs, RANK, nxt, heap_bases, mask=mask)  # my src -> nxt's put_dst
    mine = tl.load(src + offs, mask=mask)
    iris.store(stored_dst + offs, mine, RANK, prv, heap_bases, mask=mask)  # my src -> prv's stored_dst
    iris.copy(src + offs, copied_dst + offs, nxt, prv, RANK, heap_bases, mask=mask)  # nxt's src -> prv


def _move_ctx_kernel(context, src, loaded_next, loaded_prev, got, put_dst, stored_dst, copied_dst, n, nxt, prv,
                     CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, OTHER: tl.constexpr,
                     BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(src, tl.program_id(0) * BLOCK, BLOCK)
    mask = offs < n
    tl.store(loaded_next + offs, dctx.load(src + offs, nxt, mask=mask, other=OTHER))
    tl.store(loaded_prev + offs, dctx.load(src + offs, prv, mask=mask, other=OTHER, volatile=True))
    dctx.get(src + offs, got + offs, prv, mask=mask)
    dctx.put(src + offs, put_dst + offs, nxt, mask=mask)
    dctx.store(stored_dst + offs, tl.load(src + offs, mask=mask), prv, mask=mask)
    dctx.copy(src + offs, copied_dst + offs, nxt, prv, mask=mask)


def _translate_kernel(context, buf, out, heap_bases, peer, CTX: tl.constexpr, RANK: tl.constexpr,
                      WORLD: tl.constexpr, BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(buf, 0, BLOCK)
    tl.store(out + offs, iris.translate(buf + offs, RANK, peer, heap_bases).to(tl.int64))
    tl.store(out + BLOCK + offs, dctx.translate(buf + offs, peer).to(tl.int64))


# -- kernels: atomics ----------------------------------------------------------------------------------------


@triton.jit
def _apply(OP: tl.constexpr, ROW: tl.constexpr, buf, vals, cmps, olds, offs, mask, target, heap_bases, dctx,
           RANK: tl.constexpr, API: tl.constexpr, SEM: tl.constexpr, SCOPE: tl.constexpr, PAD: tl.constexpr):
    """Row ``ROW`` of ``buf`` on ``target`` op= this rank's row of ``vals``; old values to ``olds``."""
    ptr = buf + ROW * PAD + offs
    val = tl.load(vals + ROW * PAD + offs)
    if OP == "cas":  # no mask: every lane of the row
        cmp = tl.load(cmps + ROW * PAD + offs)
        if API:
            old = dctx.atomic_cas(ptr, cmp, val, target, sem=SEM, scope=SCOPE)
        else:
            old = iris.atomic_cas(ptr, cmp, val, RANK, target, heap_bases, sem=SEM, scope=SCOPE)
        tl.store(olds + ROW * PAD + offs, old)
    else:
        if OP == "add":
            if API:
                old = dctx.atomic_add(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_add(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        elif OP == "sub":
            if API:
                old = dctx.atomic_sub(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_sub(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        elif OP == "min":
            if API:
                old = dctx.atomic_min(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_min(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        elif OP == "max":
            if API:
                old = dctx.atomic_max(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_max(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        elif OP == "and":
            if API:
                old = dctx.atomic_and(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_and(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        elif OP == "or":
            if API:
                old = dctx.atomic_or(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_or(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        elif OP == "xor":
            if API:
                old = dctx.atomic_xor(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_xor(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        else:
            tl.static_assert(OP == "xchg")
            if API:
                old = dctx.atomic_xchg(ptr, val, target, mask=mask, sem=SEM, scope=SCOPE)
            else:
                old = iris.atomic_xchg(ptr, val, RANK, target, heap_bases, mask=mask, sem=SEM, scope=SCOPE)
        tl.store(olds + ROW * PAD + offs, old, mask=mask)


def _atomics_kernel(context, i32, v32, c32, o32, i64, v64, c64, o64, f32, vf32, of32, heap_bases, n, target,
                    CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, API: tl.constexpr,
                    SEM: tl.constexpr, SCOPE: tl.constexpr, PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Every rank runs every atomic into the same rows of ``target``'s heap at once. The rows
    follow ATOMIC_ROWS."""
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(i32, tl.program_id(0) * BLOCK, BLOCK)
    mask = offs < n
    _apply("add", 0, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("sub", 1, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("min", 2, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("max", 3, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("and", 4, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("or", 5, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("xor", 6, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("xchg", 7, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("cas", 8, i32, v32, c32, o32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("add", 0, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("sub", 1, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("min", 2, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("max", 3, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("and", 4, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("or", 5, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("xor", 6, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("xchg", 7, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("cas", 8, i64, v64, c64, o64, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("add", 0, f32, vf32, vf32, of32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("sub", 1, f32, vf32, vf32, of32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("min", 2, f32, vf32, vf32, of32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("max", 3, f32, vf32, vf32, of32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)
    _apply("xchg", 4, f32, vf32, vf32, of32, offs, mask, target, heap_bases, dctx, RANK, API, SEM, SCOPE, PAD)


def _cas_chain_kernel(context, flag, out, heap_bases, target, timeout_ns, CTX: tl.constexpr, RANK: tl.constexpr,
                      WORLD: tl.constexpr, API: tl.constexpr):
    """Ranks take turns on one flag of ``target``: rank r moves it from r to r + 1 with
    compare-and-swap, retrying while it holds another value (a failed cas must not write), for
    at most ``timeout_ns`` of wall-clock time."""
    dctx = CTX.initialize(context, RANK, WORLD)
    if API:
        old = dctx.atomic_cas(flag, RANK, RANK + 1, target)
    else:
        old = iris.atomic_cas(flag, RANK, RANK + 1, RANK, target, heap_bases)
    start = now_ns()
    while old != RANK and now_ns() - start < timeout_ns:
        if API:
            old = dctx.atomic_cas(flag, RANK, RANK + 1, target)
        else:
            old = iris.atomic_cas(flag, RANK, RANK + 1, RANK, target, heap_bases)
    tl.store(out, old)


# -- kernels: flags --------------------------------------------------------------------------------------------


@triton.jit
def _signal(ptr, value, to_rank, heap_bases, dctx, RANK: tl.constexpr, API: tl.constexpr):
    if API:
        old = dctx.signal(ptr, value, to_rank)
    else:
        old = iris.signal(ptr, value, RANK, to_rank, heap_bases)
    return old


@triton.jit
def _wait(ptr, value, rank, timeout_ns, heap_bases, dctx, RANK: tl.constexpr, API: tl.constexpr,
          CMP: tl.constexpr):
    if API:
        ok = dctx.wait_until(ptr, value, rank, timeout_ns, CMP=CMP)
    else:
        ok = iris.wait_until(ptr, value, RANK, rank, heap_bases, timeout_ns, CMP=CMP)
    return ok.to(tl.int32)


def _ring_kernel(context, flags, mailbox, messages, received, results, cmp_results, heap_bases, n, nxt, rounds,
                 timeout_ns, short_ns, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                 API: tl.constexpr, BLOCK: tl.constexpr):
    """Message passing on a ring: each round, store a message into ``nxt``'s mailbox slot and
    signal its flag; wait for ``prv``'s signal on our own flag and read the slot it filled. Then
    compare ``nxt``'s flag (which only we write) with every CMP, and wait on flags nobody sets."""
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(messages, 0, BLOCK)
    mask = offs < n
    for k in range(1, rounds + 1):
        slot = (k - 1) * BLOCK
        message = tl.load(messages + slot + offs, mask=mask)
        if API:
            dctx.store(mailbox + slot + offs, message, nxt, mask=mask)
        else:
            iris.store(mailbox + slot + offs, message, RANK, nxt, heap_bases, mask=mask)
        old = _signal(flags, k, nxt, heap_bases, dctx, RANK, API)
        ok = _wait(flags, k, RANK, timeout_ns, heap_bases, dctx, RANK, API, "ge")
        tl.store(received + slot + offs, tl.load(mailbox + slot + offs, mask=mask, volatile=True), mask=mask)
        tl.store(results + 2 * (k - 1), ok)
        tl.store(results + 2 * (k - 1) + 1, old)
    # nxt's flag holds ``rounds`` now. Each case compares it with rounds - delta (CMP_CASES).
    v = rounds
    tl.store(cmp_results + 0, _wait(flags, v, nxt, short_ns, heap_bases, dctx, RANK, API, "eq"))
    tl.store(cmp_results + 1, _wait(flags, v + 1, nxt, short_ns, heap_bases, dctx, RANK, API, "eq"))
    tl.store(cmp_results + 2, _wait(flags, v + 1, nxt, short_ns, heap_bases, dctx, RANK, API, "ne"))
    tl.store(cmp_results + 3, _wait(flags, v, nxt, short_ns, heap_bases, dctx, RANK, API, "ne"))
    tl.store(cmp_results + 4, _wait(flags, v - 1, nxt, short_ns, heap_bases, dctx, RANK, API, "gt"))
    tl.store(cmp_results + 5, _wait(flags, v, nxt, short_ns, heap_bases, dctx, RANK, API, "gt"))
    tl.store(cmp_results + 6, _wait(flags, v, nxt, short_ns, heap_bases, dctx, RANK, API, "ge"))
    tl.store(cmp_results + 7, _wait(flags, v + 1, nxt, short_ns, heap_bases, dctx, RANK, API, "ge"))
    tl.store(cmp_results + 8, _wait(flags, v + 1, nxt, short_ns, heap_bases, dctx, RANK, API, "lt"))
    tl.store(cmp_results + 9, _wait(flags, v, nxt, short_ns, heap_bases, dctx, RANK, API, "lt"))
    tl.store(cmp_results + 10, _wait(flags, v, nxt, short_ns, heap_bases, dctx, RANK, API, "le"))
    tl.store(cmp_results + 11, _wait(flags, v - 1, nxt, short_ns, heap_bases, dctx, RANK, API, "le"))
    # flags[1] is never set anywhere: waits on it time out, locally and on a peer.
    tl.store(cmp_results + 12, _wait(flags + 1, 1, RANK, short_ns, heap_bases, dctx, RANK, API, "ge"))
    tl.store(cmp_results + 13, _wait(flags + 1, 1, nxt, short_ns, heap_bases, dctx, RANK, API, "eq"))
    # A condition that already holds succeeds with no time to wait.
    tl.store(cmp_results + 14, _wait(flags + 1, 0, nxt, 0, heap_bases, dctx, RANK, API, "eq"))


def _timed_wait_kernel(context, flags, out, heap_bases, peer, timeout_ns, CTX: tl.constexpr, RANK: tl.constexpr,
                       WORLD: tl.constexpr, API: tl.constexpr):
    """A wait on ``peer``'s flag, which nobody sets, timed by the clock waits are bounded by
    (the GPU's global timer; the host's clock in the interpreter): ``out`` := [result,
    nanoseconds it took]."""
    dctx = CTX.initialize(context, RANK, WORLD)
    start = now_ns()
    ok = _wait(flags, 1, peer, timeout_ns, heap_bases, dctx, RANK, API, "ge")
    elapsed = now_ns() - start
    tl.store(out, ok.to(tl.int64))
    tl.store(out + 1, elapsed)


def _scatter_kernel(context, buf, data, heap_bases, n, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Row RANK of ``buf`` ([WORLD, n]) on every rank (one program per peer) := ``data``."""
    peer = tl.program_id(0)
    offs = CTX.initialize(context, RANK, WORLD).block_offsets(data, 0, BLOCK)
    mask = offs < n
    iris.store(buf + RANK * n + offs, tl.load(data + offs, mask=mask), RANK, peer, heap_bases, mask=mask)


# -- the worker ------------------------------------------------------------------------------------------------


def _launch(ctx, source, grid, *args, **constexprs) -> None:
    """Kernel ``source`` compiled in the language of ``ctx``'s backend and launched on ``grid``,
    with that backend's device-context class as ``CTX``."""
    front = ctx.frontend
    front.kernel(source)[grid](*args, CTX=front.device_context, **constexprs)


def _random(dtype: torch.dtype, n: int, *seed) -> torch.Tensor:
    """Seeded random values spanning ``dtype``'s range (CPU)."""
    g = seeded_generator(*seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    bits = torch.iinfo(dtype).bits
    low, high = (-(2**62), 2**62) if bits == 64 else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    return torch.randint(low, high, (n,), generator=g).to(dtype)


def _peer_data(rank: int, dtype: torch.dtype, n: int, salt: int) -> torch.Tensor:
    return _random(dtype, n, 1000 + rank, salt, DTYPES.index(dtype) if dtype in DTYPES else 99)


def _check_movement(ctx, report: RankReport) -> None:
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    heap_bases = ctx.get_heap_bases()
    context = ctx.get_device_context()
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        src = ctx.zeros(PAD, dtype=dtype)
        src[:N] = _peer_data(rank, dtype, N, 0).to(device)
        sentinel = _peer_data(rank, dtype, PAD, 1).to(device)  # what untouched destinations hold
        dsts = {api: {key: ctx.as_symmetric(sentinel) for key in ("got", "put", "stored", "copied")} for api in APIS}
        loaded = {api: {key: torch.full((PAD,), 42, dtype=dtype, device=device)
                        for key in (("next", "prev", "self") if api == "free" else ("next", "prev"))}
                  for api in APIS}
        ctx.barrier()  # every rank's src and destinations are ready
        _launch(ctx, _move_free_kernel, (PAD // BLOCK,),
            context, src, loaded["free"]["next"], loaded["free"]["prev"], loaded["free"]["self"], dsts["free"]["got"],
            dsts["free"]["put"], dsts["free"]["stored"], dsts["free"]["copied"], heap_bases, N, nxt, prv,
            RANK=rank, WORLD=world, OTHER=OTHER, BLOCK=BLOCK)
        _launch(ctx, _move_ctx_kernel, (PAD // BLOCK,),
            context, src, loaded["ctx"]["next"], loaded["ctx"]["prev"], dsts["ctx"]["got"], dsts["ctx"]["put"],
            dsts["ctx"]["stored"], dsts["ctx"]["copied"], N, nxt, prv, RANK=rank, WORLD=world, OTHER=OTHER,
            BLOCK=BLOCK)
        ctx.barrier()  # every rank's remote writes have landed

        def data(q, dtype=dtype):
            return _peer_data(q, dtype, N, 0)

        tail_other = torch.full((PAD - N,), OTHER).to(dtype)
        tail_sentinel = sentinel[N:].cpu()
        expect_loaded = {"next": data(nxt), "prev": data(prv), "self": data(rank)}
        # got: prv's src; put: prv put its src here; stored: nxt stored its src here; copied: rank
        # r + 1 copied rank r + 2's src here.
        expect_written = {"got": data(prv), "put": data(prv), "stored": data(nxt), "copied": data((rank + 2) % world)}
        for api in APIS:
            for key, out in loaded[api].items():
                out = out.cpu()
                report.check(f"move/{api}/{name}/load_{key}", torch.equal(out[:N], expect_loaded[key]))
                report.check(f"move/{api}/{name}/load_{key}_other", torch.equal(out[N:], tail_other))
            for key, out in dsts[api].items():
                out = out.cpu()
                report.check(f"move/{api}/{name}/{key}", torch.equal(out[:N], expect_written[key]))
                report.check(f"move/{api}/{name}/{key}_mask", torch.equal(out[N:], tail_sentinel))
        # The expectations are not trivially met: the ranks' data differ from each other.
        report.check(f"move/{name}/data_differs", not torch.equal(data(nxt), data(rank)) or world == 1)
        ctx.barrier()  # nobody frees while a peer may still write
        for t in [src, *dsts["free"].values(), *dsts["ctx"].values()]:
            ctx.free(t)


def _check_translate(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    bases = ctx.get_heap_bases().tolist()
    for dtype in (torch.int8, torch.int16, torch.float32, torch.int64):
        buf = ctx.empty(3 * BLOCK, dtype=dtype)[BLOCK:]  # not at the start of its block
        offset = buf.data_ptr() - bases[rank]
        for peer in range(world):
            out = torch.zeros(2 * BLOCK, dtype=torch.int64, device=ctx.device)
            _launch(ctx, _translate_kernel, (1,), ctx.get_device_context(), buf, out, ctx.get_heap_bases(), peer,
                    RANK=rank, WORLD=world, BLOCK=BLOCK)
            expected = bases[peer] + offset + torch.arange(BLOCK) * buf.element_size()
            out = out.cpu()
            name = f"translate/{str(dtype).removeprefix('torch.')}/to_{'self' if peer == rank else 'peer'}{peer}"
            report.check(f"{name}/free", torch.equal(out[:BLOCK], expected))
            report.check(f"{name}/ctx", torch.equal(out[BLOCK:], expected))


def _atomic_inputs(dtype: torch.dtype, combo: int, api: str, world: int):
    """(base [rows, PAD], vals [world, rows, PAD], cmps [rows, PAD]) on the CPU, for ATOMIC_ROWS[dtype].
    The base is the same on every rank; vals are rank ``q``'s operands."""
    rows = ATOMIC_ROWS[dtype]
    seed = (combo, APIS.index(api), {torch.int32: 32, torch.int64: 64, torch.float32: 3}[dtype])

    def rnd(*extra):
        return _random(dtype, PAD, *seed, *extra)

    def operand(op, q):
        if dtype.is_floating_point:
            if op in ("add", "sub"):  # positive multiples of 1/8: every partial sum is exact
                g = seeded_generator(*seed, op, q)
                return torch.randint(1, 1024, (PAD,), generator=g).to(dtype) / 8
            return rnd(op, q)
        if op in ("add", "sub"):
            g = seeded_generator(*seed, op, q)
            return torch.randint(1, 2**20, (PAD,), generator=g).to(dtype)
        if op == "and":  # clears about an eighth of the bits
            return ~(rnd(op, q, 0) & rnd(op, q, 1) & rnd(op, q, 2))
        if op == "or":  # sets about an eighth
            return rnd(op, q, 0) & rnd(op, q, 1) & rnd(op, q, 2)
        if op == "cas":  # distinct per rank and from the base
            return base_of(op) + (q + 1)
        return rnd(op, q)

    def base_of(op):
        if op in ("add", "sub"):
            g = seeded_generator(*seed, op, "base")
            b = torch.randint(-(2**20), 2**20, (PAD,), generator=g).to(dtype)
            return b / 8 if dtype.is_floating_point else b
        if op == "or":
            return rnd(op, "base", 0) & rnd(op, "base", 1) & rnd(op, "base", 2)
        return rnd(op, "base")

    base = torch.stack([base_of(op) for op in rows])
    vals = torch.stack([torch.stack([operand(op, q) for op in rows]) for q in range(world)])
    return base, vals, base.clone()


def _atomic_checks(op: str, base, vals, olds, final, n: int) -> dict[str, bool]:
    """Checks of one row after every rank applied ``op`` with its ``vals[q]`` onto ``base``:
    ``olds[q]`` is what rank q's atomic returned, ``final`` what the target holds now."""
    checks = {}
    if op == "cas":  # unmasked: the whole row. Exactly one rank wins each lane.
        winners = olds == base
        checks["one_winner"] = bool((winners.sum(0) == 1).all())
        winner = winners.to(torch.int8).argmax(0)
        checks["final"] = torch.equal(final, vals.gather(0, winner[None])[0])
        checks["losers_saw_winner"] = bool(((olds == final) | winners).all())
        return checks
    b, v, o, f = base[:n], vals[:, :n], olds[:, :n], final[:n]
    checks["mask"] = torch.equal(final[n:], base[n:])  # masked-off lanes untouched
    if op in ("add", "sub"):
        sign = 1 if op == "add" else -1
        checks["final"] = torch.equal(f, b + sign * v.sum(0, dtype=v.dtype))
        # The old values form one chain: sorted in arrival order, each is the previous plus its operand.
        so, order = (sign * o).sort(dim=0)
        sv = v.gather(0, order)
        checks["olds_chain"] = (torch.equal(so[0], sign * b) and torch.equal(so[1:], so[:-1] + sv[:-1])
                                and torch.equal(sign * f, so[-1] + sv[-1]))
    elif op in ("min", "max"):
        reduce = torch.minimum if op == "min" else torch.maximum
        expected = b
        for q in range(v.shape[0]):
            expected = reduce(expected, v[q])
        checks["final"] = torch.equal(f, expected)
        # Each rank saw the running min/max of the base and of operands applied before its own.
        candidates = torch.cat([b[None], v])  # [1 + world, n]
        hit = candidates[:, None, :] == o[None, :, :]  # [1 + world, world, n]
        own = torch.zeros_like(hit)
        for q in range(v.shape[0]):
            own[q + 1, q] = True
        checks["olds"] = bool((hit & ~own).any(0).all()) and bool((reduce(o, f[None]) == f).all())
    elif op in ("and", "or", "xor"):
        expected = b.clone()
        for q in range(v.shape[0]):
            expected = expected & v[q] if op == "and" else expected | v[q] if op == "or" else expected ^ v[q]
        checks["final"] = torch.equal(f, expected)
    else:  # xchg: every value that was there was returned exactly once, and one remains
        assert op == "xchg", op
        seen = torch.cat([o, f[None]]).sort(dim=0).values
        put = torch.cat([b[None], v]).sort(dim=0).values
        checks["olds_and_final_are_a_permutation"] = torch.equal(seen, put)
    return checks


def _check_atomics(ctx, report: RankReport) -> None:
    """Every rank applies every atomic to the same rows of one target rank at once, for every
    sem and scope: lost updates show in the final values, and the old values each rank got back
    must fit one order of arrival. (At "cta" and "gpu" scope the PTX memory model promises no
    atomicity between GPUs; NVIDIA GPUs perform atomics on a peer's memory at that peer, so they
    are atomic in practice, and a failure of only those scopes on GPUs would point there.)"""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    heap_bases, context = ctx.get_heap_bases(), ctx.get_device_context()
    dtypes = list(ATOMIC_ROWS)
    bufs = {dt: ctx.zeros(len(ATOMIC_ROWS[dt]), PAD, dtype=dt) for dt in dtypes}
    for combo, (sem, scope) in enumerate(COMBOS):
        target = combo % world  # every rank is the target of some combinations
        for api in APIS:
            inputs = {dt: _atomic_inputs(dt, combo, api, world) for dt in dtypes}
            vals = {dt: inputs[dt][1][rank].to(device) for dt in dtypes}
            cmps = {dt: inputs[dt][2].to(device) for dt in dtypes}
            olds = {dt: torch.zeros_like(vals[dt]) for dt in dtypes}
            for dt in dtypes:
                bufs[dt].copy_(inputs[dt][0].to(device))
            ctx.barrier()
            i32, i64, f32 = torch.int32, torch.int64, torch.float32
            _launch(ctx, _atomics_kernel, (PAD // BLOCK,),
                context, bufs[i32], vals[i32], cmps[i32], olds[i32], bufs[i64], vals[i64], cmps[i64], olds[i64],
                bufs[f32], vals[f32], olds[f32], heap_bases, N, target, RANK=rank, WORLD=world, API=api == "ctx",
                SEM=sem, SCOPE=scope, PAD=PAD, BLOCK=BLOCK)
            ctx.barrier()
            gathered = ctx.comm.all_gather_object({str(dt): olds[dt].cpu() for dt in dtypes})
            if rank == target:
                for dt in dtypes:
                    base, all_vals, _ = inputs[dt]
                    final = bufs[dt].cpu()
                    all_olds = torch.stack([g[str(dt)] for g in gathered])
                    for row, op in enumerate(ATOMIC_ROWS[dt]):
                        checks = _atomic_checks(op, base[row], all_vals[:, row], all_olds[:, row], final[row], N)
                        for what, ok in checks.items():
                            report.check(f"atomic/{api}/{op}.{str(dt).removeprefix('torch.')}/{sem}/{scope}/{what}",
                                         ok)
            ctx.barrier()  # the target has read its rows before they are reset


def _check_cas_chain(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    for i, api in enumerate(APIS):
        target = (world - 1 + i) % world
        flag = ctx.zeros(1, dtype=torch.int32)
        out = torch.full((1,), -1, dtype=torch.int32, device=ctx.device)
        ctx.barrier()
        _launch(ctx, _cas_chain_kernel, (1,), ctx.get_device_context(), flag, out, ctx.get_heap_bases(), target,
                ctx.timeout_ns, RANK=rank, WORLD=world, API=api == "ctx")
        ctx.barrier()
        report.check(f"cas_chain/{api}/my_turn_came", int(out.item()) == rank)
        if rank == target:
            report.check(f"cas_chain/{api}/final", int(flag.item()) == world)


def _check_flags(ctx, report: RankReport) -> None:
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    n = BLOCK - 3  # one block with a ragged tail
    report.check("flags/timeout_ns_is_the_configured_timeout",
                 type(ctx.timeout_ns) is int and ctx.timeout_ns == RANK_TIMEOUT * 10**9)
    for api in APIS:
        flags = ctx.zeros(2, dtype=torch.int32)
        mailbox = ctx.zeros(RING_ROUNDS, BLOCK, dtype=torch.float32)

        def messages_of(q):
            return torch.stack([torch.nn.functional.pad(_peer_data(q, torch.float32, n, 10 + k), (0, BLOCK - n))
                                for k in range(RING_ROUNDS)])

        received = torch.full((RING_ROUNDS, BLOCK), float("nan"), device=device)
        results = torch.full((2 * RING_ROUNDS,), -1, dtype=torch.int32, device=device)
        cmp_results = torch.full((15,), -1, dtype=torch.int32, device=device)
        ctx.barrier()
        _launch(ctx, _ring_kernel, (1,), ctx.get_device_context(), flags, mailbox, messages_of(rank).to(device),
                received, results, cmp_results, ctx.get_heap_bases(), n, nxt, RING_ROUNDS, ctx.timeout_ns,
                SHORT_TIMEOUT_NS, RANK=rank, WORLD=world, API=api == "ctx", BLOCK=BLOCK)
        ctx.barrier()
        results, cmp_results = results.cpu().tolist(), cmp_results.cpu().tolist()
        report.check(f"flags/{api}/waits_succeeded", results[0::2] == [1] * RING_ROUNDS)
        report.check(f"flags/{api}/signal_returned_old", results[1::2] == list(range(RING_ROUNDS)))
        report.check(f"flags/{api}/messages_arrived", torch.equal(received.cpu()[:, :n], messages_of(prv)[:, :n]))
        report.check(f"flags/{api}/own_flag", flags.cpu().tolist() == [RING_ROUNDS, 0])
        for i, (cmp, _delta, expected) in enumerate(CMP_CASES):
            report.check(f"flags/{api}/cmp_{cmp}_{'holds' if expected else 'times_out'}",
                         cmp_results[i] == int(expected))
        report.check(f"flags/{api}/timeout_unset_local", cmp_results[12] == 0)
        report.check(f"flags/{api}/timeout_unset_peer", cmp_results[13] == 0)
        report.check(f"flags/{api}/zero_timeout_when_holding", cmp_results[14] == 1)
        # A wait that gives up does so once its timeout has passed, not earlier, and soon after.
        unset = ctx.zeros(1, dtype=torch.int32)
        timed = torch.full((2,), -1, dtype=torch.int64, device=device)
        ctx.barrier()
        _launch(ctx, _timed_wait_kernel, (1,), ctx.get_device_context(), unset, timed, ctx.get_heap_bases(), nxt,
                TIMED_WAIT_NS, RANK=rank, WORLD=world, API=api == "ctx")
        result, elapsed = timed.cpu().tolist()
        report.check(f"flags/{api}/timed_wait_gave_up", result == 0)
        report[f"flags/{api}/timed_wait_not_before_its_timeout"] = elapsed >= TIMED_WAIT_NS or (
            f"gave up after {elapsed} ns, timeout {TIMED_WAIT_NS} ns")
        report[f"flags/{api}/timed_wait_soon_after_its_timeout"] = elapsed < TIMED_WAIT_NS + TIMED_WAIT_SLACK_NS or (
            f"gave up after {elapsed} ns, timeout {TIMED_WAIT_NS} ns")
        ctx.barrier()


def _check_device_barrier(ctx, report: RankReport) -> None:
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    buf = ctx.full((BARRIER_ROUNDS, world, N), float("nan"))
    ctx.barrier()
    snapshots = []
    for k in range(BARRIER_ROUNDS):  # no host barrier in between: only device_barrier orders them
        data = _peer_data(rank, torch.float32, N, 500 + k).to(device)
        _launch(ctx, _scatter_kernel, (world,), ctx.get_device_context(), buf[k], data, ctx.get_heap_bases(), N,
                RANK=rank, WORLD=world, BLOCK=64)
        ctx.device_barrier()
        snapshots.append(buf[k].clone())  # read locally, stream-ordered after the barrier
    ctx.barrier()  # raises if a device_barrier timed out
    for k, snap in enumerate(snapshots):
        expected = torch.stack([_peer_data(q, torch.float32, N, 500 + k) for q in range(world)])
        report.check(f"device_barrier/round{k}_sees_every_rank", torch.equal(snap.cpu(), expected))
    ctx.barrier()


#: Seconds of the context whose device_barrier times out, and of the ranks' process group in that
#: scenario (the host barrier of a rank other than 0 waits for rank 0 as long as the process group
#: allows, whatever the context's timeout); nothing there waits longer.
BARRIER_TIMEOUT = 2.0
HOST_TIMEOUT = 10
#: Store key rank 0 sets once it is done with its failed context.
RANK0_DONE = "test_device_api/device_barrier_timeout/rank0_done"


def _raises(fn) -> tuple[BaseException | None, float]:
    """``(exception or None, seconds)`` of calling ``fn``."""
    start = time.monotonic()
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - the caller checks the type
        return error, time.monotonic() - start
    return None, time.monotonic() - start


def _device_barrier_timeout_worker(rank: int, backend: str, device: str) -> bytes:
    """Rank 0 calls device_barrier, rank 1 does not: rank 0's call gives up after the timeout and
    fails its context, whose every later call raises at once and whose destroy() does not wait
    for rank 1. Rank 1 stays out of every collective until rank 0 is done (told through the
    process group's store), then its host barrier, alone, times out; nothing hangs."""
    report = RankReport(rank)
    store = torch.distributed.distributed_c10d._get_default_store()
    short = iris.create(backend, heap_size="1MiB", device=device, timeout=BARRIER_TIMEOUT)
    report.check("timeout/timeout_ns_is_the_configured_timeout", short.timeout_ns == int(BARRIER_TIMEOUT * 10**9))
    x = short.ones(64)  # for a collective after the failure (allocated alike on both ranks)
    short.device_barrier()  # both ranks: compiled (interpreted) and warm before the timed one
    short.barrier()
    report.check("timeout/not_failed_before", not short.failed)
    if rank == 0:
        try:
            def lone_device_barrier():
                short.device_barrier()
                if short.device.type == "cuda":  # GPUs: the call returns at once; the wait fails later
                    short.check()

            error, seconds = _raises(lone_device_barrier)
            message = str(error)
            report["timeout/device_barrier_raised"] = isinstance(error, IrisTimeoutError) or repr(error)
            report.check("timeout/is_a_TimeoutError", isinstance(error, TimeoutError))
            report.check("timeout/names_missing_rank", "rank(s) [1]" in message)
            report.check("timeout/names_the_operation", "device_barrier" in message)
            report.check("timeout/names_this_rank", "on rank 0" in message)
            report.check("timeout/names_the_timeout", f"after {BARRIER_TIMEOUT:g} s" in message)
            report.check("timeout/says_the_fix", "create(timeout=...)" in message)
            report["timeout/gave_up_not_before_the_timeout"] = seconds >= BARRIER_TIMEOUT or f"after {seconds:.3f} s"
            report["timeout/gave_up_soon_after_the_timeout"] = (
                seconds < 1.5 * BARRIER_TIMEOUT or f"after {seconds:.3f} s")
            report.check("timeout/context_failed", short.failed)
            later = {
                "barrier": short.barrier,
                "device_barrier": short.device_barrier,
                "ccl.all_reduce": lambda: short.ccl.all_reduce(x),
                "zeros": lambda: short.zeros(8),
            }
            for name, call in later.items():
                error, seconds = _raises(call)
                text = str(error)
                report[f"timeout/after/{name}/raised"] = type(error) is IrisTimeoutError or repr(error)
                # ctx.zeros is named as the allocation it makes.
                labels = ("ctx.zeros", "ctx.allocate") if name == "zeros" else (f"ctx.{name}",)
                report.check(f"timeout/after/{name}/names_the_call", any(f"{label} on rank 0" in text
                                                                         for label in labels))
                report.check(f"timeout/after/{name}/failed_earlier",
                             "this context failed earlier and cannot be used again" in text
                             and "destroy it with ctx.destroy() and create a new one" in text)
                report.check(f"timeout/after/{name}/names_the_first_failure",
                             "device_barrier gave up" in text and "rank(s) [1]" in text)
                report[f"timeout/after/{name}/at_once"] = seconds < BARRIER_TIMEOUT / 2 or f"after {seconds:.3f} s"
            report.check("timeout/still_failed", short.failed)
            error, seconds = _raises(short.destroy)  # rank 1 is in no collective now
            report["timeout/destroy_returned"] = error is None or repr(error)
            report["timeout/destroy_did_not_wait"] = seconds < BARRIER_TIMEOUT / 2 or f"after {seconds:.3f} s"
            report.check("timeout/destroyed", short.destroyed)
        finally:
            store.set(RANK0_DONE, "1")
    else:
        store.wait([RANK0_DONE], timedelta(seconds=60))
        report.check("timeout/rank1_not_failed", not short.failed)
        error, seconds = _raises(short.barrier)  # rank 0 joins no barrier any more: it times out
        report["timeout/rank1_barrier_raised"] = isinstance(error, IrisTimeoutError) or repr(error)
        report["timeout/rank1_barrier_bounded"] = seconds < HOST_TIMEOUT + 10 or f"after {seconds:.3f} s"
        report.check("timeout/rank1_failed_by_its_barrier", short.failed)
        error, seconds = _raises(short.destroy)
        report["timeout/rank1_destroy_returned"] = error is None or repr(error)
        report["timeout/rank1_destroy_did_not_wait"] = seconds < BARRIER_TIMEOUT / 2 or f"after {seconds:.3f} s"
    return report.packed()


def _check_message_passing(ctx, report: RankReport) -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from examples.message_passing import exchange

    on_gpu = ctx.device.type == "cuda"
    report.check("message_passing/exchange", exchange(ctx, 1000 if on_gpu else 25, 1024 if on_gpu else 100))


def _device_api_worker(rank: int, backend: str, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(backend, heap_size="32MiB", device=device, timeout=RANK_TIMEOUT)
    report.check("setup/rank", ctx.rank == rank)
    report.check("setup/iris_names_resolve_to_iris_triton",
                 iris.load is iris_triton.load and iris.DeviceContext is iris_triton.DeviceContext)
    with report.section("move"):
        _check_movement(ctx, report)
    with report.section("translate"):
        _check_translate(ctx, report)
    with report.section("atomics"):
        _check_atomics(ctx, report)
    with report.section("cas_chain"):
        _check_cas_chain(ctx, report)
    with report.section("flags"):
        _check_flags(ctx, report)
    with report.section("device_barrier"):
        _check_device_barrier(ctx, report)
    if ctx.world_size == 2:
        with report.section("message_passing"):
            _check_message_passing(ctx, report)
    ctx.barrier()
    ctx.destroy()
    return report.packed()  # the full report of the atomics section alone is about 64 KiB


# -- the tests ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[(backend, world) for backend in ("triton", "gluon") for world in (2, 3)],
                ids=lambda p: f"{p[0]}-world{p[1]}")
def reports(request) -> list[dict]:
    """Every rank's report for one backend and world size; one spawn serves all the tests of
    that pair. A backend whose kernels cannot run on the ranks available here is skipped."""
    backend, world_size = request.param
    device = backend_rank_device(backend, world_size)
    return spawn_reports(_device_api_worker, world_size, backend, device, device=device)


def _select(reports: list[dict], prefix: str) -> dict[str, object]:
    """``rank/check -> result`` for the checks whose names start with ``prefix``."""
    return {f"r{r}/{k}": v for r, rep in enumerate(reports) for k, v in rep.items()
            if k.startswith(prefix) and not k.endswith("/completed")}


def _assert_all_true(reports: list[dict], prefix: str, section: str | None = None) -> dict[str, object]:
    world = len(reports)
    if section is not None:
        done = {r: rep.get(f"{section}/completed", "missing") for r, rep in enumerate(reports)}
        errors = {r: v for r, v in done.items() if v is not True}
        assert not errors, f"section {section!r} failed on rank(s) {sorted(errors)}:\n" + "\n".join(
            str(v) for v in errors.values())
    checks = _select(reports, prefix)
    assert checks, f"no checks named {prefix}* in the reports of {world} ranks"
    failed = sorted(k for k, v in checks.items() if v is not True)
    assert not failed, f"{len(failed)} of {len(checks)} checks failed: {failed[:40]}"
    return checks


def test_setup(reports):
    _assert_all_true(reports, "setup/")


def test_load_store_get_put_copy_between_neighbours(reports):
    checks = _assert_all_true(reports, "move/", "move")
    world = len(reports)
    # Per rank, dtype and API: 3 (free) or 2 (ctx) loads x 2 + 4 writes x 2, plus data_differs.
    assert len(checks) == world * len(DTYPES) * ((3 + 2) * 2 + 2 * 4 * 2 + 1)


def test_translate(reports):
    checks = _assert_all_true(reports, "translate/", "translate")
    world = len(reports)
    assert len(checks) == world * 4 * world * 2


def test_atomics_every_op_sem_and_scope_from_all_ranks(reports):
    checks = _assert_all_true(reports, "atomic/", "atomics")
    covered = {tuple(k.split("/")[2:6]) for k in checks}  # (api, op.dtype, sem, scope)
    ops = sum(len(rows) for rows in ATOMIC_ROWS.values())
    assert len(covered) == len(APIS) * ops * len(COMBOS), sorted(covered)[:10]
    # Every rank was the target of some combinations.
    world = len(reports)
    assert {k.split("/")[0] for k in checks} == {f"r{r}" for r in range(world)}


def test_atomic_cas_takes_turns(reports):
    checks = _assert_all_true(reports, "cas_chain/", "cas_chain")
    assert len(checks) == len(reports) * 2 + 2


def test_signal_and_wait_until(reports):
    checks = _assert_all_true(reports, "flags/", "flags")
    assert len(checks) == len(reports) * (1 + 2 * (4 + len(CMP_CASES) + 3 + 3))


def test_device_barrier_repeated(reports):
    checks = _assert_all_true(reports, "device_barrier/", "device_barrier")
    assert len(checks) == len(reports) * BARRIER_ROUNDS


@pytest.fixture(scope="module", params=["triton", "gluon"])
def timeout_reports(request) -> list[dict]:
    """Both ranks' reports of :func:`_device_barrier_timeout_worker`: a process group whose waits
    end after HOST_TIMEOUT seconds, not the default 120."""
    device = backend_rank_device(request.param, 2)
    return spawn_reports(_device_barrier_timeout_worker, 2, request.param, device, device=device,
                         timeout=HOST_TIMEOUT)


def _assert_timeout_checks(reports: list[dict], names: list[str]) -> None:
    """Every check ``r<rank>/timeout/<name>`` of ``names`` was made and passed."""
    checks = _select(reports, "timeout/")
    missing = [name for name in names if name not in checks]
    assert not missing, f"checks not made: {missing} (made: {sorted(checks)})"
    failed = [name for name in names if checks[name] is not True]
    assert not failed, f"{len(failed)} of {len(names)} checks failed:\n" + "\n".join(
        f"{name}: {checks[name]}" for name in failed)


def test_device_barrier_a_peer_skips_raises_at_the_call_naming_it(timeout_reports):
    _assert_timeout_checks(timeout_reports, [
        *[f"r{r}/timeout/{name}" for r in (0, 1)
          for name in ("timeout_ns_is_the_configured_timeout", "not_failed_before")],
        *[f"r0/timeout/{name}" for name in (
            "device_barrier_raised", "is_a_TimeoutError", "names_missing_rank", "names_the_operation",
            "names_this_rank", "names_the_timeout", "says_the_fix", "gave_up_not_before_the_timeout",
            "gave_up_soon_after_the_timeout", "context_failed")],
    ])


@pytest.mark.parametrize("call", ["barrier", "device_barrier", "ccl.all_reduce", "zeros"])
def test_a_failed_context_refuses_every_later_call_at_once(timeout_reports, call):
    _assert_timeout_checks(timeout_reports, [
        *[f"r0/timeout/after/{call}/{name}" for name in (
            "raised", "names_the_call", "failed_earlier", "names_the_first_failure", "at_once")],
        "r0/timeout/still_failed",
    ])


def test_a_failed_context_is_destroyed_without_waiting_for_its_peers(timeout_reports):
    # Rank 1 is in no collective while rank 0 destroys its failed context. Then rank 1's host
    # barrier, alone, times out (bounded by the process group's timeout), which fails its context
    # too, and its destroy() does not wait either.
    _assert_timeout_checks(timeout_reports, [
        "r0/timeout/destroy_returned", "r0/timeout/destroy_did_not_wait", "r0/timeout/destroyed",
        *[f"r1/timeout/{name}" for name in ("rank1_not_failed", "rank1_barrier_raised", "rank1_barrier_bounded",
                                            "rank1_failed_by_its_barrier", "rank1_destroy_returned",
                                            "rank1_destroy_did_not_wait")],
    ])


def test_message_passing_example(reports):
    if len(reports) != 2:
        pytest.skip("the example runs on two ranks")
    checks = _assert_all_true(reports, "message_passing/", "message_passing")
    assert len(checks) == 2


# -- one list of device functions: the free functions and the context methods agree ------------------------


#: The device contexts' methods (the header of each method's source) with upstream iris's
#: signatures, which the methods generated from the device functions must keep (``translate``
#: also takes the free function's ``mask``, for the debug checks).
HINT = "hint: tl.constexpr = None"
UPSTREAM_METHODS = {
    "translate": f"def translate(self, ptr, to_rank, mask=None, {HINT}):",
    "load": 'def load(self, ptr, from_rank, mask=None, other=None, cache_modifier: tl.constexpr = tl.constexpr(""), '
            f'volatile: tl.constexpr = False, {HINT}):',
    "store": 'def store(self, ptr, value, to_rank, mask=None, cache_modifier: tl.constexpr = tl.constexpr(""), '
             f'{HINT}):',
    "get": f"def get(self, from_ptr, to_ptr, from_rank, mask=None, other=None, {HINT}):",
    "put": f"def put(self, from_ptr, to_ptr, to_rank, mask=None, other=None, {HINT}):",
    "copy": f"def copy(self, src_ptr, dst_ptr, from_rank, to_rank, mask=None, other=None, {HINT}):",
    **{f"atomic_{op}": f"def atomic_{op}(self, ptr, val, to_rank, mask=None, sem: tl.constexpr = None, "
                       f"scope: tl.constexpr = None, {HINT}):"
       for op in ("add", "sub", "xchg", "and", "or", "xor", "min", "max")},
    "atomic_cas": "def atomic_cas(self, ptr, cmp, val, to_rank, sem: tl.constexpr = None, scope: tl.constexpr = None, "
                  f"{HINT}):",
    "signal": "def signal(self, ptr, value, to_rank, sem: tl.constexpr = None, scope: tl.constexpr = None):",
    "wait_until": 'def wait_until(self, ptr, value, rank, timeout_ns, CMP: tl.constexpr = tl.constexpr("ge"), '
                  'sem: tl.constexpr = None, scope: tl.constexpr = None):',
}


def _device_contexts() -> dict[str, type]:
    from iris_gluon import IrisDeviceCtx

    return {"DeviceContext": DeviceContext, "IrisDeviceCtx": IrisDeviceCtx}


def _python_function(fn):
    """The Python function of a ``@triton.jit`` (or interpreted) function, or ``fn`` itself."""
    return getattr(fn, "fn", fn)


def _parameters(fn) -> list[tuple[str, str, str]]:
    """``(kind, name, "annotation = default")`` of every parameter of ``fn``. Annotations are compared
    by name (the free functions' are strings: iris_triton.device.functions postpones them), defaults by repr."""
    out = []
    for p in inspect.signature(_python_function(fn)).parameters.values():
        annotation = "" if p.annotation is p.empty else getattr(p.annotation, "__name__", p.annotation)
        annotation = str(annotation).removeprefix("tl.")
        default = "" if p.default is p.empty else repr(p.default)
        out.append((p.kind.name, p.name, f"{annotation} = {default}"))
    return out


def test_the_device_functions_are_one_list():
    names = list(iris_triton.device.functions.DEVICE_FUNCTIONS)
    assert iris_triton.device.functions.__all__ == names
    assert iris_triton.DEVICE_FUNCTIONS is iris_triton.device.functions.DEVICE_FUNCTIONS
    assert set(names) <= set(iris_triton.__all__)
    assert set(UPSTREAM_METHODS) <= set(names)
    for name in names:
        assert getattr(iris_triton, name) is getattr(iris_triton.device.functions, name), name
        # ``iris.<name>``, as kernels written for upstream iris call them.
        assert getattr(iris, name) is getattr(iris_triton.device.functions, name), f"iris.{name}"


@triton.jit
def _failed_without_fault_words_kernel(heap_bases, out, RANK: tl.constexpr, WORLD: tl.constexpr):
    tl.store(out, failed(DeviceContext(RANK, WORLD, heap_bases)).to(tl.int32))


def test_iris_waits_refuse_a_device_context_without_fault_words():
    # A context built from the heap bases alone has no timeout or fault words to record a
    # give-up in: iris's waits refuse it where the kernel is built (compiled or interpreted),
    # instead of writing elsewhere.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.full((1,), 7, dtype=torch.int32, device=device)
    with pytest.raises(Exception, match=r"built with initialize\(\) from ctx.get_device_context"):
        _failed_without_fault_words_kernel[(1,)](torch.zeros(2, dtype=torch.int64, device=device), out, RANK=0,
                                                 WORLD=2)
    assert out.item() == 7


@pytest.mark.parametrize("name", list(iris_triton.device.functions.DEVICE_FUNCTIONS))
def test_context_method_is_the_device_function_less_heap_bases_and_the_callers_rank(name):
    caller = iris_triton.device.functions.DEVICE_FUNCTIONS[name]
    free = _parameters(getattr(iris_triton.device.functions, name))
    filled = {caller: "self.rank", "heap_bases": "self.heap_bases"}
    assert set(filled) <= {param for _, param, _ in free}, f"{name} has no parameter {caller} or heap_bases"
    renamed = iris_triton.device.functions.METHOD_PARAMETER_NAMES.get(name, {})  # upstream's method names
    expected = [("POSITIONAL_OR_KEYWORD", "self", " = ")] + [(kind, renamed.get(param, param), rest)
                                                               for kind, param, rest in free if param not in filled]
    for cls_name, cls in _device_contexts().items():
        method = getattr(cls, name)
        assert _parameters(method) == expected, f"{cls_name}.{name}"
        # Its body passes every argument on in its place, the context's rank and heap bases for the two dropped.
        source = inspect.getsource(_python_function(method))
        assert source == method_source(name), f"{cls_name}.{name}"
        call = ast.parse(source).body[0].body[-1].value
        assert ast.unparse(call.func) == f"device.{name}", f"{cls_name}.{name}"
        assert [ast.unparse(arg) for arg in call.args] == [filled.get(p, renamed.get(p, p)) for _, p, _ in free], \
            f"{cls_name}.{name}"
        assert not call.keywords


@pytest.mark.parametrize("name", list(UPSTREAM_METHODS))
def test_context_methods_keep_upstream_signatures(name):
    for cls_name, cls in _device_contexts().items():
        header = inspect.getsource(_python_function(getattr(cls, name))).splitlines()[0]
        assert header == UPSTREAM_METHODS[name], f"{cls_name}.{name}"
