"""Kernels written as upstream iris's (ROCm/iris) unit tests write them, run on iris.

Every call below has the argument order, keywords, shapes and dtypes of upstream's device API
tests (``test_load``, ``test_store``, ``test_get``, ``test_put``, ``test_copy``, the
``test_atomic_*`` files, ``test_device_context``): contexts made with ``iris.iris(1 << 20)``,
``ctx.get_heap_bases()``, ``ctx.cur_rank`` / ``ctx.num_ranks``, a barrier before and after each
launch, grid ``(1,)``, and kernels taking ``(..., cur_rank: tl.constexpr, num_ranks: tl.constexpr,
BLOCK_SIZE: tl.constexpr, heap_bases)``. The rank roles are upstream's:

=====================================================  ====================  ===========================
call                                                   pointer local to      memory touched
=====================================================  ====================  ===========================
``iris.load(p, me, peer, hb)``                         me                    peer (read)
``iris.store(p, v, me, peer, hb)``                     me                    peer (write)
``iris.get(src, dst, me, peer, hb)``                   me                    peer's src into my dst
``iris.put(src, dst, me, peer, hb)``                   me                    my src into peer's dst
``iris.copy(src, dst, frm, to, me, hb)``               me (both)             reads frm, writes to
``iris.atomic_*(p, v, me, peer, hb, mask, ...)``       me                    peer
``dctx.load/get(..., from_rank=peer)``                 me                    peer (read)
``dctx.store/put/atomic_*(..., to_rank=peer)``         me                    peer (write)
=====================================================  ====================  ===========================

Where upstream's tests use constants (``ctx.ones``, ``full(..., rank)``), the data here is random:
torch generators seeded by the rank that writes it, so every reader recomputes what it must
see; results are compared exactly (``torch.equal``, same dtype and shape). Each kernel
covers every peer at once (rows indexed by rank), so a result tells who wrote it, and the blocks
include a ragged one whose masked-off lanes must keep what they held.

Ranks are CPU processes running Triton's interpreter unless there is a GPU per rank (or exactly
one GPU, which the ranks then share). One module-level worker per world size (2 and 3) makes
every check in one spawn and returns a report; the tests assert on it by section, so a failure
names the check, the rank and the dtype. Run as a script (``python
tests/test_upstream_device_api.py``, no ``TRITON_INTERPRET``), this module compiles a Gluon
kernel written as upstream's Gluon tests write it for sm_90 and prints its PTX memory
instructions (``test_gluon_device_context_compiles_to_remote_accesses``), and compiles there the
Triton kernels that CPU ranks only interpret (``test_triton_kernels_compile_for_sm90``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

import iris
from iris import DeviceContext
from iris.testing import RankReport, reports_on_available_ranks, run_without_interpreter, seeded_generator

try:  # upstream: ``from iris import DeviceContext, TraceEvent`` (test_trace_event_is_importable_from_iris)
    from iris import TraceEvent
except ImportError:
    from iris_triton.device.tracing import TraceEvent

HEAP = 1 << 20  # upstream's ``iris.iris(1 << 20)``
WORLDS = (2, 3)
#: (BLOCK_SIZE, n): upstream's block sizes (mask ``offsets < BLOCK_SIZE``), and a ragged block whose
#: lanes from n on are masked off.
CASES = ((1, 1), (8, 8), (16, 16), (32, 27))
MOVE_DTYPES = (torch.int8, torch.float16, torch.bfloat16, torch.float32)  # upstream's load/store/get/put/copy
SEMS = ("acquire", "release", "acq_rel")
SCOPES = ("cta", "gpu", "sys")
COMBOS = tuple((sem, scope) for sem in SEMS for scope in SCOPES)
#: Upstream's dtypes per atomic (sub: upstream's early file had int8, which Triton's atomics refuse
#: for any target, "atomic_add does not support int8"; int32 stands in for it).
ATOMIC_DTYPES = {
    "add": (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32),
    "sub": (torch.int32, torch.float16, torch.bfloat16, torch.float32),
    "cas": (torch.int16, torch.int32, torch.int64),
    "xchg": (torch.int32, torch.int64, torch.float32),
    "xor": (torch.int32, torch.int64),
    "and": (torch.int32, torch.int64),
    "or": (torch.int32, torch.int64),
    "min": (torch.int32, torch.int64),
    "max": (torch.int32, torch.int64),
}
BLOCK_ATOMICS = ("add", "sub", "xor", "and", "or", "min", "max")
ATOMIC_CASES = ((1, 1), (16, 16), (32, 29))
ATOMIC_PARAMS = [(op, dt) for op, dts in ATOMIC_DTYPES.items() for dt in dts]
DCTX_ATOMIC_DTYPES = (torch.int32, torch.int64, torch.float16, torch.float32)  # upstream's test_device_context
DCTX_ATOMIC_CASES = ((8, 8), (16, 16), (16, 13))
HINT_DTYPES = (torch.int32, torch.float32)
HINT_CASES = ((8, 8), (16, 13))
HINT_2D = ((4, 8, 3, 5), (2, 16, 2, 16))  # (BLOCK_M, BLOCK_N, M, N)
#: Why a check cannot run in Triton's interpreter (CPU ranks); on GPUs it runs.
INTERPRETER_LIMITS = {
    ("atomic", "xchg", torch.float32): "Triton 3.6's interpreter has no float32 atomic_xchg ('Unsupported data type')",
    ("atomic", "add", torch.bfloat16): "Triton 3.6's interpreter has no bfloat16 atomics ('Unsupported data type')",
    ("atomic", "sub", torch.bfloat16): "Triton 3.6's interpreter has no bfloat16 atomics ('Unsupported data type')",
    ("atomic_ones", "add", torch.bfloat16): "Triton 3.6's interpreter cannot build bfloat16 constants inside kernels "
                                            "(tl.full: 'InterpreterBuilder' object has no attribute 'get_bf16'), "
                                            "nor run bfloat16 atomics",
}
RANK_TIMEOUT = 120


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- kernels: the functional API (iris.load, iris.store, ...) --------------------------------------------------


@triton.jit
def _moves_kernel(data, small, loaded, stored, got, put_dst, accumulated, n, cur_rank: tl.constexpr,
                  num_ranks: tl.constexpr, BLOCK_SIZE: tl.constexpr, heap_bases):
    """Upstream's test_load, test_store, test_get and test_put kernels in one launch, with one row
    of results per rank (row q: read from rank q, or written here by rank q)."""
    pid = tl.program_id(0)
    block_start = pid * BLOCK_SIZE
    offsets = block_start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    value = tl.load(data + offsets, mask=mask)
    for source_rank in range(num_ranks):  # test_load: source_rank's data into my row source_rank
        result = iris.load(data + offsets, cur_rank, source_rank, heap_bases, mask=mask)
        tl.store(loaded + source_rank * BLOCK_SIZE + offsets, result, mask=mask)
    for dst_rank in range(num_ranks):  # test_store: my data into row cur_rank of every rank's results
        iris.store(stored + cur_rank * BLOCK_SIZE + offsets, value, cur_rank, dst_rank, heap_bases, mask=mask)
    for target_rank in range(num_ranks):  # test_get: target's data into my row target_rank
        iris.get(data + offsets, got + target_rank * BLOCK_SIZE + offsets, cur_rank, target_rank, heap_bases,
                 mask=mask)
    for target_rank in range(num_ranks):  # test_put: my data into row cur_rank of every rank's results
        iris.put(data + offsets, put_dst + cur_rank * BLOCK_SIZE + offsets, cur_rank, target_rank, heap_bases,
                 mask=mask)
    # test_get as upstream writes it: every rank's data, fetched into results in turn, summed.
    acc = tl.zeros([BLOCK_SIZE], dtype=small.type.element_ty)
    for target_rank in range(num_ranks):
        iris.get(small + offsets, accumulated + offsets, cur_rank, target_rank, heap_bases, mask=mask)
        acc += tl.load(accumulated + offsets, mask=mask)
    tl.store(accumulated + offsets, acc, mask=mask)


@triton.jit
def _loop_sum_control_kernel(data, out, num_ranks: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The accumulation of the upstream test_get kernel without iris: ``num_ranks * data``."""
    offsets = tl.arange(0, BLOCK_SIZE)
    acc = tl.zeros([BLOCK_SIZE], dtype=data.type.element_ty)
    for _ in range(num_ranks):
        acc += tl.load(data + offsets)
    tl.store(out + offsets, acc)


@triton.jit
def _copy_kernel(data, copied_get, copied_put, copied_local, n, cur_rank: tl.constexpr, num_ranks: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, heap_bases):
    """Upstream's test_copy_get, test_copy_put and test_copy_local kernels in one launch: ``data``
    and the results are ``[num_ranks, BLOCK_SIZE]``, the mask is passed positionally."""
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    for target_rank in range(num_ranks):  # copy_get: from target_rank to me
        src = data + BLOCK_SIZE * cur_rank
        dst = copied_get + BLOCK_SIZE * target_rank
        iris.copy(src + offsets, dst + offsets, target_rank, cur_rank, cur_rank, heap_bases, mask)
    for target_rank in range(num_ranks):  # copy_put: from me to target_rank
        src = data + BLOCK_SIZE * cur_rank
        dst = copied_put + BLOCK_SIZE * cur_rank
        iris.copy(src + offsets, dst + offsets, cur_rank, target_rank, cur_rank, heap_bases, mask)
    for i in range(num_ranks):  # copy_local
        src = data + BLOCK_SIZE * i
        dst = copied_local + BLOCK_SIZE * i
        iris.copy(src + offsets, dst + offsets, cur_rank, cur_rank, cur_rank, heap_bases, mask)


@triton.jit
def _atomic_kernel(results, vals, n, OP: tl.constexpr, sem: tl.constexpr, scope: tl.constexpr,
                   cur_rank: tl.constexpr, num_ranks: tl.constexpr, BLOCK_SIZE: tl.constexpr, heap_bases):
    """The block atomics of upstream's test_atomic_<op>: for every target, ``val`` (here this rank's
    row ``target`` of ``vals``) with the mask passed positionally as the 6th argument."""
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    for target in range(num_ranks):
        acc = tl.load(vals + target * BLOCK_SIZE + offsets, mask=mask)
        if OP == "add":
            iris.atomic_add(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)
        elif OP == "sub":
            iris.atomic_sub(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)
        elif OP == "xor":
            iris.atomic_xor(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)
        elif OP == "and":
            iris.atomic_and(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)
        elif OP == "or":
            iris.atomic_or(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)
        elif OP == "min":
            iris.atomic_min(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)
        else:
            tl.static_assert(OP == "max")
            iris.atomic_max(results + offsets, acc, cur_rank, target, heap_bases, mask, sem=sem, scope=scope)


@triton.jit
def _atomic_add_ones_kernel(results, sem: tl.constexpr, scope: tl.constexpr, cur_rank: tl.constexpr,
                            num_ranks: tl.constexpr, BLOCK_SIZE: tl.constexpr, heap_bases):
    """Upstream test_atomic_add's kernel as it is: a constant 1 from every rank to every rank."""
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < BLOCK_SIZE
    acc = tl.full([BLOCK_SIZE], 1, dtype=results.type.element_ty)
    for target_rank in range(num_ranks):
        iris.atomic_add(results + offsets, acc, cur_rank, target_rank, heap_bases, mask, sem=sem, scope=scope)


@triton.jit
def _atomic_scalar_kernel(results, vals, olds, OP: tl.constexpr, sem: tl.constexpr, scope: tl.constexpr,
                          cur_rank: tl.constexpr, num_ranks: tl.constexpr, heap_bases):
    """Upstream's test_atomic_cas / test_atomic_xchg: one element (a scalar pointer), every rank at
    every rank; cas with ``cmp`` 0 and no mask, xchg with ``mask=None``. The old values go to
    ``olds[target]``."""
    for target_rank in range(num_ranks):
        val = tl.load(vals + target_rank)
        if OP == "cas":
            cmp = tl.full((), 0, dtype=results.type.element_ty)
            old = iris.atomic_cas(results, cmp, val, cur_rank, target_rank, heap_bases, sem=sem, scope=scope)
        else:
            tl.static_assert(OP == "xchg")
            old = iris.atomic_xchg(results, val, cur_rank, target_rank, heap_bases, mask=None, sem=sem, scope=scope)
        tl.store(olds + target_rank, old)


@triton.jit
def _hint_kernel(data, loaded, stored, got, put_dst, copied, added, vals, n, HINT: tl.constexpr,
                 cur_rank: tl.constexpr, num_ranks: tl.constexpr, BLOCK_SIZE: tl.constexpr, heap_bases):
    """Every data-moving call and an atomic, with ``hint=HINT`` (None, or BLOCK_SIZE as upstream's
    kernels pass it); rows indexed by rank as in the kernels above."""
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    value = tl.load(data + offsets, mask=mask)
    for peer in range(num_ranks):
        row = peer * BLOCK_SIZE
        mine = cur_rank * BLOCK_SIZE
        result = iris.load(data + offsets, cur_rank, peer, heap_bases, mask=mask, hint=HINT)
        tl.store(loaded + row + offsets, result, mask=mask)
        iris.store(stored + mine + offsets, value, cur_rank, peer, heap_bases, mask=mask, hint=HINT)
        iris.get(data + offsets, got + row + offsets, cur_rank, peer, heap_bases, mask=mask, hint=HINT)
        iris.put(data + offsets, put_dst + mine + offsets, cur_rank, peer, heap_bases, mask=mask, hint=HINT)
        iris.copy(data + offsets, copied + row + offsets, peer, cur_rank, cur_rank, heap_bases, mask=mask, hint=HINT)
        acc = tl.load(vals + row + offsets, mask=mask)
        iris.atomic_add(added + offsets, acc, cur_rank, peer, heap_bases, mask, sem="acq_rel", scope="sys", hint=HINT)


@triton.jit
def _hint_2d_kernel(data, loaded, stored, got, M, N, HINTED: tl.constexpr, cur_rank: tl.constexpr,
                    num_ranks: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, heap_bases):
    """A 2-D block ``[BLOCK_SIZE_M, BLOCK_SIZE_N]`` with the tuple hint written in the call, as
    upstream's ccl kernels write ``hint=(1, BLOCK_SIZE_N)`` (a tuple passed as a constexpr kernel
    argument is no hint Triton's ``tl.multiple_of`` takes), or without a hint."""
    rm = tl.arange(0, BLOCK_SIZE_M)
    rn = tl.arange(0, BLOCK_SIZE_N)
    offsets = rm[:, None] * BLOCK_SIZE_N + rn[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    value = tl.load(data + offsets, mask=mask)
    for peer in range(num_ranks):
        row = peer * BLOCK_SIZE_M * BLOCK_SIZE_N
        mine = cur_rank * BLOCK_SIZE_M * BLOCK_SIZE_N
        if HINTED:
            result = iris.load(data + offsets, cur_rank, peer, heap_bases, mask=mask, hint=(1, BLOCK_SIZE_N))
            iris.store(stored + mine + offsets, value, cur_rank, peer, heap_bases, mask=mask, hint=(1, BLOCK_SIZE_N))
            iris.get(data + offsets, got + row + offsets, cur_rank, peer, heap_bases, mask=mask, hint=(1, BLOCK_SIZE_N))
        else:
            result = iris.load(data + offsets, cur_rank, peer, heap_bases, mask=mask)
            iris.store(stored + mine + offsets, value, cur_rank, peer, heap_bases, mask=mask)
            iris.get(data + offsets, got + row + offsets, cur_rank, peer, heap_bases, mask=mask)
        tl.store(loaded + row + offsets, result, mask=mask)


# -- kernels: DeviceContext ---------------------------------------------------------------------------------


@triton.jit
def _dctx_move_kernel(context_tensor, data, loaded, got, stored, put_dst, pulled, pushed, n,
                      cur_rank: tl.constexpr, num_ranks: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    dctx = DeviceContext.initialize(context_tensor, cur_rank, num_ranks)
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    for peer in range(num_ranks):
        row = peer * BLOCK_SIZE
        mine = cur_rank * BLOCK_SIZE
        result = dctx.load(data + offsets, from_rank=peer, mask=mask)
        tl.store(loaded + row + offsets, result, mask=mask)
        dctx.get(data + offsets, got + row + offsets, from_rank=peer, mask=mask)
        dctx.store(stored + mine + offsets, tl.load(data + offsets, mask=mask), to_rank=peer, mask=mask)
        dctx.put(data + offsets, put_dst + mine + offsets, to_rank=peer, mask=mask)
        dctx.copy(data + offsets, pulled + row + offsets, from_rank=peer, to_rank=cur_rank, mask=mask)
        dctx.copy(data + offsets, pushed + mine + offsets, from_rank=cur_rank, to_rank=peer, mask=mask)


@triton.jit
def _dctx_atomic_add_kernel(context_tensor, results, vals, n, cur_rank: tl.constexpr, num_ranks: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr):
    dctx = DeviceContext.initialize(context_tensor, cur_rank, num_ranks)
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    for target in range(num_ranks):
        acc = tl.load(vals + target * BLOCK_SIZE + offsets, mask=mask)
        dctx.atomic_add(results + offsets, acc, to_rank=target, mask=mask, sem="acq_rel", scope="sys")


@triton.jit
def _dctx_atomic_cas_kernel(context_tensor, flag, old_out, whose, cur_rank: tl.constexpr, num_ranks: tl.constexpr):
    """Upstream test_device_context's cas: flag 0 -> 1 on the partner rank; then, to tell which
    rank reached which, ``whose`` 0 -> this rank + 1 on the partner rank."""
    dctx = DeviceContext.initialize(context_tensor, cur_rank, num_ranks)
    pid = tl.program_id(0)
    partner = int((cur_rank + num_ranks // 2) % num_ranks)
    old = dctx.atomic_cas(flag + pid, 0, 1, to_rank=partner, sem="release", scope="sys")
    tl.store(old_out + pid, old)
    dctx.atomic_cas(whose + pid, 0, cur_rank + 1, to_rank=partner, sem="acq_rel", scope="gpu")


@triton.jit
def _traced_put(dctx, dummy_buffer, handles, data, put_dst, target, PUT_EVENT: tl.constexpr, LOAD_EVENT: tl.constexpr,
                BLOCK_SIZE: tl.constexpr):
    """Upstream's test_device_context tracing calls around a put: with tracing off the records
    return 0 and write nothing, and the context still moves data."""
    offsets = tl.arange(0, BLOCK_SIZE)
    handle = dctx.tracing.record_event_start(event_id=PUT_EVENT, target_rank=target,
                                             address=dummy_buffer + offsets, pid_m=tl.program_id(0), pid_n=0)
    dctx.put(data + offsets, put_dst + offsets, to_rank=target)
    dctx.tracing.record_event_end(handle)
    tl.store(handles, handle)
    handle = dctx.tracing.record_event_start(event_id=LOAD_EVENT, target_rank=target,
                                             address=dummy_buffer + offsets, pid_m=tl.program_id(0), pid_n=0,
                                             mask=tl.full([BLOCK_SIZE], True, tl.int1))
    dctx.tracing.record_event_end(handle)
    tl.store(handles + 1, handle)


@triton.jit
def _tracing_off_kernel(context_tensor, dummy_buffer, handles, data, put_dst, cur_rank: tl.constexpr,
                        num_ranks: tl.constexpr, TRACING: tl.constexpr, BLOCK_SIZE: tl.constexpr = 4):
    """Upstream's tracing kernel, ``TraceEvent().put`` and all, with ``tracing=False``."""
    dctx = DeviceContext.initialize(context_tensor, cur_rank, num_ranks, tracing=TRACING)
    _traced_put(dctx, dummy_buffer, handles, data, put_dst, (cur_rank + 1) % num_ranks, TraceEvent().put,
                TraceEvent().load, BLOCK_SIZE)


@triton.jit
def _tracing_off_literal_ids_kernel(context_tensor, dummy_buffer, handles, data, put_dst, cur_rank: tl.constexpr,
                                    num_ranks: tl.constexpr, TRACING: tl.constexpr, BLOCK_SIZE: tl.constexpr = 4):
    """The same with the event ids written as numbers (upstream's put = 3, load = 0), so that what
    tracing=False does is checked apart from ``TraceEvent``."""
    dctx = DeviceContext.initialize(context_tensor, cur_rank, num_ranks, tracing=TRACING)
    _traced_put(dctx, dummy_buffer, handles, data, put_dst, (cur_rank + 1) % num_ranks, 3, 0, BLOCK_SIZE)


@triton.jit
def _manual_context_kernel(context, data, header, loaded, n, cur_rank: tl.constexpr, num_ranks: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr):
    """The device context decoded by hand, as upstream's layout allows: ``[rank, world, base_0, ...]``."""
    heap_bases = context + 2
    tl.store(header, tl.load(context))
    tl.store(header + 1, tl.load(context + 1))
    for r in range(num_ranks):
        tl.store(header + 2 + r, tl.load(heap_bases + r))
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    for source_rank in range(num_ranks):
        result = iris.load(data + offsets, cur_rank, source_rank, heap_bases, mask=mask)
        tl.store(loaded + source_rank * BLOCK_SIZE + offsets, result, mask=mask)


# -- data ------------------------------------------------------------------------------------------------------


def _random(dtype: torch.dtype, shape, *seed, small: bool = False) -> torch.Tensor:
    """Seeded random values (CPU): the whole range of ``dtype``, or small ones (floats: multiples of
    1/4 below 8 in magnitude) whose sums of a few are exact in every dtype."""
    g = seeded_generator(*seed)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    if dtype.is_floating_point:
        if small:
            return (torch.randint(-32, 33, shape, generator=g) / 4).to(dtype)
        return torch.randn(shape, generator=g).to(dtype)
    if small:
        return torch.randint(-1000, 1001, shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


def _owned(owner: int, what: str, dtype: torch.dtype, shape, small: bool = False) -> torch.Tensor:
    """What rank ``owner`` writes as ``what``: every rank can recompute it."""
    return _random(dtype, shape, "upstream-device-api", owner, what, _name(dtype), shape, small=small)


def _equal(actual: torch.Tensor, expected: torch.Tensor):
    """True, or the mismatch as text (shown in the failing test)."""
    actual = actual.detach().cpu()
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"got {actual.dtype} {tuple(actual.shape)}, expected {expected.dtype} {tuple(expected.shape)}"
    if torch.equal(actual, expected):
        return True
    wrong = (actual != expected).nonzero().tolist()
    return (f"{len(wrong)} of {actual.numel()} elements differ (first at {wrong[0]})\n"
            f"  actual:   {actual.tolist()}\n  expected: {expected.tolist()}")


class _Checker:
    """Checks of one (section, dtype, case), named ``section/dtype/case/what``."""

    def __init__(self, report: RankReport, prefix: str):
        self.report, self.prefix = report, prefix

    def rows(self, what: str, actual: torch.Tensor, expected: torch.Tensor, initial: torch.Tensor, n: int) -> None:
        """``actual`` ([..., BLOCK]) is ``expected`` on lanes below n and ``initial`` from n on."""
        self.report[f"{self.prefix}/{what}"] = _equal(actual[..., :n], expected[..., :n])
        if n < actual.shape[-1]:
            self.report[f"{self.prefix}/{what}_masked_lanes_kept"] = _equal(actual[..., n:], initial[..., n:])

    def same(self, what: str, actual, expected) -> None:
        self.report[f"{self.prefix}/{what}"] = _equal(actual, expected)

    def check(self, what: str, ok) -> None:
        self.report.check(f"{self.prefix}/{what}", ok)


def _heap_copy(ctx, cpu: torch.Tensor) -> torch.Tensor:
    """``cpu`` copied into a new tensor of the symmetric heap."""
    t = ctx.zeros(tuple(cpu.shape), dtype=cpu.dtype)
    t.copy_(cpu)
    return t


class Run(SimpleNamespace):
    """One launch of a section: its parameters, buffers and what they held before."""


def _cases(dtype: torch.dtype):
    for block, n in CASES:
        yield block, n, f"{_name(dtype)}/B{block}n{n}"


# -- the worker's sections ---------------------------------------------------------------------------------


def _check_moves(ctx, report: RankReport) -> None:
    """load, store, get (both forms), put: every dtype and block, one barrier pair for all."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    heap_bases = ctx.get_heap_bases()
    kinds = ("load", "store", "get", "put")
    runs = []
    for dtype in MOVE_DTYPES:
        for block, n, tag in _cases(dtype):
            run = Run(dtype=dtype, block=block, n=n, tag=tag, outs={}, initial={})
            run.data = _heap_copy(ctx, _owned(cur_rank, "data", dtype, block))
            run.small = _heap_copy(ctx, _owned(cur_rank, "small", dtype, block, small=True))
            for kind in kinds:
                run.initial[kind] = _owned(cur_rank, f"initial-{kind}", dtype, (num_ranks, block))
                run.outs[kind] = _heap_copy(ctx, run.initial[kind])
            run.initial["get_accumulate"] = _owned(cur_rank, "initial-get-acc", dtype, block)
            run.outs["get_accumulate"] = ctx.zeros_like(run.small)
            run.outs["get_accumulate"].copy_(run.initial["get_accumulate"])
            runs.append(run)
    ctx.barrier()
    for r in runs:
        _moves_kernel[(1,)](r.data, r.small, *(r.outs[k] for k in (*kinds, "get_accumulate")), r.n, cur_rank,
                            num_ranks, r.block, heap_bases)
    ctx.barrier()
    for r in runs:
        every = torch.stack([_owned(q, "data", r.dtype, r.block) for q in range(num_ranks)])  # row q: rank q's
        for kind in kinds:
            # load, get: row q was read from rank q; store, put: row q was written here by rank q.
            _Checker(report, f"{kind}/{r.tag}").rows("every_rank", r.outs[kind], every, r.initial[kind], r.n)
        # The expectations are not met by chance: the ranks' data differ.
        report.check(f"data_differs/{r.tag}", not torch.equal(every[0], every[1]))
        skip = _loop_sum_limit(ctx, r.dtype)
        if skip:
            report[f"skipped/get_accumulate/{_name(r.dtype)}"] = skip
            continue
        acc = torch.zeros(r.block, dtype=r.dtype)
        for q in range(num_ranks):
            acc = acc + _owned(q, "small", r.dtype, r.block, small=True)
        _Checker(report, f"get_accumulate/{r.tag}").rows("summed", r.outs["get_accumulate"], acc,
                                                         r.initial["get_accumulate"], r.n)


def _loop_sum_limit(ctx, dtype: torch.dtype) -> str | None:
    """Why the upstream test_get kernel's sum cannot be checked here, if it cannot: Triton's
    interpreter gets a ``dtype`` value carried through a loop wrong (shown without iris)."""
    if ctx.device.type != "cpu":
        return None
    data = _random(dtype, 8, "loop-control", small=True)
    out = torch.zeros(8, dtype=dtype)
    _loop_sum_control_kernel[(1,)](data, out, 2, 8)
    if torch.equal(out, data + data):
        return None
    return (f"Triton's interpreter sums {_name(dtype)} wrongly in a loop (acc += tl.load(...) in a for loop, "
            f"no iris involved: {(data + data).tolist()[:3]} came out as {out.tolist()[:3]})")


def _check_copy(ctx, report: RankReport) -> None:
    """Upstream's test_copy_get / test_copy_put / test_copy_local: ``data`` is ``[num_ranks, BLOCK]``
    on every rank; copy's from/to/cur ranks as upstream passes them, the mask positional."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    heap_bases = ctx.get_heap_bases()
    kinds = ("copy_get", "copy_put", "copy_local")
    runs = []
    for dtype in MOVE_DTYPES:
        for block, n, tag in _cases(dtype):
            run = Run(dtype=dtype, block=block, n=n, tag=tag, outs={}, initial={})
            run.data = ctx.zeros((num_ranks, block), dtype=dtype)
            run.data.copy_(_owned(cur_rank, "copy-data", dtype, (num_ranks, block)))
            for kind in kinds:
                run.initial[kind] = _owned(cur_rank, f"initial-{kind}", dtype, (num_ranks, block))
                run.outs[kind] = ctx.zeros_like(run.data)
                run.outs[kind].copy_(run.initial[kind])
            runs.append(run)
    ctx.barrier()
    for r in runs:
        _copy_kernel[(1,)](r.data, *(r.outs[k] for k in kinds), r.n, cur_rank, num_ranks, r.block, heap_bases)
    ctx.barrier()
    for r in runs:
        rows = [_owned(q, "copy-data", r.dtype, (num_ranks, r.block)) for q in range(num_ranks)]
        expected = {
            # copy_get: my row t := rank t's row cur_rank (read from t, written here).
            "copy_get": torch.stack([rows[t][cur_rank] for t in range(num_ranks)]),
            # copy_put: rank q wrote its row q into my row q.
            "copy_put": torch.stack([rows[q][q] for q in range(num_ranks)]),
            "copy_local": rows[cur_rank],
        }
        check = _Checker(report, f"copy/{r.tag}")
        for kind in kinds:
            check.rows(kind, r.outs[kind], expected[kind], r.initial[kind], r.n)


def _atomic_operands(op: str, dtype: torch.dtype, q: int, shape, tag: str) -> torch.Tensor:
    """Rank q's operands (row t: for target t): small numbers for add and sub (exact sums), a
    quarter of the bits set for or, a quarter cleared for and, any value otherwise."""
    def rnd(k):
        return _owned(q, f"atomic-{op}-{tag}-{k}", dtype, shape, small=op in ("add", "sub"))

    if op == "or":
        return rnd(0) & rnd(1)
    if op == "and":
        return ~(rnd(0) & rnd(1))
    return rnd(0)


def _atomic_initial(op: str, dtype: torch.dtype, block: int, tag: str) -> torch.Tensor:
    """What every target holds before (the same on every rank): upstream's zeros for xor and or,
    every bit set for and (upstream's ``(1 << num_ranks) - 1`` for a rank per bit), the dtype's
    extreme for min and max; small random numbers for add and sub."""
    if op == "min":
        return torch.full((block,), torch.iinfo(dtype).max, dtype=dtype)
    if op == "max":
        return torch.full((block,), torch.iinfo(dtype).min, dtype=dtype)
    if op == "and":
        return torch.full((block,), -1, dtype=dtype)
    if op in ("xor", "or"):
        return torch.zeros(block, dtype=dtype)
    return _random(dtype, block, "atomic-initial", op, tag, small=True)


def _atomic_expected(op: str, initial: torch.Tensor, operands: list[torch.Tensor]) -> torch.Tensor:
    out = initial.clone()
    for v in operands:
        if op == "add":
            out = out + v
        elif op == "sub":
            out = out - v
        elif op == "xor":
            out = out ^ v
        elif op == "and":
            out = out & v
        elif op == "or":
            out = out | v
        elif op == "min":
            out = torch.minimum(out, v)
        else:
            out = torch.maximum(out, v)
    return out


def _scalar_values(q: int, op: str, tag: str, num_ranks: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank q's values of a scalar atomic (index t: for target t): random, nonzero (cas swaps
    only a 0) and distinct between ranks."""
    base = _random(torch.int64, num_ranks, "atomic-scalar", op, tag).abs() % 3000 + 1
    return (base * 8 + q + 1).to(dtype)


def _interpreter_limit(ctx, key) -> str | None:
    return INTERPRETER_LIMITS.get(key) if ctx.device.type == "cpu" else None


def _check_atomics(ctx, report: RankReport) -> None:
    """Every atomic of upstream's tests from every rank to every rank at once: block atomics on a
    few blocks, each with another (sem, scope) of upstream's, and the scalar cas and xchg."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    heap_bases = ctx.get_heap_bases()
    combos = iter(COMBOS * 100)
    blocks, scalars, ones = [], [], []
    for op, dtype in ATOMIC_PARAMS:
        skip = _interpreter_limit(ctx, ("atomic", op, dtype))
        if skip:
            report[f"skipped/atomic/{op}/{_name(dtype)}"] = skip
            continue
        if op in BLOCK_ATOMICS:
            for block, n in ATOMIC_CASES:
                sem, scope = next(combos)
                run = Run(op=op, dtype=dtype, block=block, n=n, sem=sem, scope=scope,
                          tag=f"{_name(dtype)}/B{block}n{n}/{sem}/{scope}")
                run.initial = _atomic_initial(op, dtype, block, run.tag)
                if op in ("min", "max", "and"):  # upstream's ctx.full
                    run.results = ctx.full((block,), run.initial[0].item(), dtype=dtype)
                elif op in ("xor", "or"):  # upstream's ctx.zeros
                    run.results = ctx.zeros(block, dtype=dtype)
                else:
                    run.results = _heap_copy(ctx, run.initial)
                run.vals = _heap_copy(ctx, _atomic_operands(op, dtype, cur_rank, (num_ranks, block), run.tag))
                blocks.append(run)
        else:
            for _ in range(2):
                sem, scope = next(combos)
                run = Run(op=op, dtype=dtype, sem=sem, scope=scope, tag=f"{_name(dtype)}/{sem}/{scope}")
                run.results = ctx.zeros((1,), dtype=dtype)
                run.vals = _heap_copy(ctx, _scalar_values(cur_rank, op, run.tag, num_ranks, dtype))
                run.olds = ctx.full((num_ranks,), -1, dtype=dtype)
                scalars.append(run)
    for dtype in ATOMIC_DTYPES["add"]:  # upstream's own kernel: constant ones, zeros before
        skip = _interpreter_limit(ctx, ("atomic_ones", "add", dtype))
        if skip:
            report[f"skipped/atomic_ones/add/{_name(dtype)}"] = skip
            continue
        for block in (1, 8, 16, 32):
            sem, scope = next(combos)
            ones.append(Run(dtype=dtype, block=block, sem=sem, scope=scope, results=ctx.zeros(block, dtype=dtype)))
    ctx.barrier()
    for r in blocks:
        _atomic_kernel[(1,)](r.results, r.vals, r.n, r.op, r.sem, r.scope, cur_rank, num_ranks, r.block, heap_bases)
    for r in scalars:
        _atomic_scalar_kernel[(1,)](r.results, r.vals, r.olds, r.op, r.sem, r.scope, cur_rank, num_ranks, heap_bases)
    for r in ones:
        _atomic_add_ones_kernel[(1,)](r.results, r.sem, r.scope, cur_rank, num_ranks, r.block, heap_bases)
    ctx.barrier()
    for r in blocks:
        operands = [_atomic_operands(r.op, r.dtype, q, (num_ranks, r.block), r.tag)[cur_rank] for q in range(num_ranks)]
        _Checker(report, f"atomic/{r.op}/{r.tag}").rows("final", r.results, _atomic_expected(r.op, r.initial, operands),
                                                        r.initial, r.n)
    gathered = ctx.comm.all_gather_object([r.olds.cpu() for r in scalars])
    for i, r in enumerate(scalars):
        check = _Checker(report, f"atomic/{r.op}/{r.tag}")
        final = r.results.cpu()[0]
        sent = [_scalar_values(q, r.op, r.tag, num_ranks, r.dtype)[cur_rank] for q in range(num_ranks)]
        got = [gathered[q][i][cur_rank] for q in range(num_ranks)]  # what each rank's atomic on me returned
        if r.op == "cas":
            winners = [q for q in range(num_ranks) if got[q] == 0]
            check.check("one_winner", len(winners) == 1)
            check.check("final_is_the_winners_value", len(winners) == 1 and final == sent[winners[0]])
            losers = [q for q in range(num_ranks) if q not in winners]
            check.check("losers_saw_the_final_value", all(got[q] == final for q in losers))
        else:  # every value that was there was returned exactly once, and one remains
            seen = sorted([*(float(g) for g in got), float(final)])
            check.check("olds_and_final_are_a_permutation", seen == sorted([0.0, *(float(v) for v in sent)]))
    for r in ones:
        _Checker(report, f"atomic_ones/add/{_name(r.dtype)}/B{r.block}/{r.sem}/{r.scope}").same(
            "final", r.results, torch.ones(r.block, dtype=r.dtype) * num_ranks)


def _check_hints(ctx, report: RankReport) -> None:
    """Every call with ``hint=`` (an int for 1-D blocks, a tuple for a 2-D block): the results
    are those without the hint, and the expected ones."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    heap_bases = ctx.get_heap_bases()
    kinds, kinds_2d = ("loaded", "stored", "got", "put", "copied"), ("loaded", "stored", "got")
    runs, runs_2d = [], []
    for dtype in HINT_DTYPES:
        for block, n in HINT_CASES:
            tag = f"{_name(dtype)}/B{block}n{n}"
            data = _heap_copy(ctx, _owned(cur_rank, "hint-data", dtype, block))
            for hint in (None, block):
                run = Run(dtype=dtype, block=block, n=n, tag=tag, hint=hint, data=data)
                run.initial = _owned(cur_rank, "hint-initial", dtype, (num_ranks, block))
                run.outs = {k: _heap_copy(ctx, run.initial) for k in kinds}
                run.start = _random(dtype, block, "hint-added", tag, small=True)
                run.outs["atomic_add"] = _heap_copy(ctx, run.start)
                run.vals = _heap_copy(ctx, _owned(cur_rank, f"hint-vals-{tag}", dtype, (num_ranks, block), small=True))
                runs.append(run)
        for bm, bn, m, nn in HINT_2D:
            tag = f"{_name(dtype)}/{bm}x{bn}/{m}x{nn}"
            data = _heap_copy(ctx, _owned(cur_rank, "hint2d-data", dtype, (bm, bn)))
            for hint in (None, (1, bn)):
                run = Run(dtype=dtype, bm=bm, bn=bn, m=m, nn=nn, tag=tag, hint=hint, data=data)
                run.initial = _owned(cur_rank, "hint2d-initial", dtype, (num_ranks, bm, bn))
                run.outs = {k: _heap_copy(ctx, run.initial) for k in kinds_2d}
                runs_2d.append(run)
    ctx.barrier()
    for r in runs:
        _hint_kernel[(1,)](r.data, *(r.outs[k] for k in kinds), r.outs["atomic_add"], r.vals, r.n, r.hint, cur_rank,
                           num_ranks, r.block, heap_bases)
    for r in runs_2d:
        _hint_2d_kernel[(1,)](r.data, *(r.outs[k] for k in kinds_2d), r.m, r.nn, r.hint is not None, cur_rank,
                              num_ranks, r.bm, r.bn, heap_bases)
    ctx.barrier()
    unhinted = {}
    for r in runs:
        every = torch.stack([_owned(q, "hint-data", r.dtype, r.block) for q in range(num_ranks)])
        summed = r.start.clone()
        for q in range(num_ranks):
            summed = summed + _owned(q, f"hint-vals-{r.tag}", r.dtype, (num_ranks, r.block), small=True)[cur_rank]
        check = _Checker(report, f"hint/{r.tag}/hint={r.hint}")
        for k in kinds:
            check.rows(k, r.outs[k], every, r.initial, r.n)
        check.rows("atomic_add", r.outs["atomic_add"], summed, r.start, r.n)
        results = {k: v.cpu() for k, v in r.outs.items()}
        if r.hint is None:
            unhinted[r.tag] = results
        else:
            check.check("identical_to_no_hint", all(torch.equal(unhinted[r.tag][k], v) for k, v in results.items()))
    for r in runs_2d:
        every = torch.stack([_owned(q, "hint2d-data", r.dtype, (r.bm, r.bn)) for q in range(num_ranks)])
        check = _Checker(report, f"hint/{r.tag}/hint={r.hint}")
        off = torch.ones((r.bm, r.bn), dtype=torch.bool)
        off[:r.m, :r.nn] = False  # the lanes the mask turns off
        results = {k: v.cpu() for k, v in r.outs.items()}
        for k, actual in results.items():
            check.same(k, actual[:, :r.m, :r.nn], every[:, :r.m, :r.nn])
            if off.any():
                check.same(f"{k}_masked_lanes_kept", actual[:, off], r.initial[:, off])
        if r.hint is None:
            unhinted[r.tag] = results
        else:
            check.check("identical_to_no_hint", all(torch.equal(unhinted[r.tag][k], v) for k, v in results.items()))


def _check_device_context(ctx, report: RankReport) -> None:
    """Upstream test_device_context: ``DeviceContext.initialize(ctx.get_device_context(), cur_rank,
    num_ranks)`` and its methods with ``from_rank=`` / ``to_rank=``."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    context_tensor = ctx.get_device_context()
    kinds = ("loaded", "got", "stored", "put", "pulled", "pushed")
    moves, adds = [], []
    for dtype in MOVE_DTYPES:
        for block, n, tag in _cases(dtype):
            run = Run(dtype=dtype, block=block, n=n, tag=tag)
            run.data = ctx.full((block,), cur_rank, dtype=dtype)  # upstream's data, then random
            run.data.copy_(_owned(cur_rank, "dctx-data", dtype, block))
            run.initial = _owned(cur_rank, "dctx-initial", dtype, (num_ranks, block))
            run.outs = {k: _heap_copy(ctx, run.initial) for k in kinds}
            moves.append(run)
    for dtype in (*DCTX_ATOMIC_DTYPES, torch.bfloat16):
        skip = _interpreter_limit(ctx, ("atomic", "add", dtype))
        if skip:
            report[f"skipped/dctx_atomic_add/{_name(dtype)}"] = skip
            continue
        for block, n in DCTX_ATOMIC_CASES:
            run = Run(dtype=dtype, block=block, n=n, tag=f"{_name(dtype)}/B{block}n{n}")
            run.results = ctx.zeros(block, dtype=dtype)
            run.vals = _heap_copy(ctx, _owned(cur_rank, f"dctx-add-{run.tag}", dtype, (num_ranks, block), small=True))
            adds.append(run)
    flag = ctx.zeros(1, dtype=torch.int32)
    cas_old = ctx.full((1,), -1, dtype=torch.int32)
    whose = ctx.zeros(1, dtype=torch.int32)
    ctx.barrier()
    for r in moves:
        _dctx_move_kernel[(1,)](context_tensor, r.data, *(r.outs[k] for k in kinds), r.n, cur_rank, num_ranks, r.block)
    for r in adds:
        _dctx_atomic_add_kernel[(1,)](context_tensor, r.results, r.vals, r.n, cur_rank, num_ranks, r.block)
    _dctx_atomic_cas_kernel[(1,)](context_tensor, flag, cas_old, whose, cur_rank, num_ranks)
    ctx.barrier()
    for r in moves:
        every = torch.stack([_owned(q, "dctx-data", r.dtype, r.block) for q in range(num_ranks)])
        check = _Checker(report, f"dctx/{r.tag}")
        for k in kinds:  # row q: read from q (loaded, got, pulled) or written by q (stored, put, pushed)
            check.rows(k, r.outs[k], every, r.initial, r.n)
    for r in adds:
        summed = torch.zeros(r.block, dtype=r.dtype)
        for q in range(num_ranks):
            summed = summed + _owned(q, f"dctx-add-{r.tag}", r.dtype, (num_ranks, r.block), small=True)[cur_rank]
        _Checker(report, f"dctx_atomic_add/{r.tag}").rows("final", r.results, summed,
                                                          torch.zeros(r.block, dtype=r.dtype), r.n)
    # Upstream's partner is a permutation of the ranks: every rank's flag is set once, from 0.
    check = _Checker(report, "dctx_atomic_cas/int32")
    check.same("flag", flag, torch.tensor([1], dtype=torch.int32))
    check.same("old", cas_old, torch.tensor([0], dtype=torch.int32))
    sender = (cur_rank - num_ranks // 2) % num_ranks  # the rank whose partner I am
    check.same("set_by_the_rank_whose_partner_I_am", whose, torch.tensor([sender + 1], dtype=torch.int32))


def _check_context_layout(ctx, report: RankReport) -> None:
    """``get_device_context()`` is int64 ``[rank, world, base_0, ..., base_{W-1}, ...]`` (upstream's
    test_device_context_initialize), and a kernel that decodes it by hand works."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    context = ctx.get_device_context()
    bases = ctx.get_heap_bases().cpu()
    check = _Checker(report, "layout")
    check.check("is_a_tensor", isinstance(context, torch.Tensor))
    check.check("int64", context.dtype == torch.int64)
    check.check("on_the_device", context.device == ctx.get_device())
    check.check("length_at_least_2_plus_world", context.dim() == 1 and context.shape[0] >= 2 + num_ranks)
    host = context.cpu()
    check.check("rank", int(host[0]) == cur_rank)
    check.check("world", int(host[1]) == num_ranks)
    check.check("bases", host[2:2 + num_ranks].tolist() == bases.tolist())
    check.check("heap_bases_one_per_rank", tuple(bases.shape) == (num_ranks,))
    check.check("bases_distinct", len(set(bases.tolist())) == num_ranks)
    block, n = 16, 13
    runs = []
    for dtype in (torch.int8, torch.float32):
        run = Run(dtype=dtype, data=_heap_copy(ctx, _owned(cur_rank, "layout-data", dtype, block)))
        run.initial = _owned(cur_rank, "layout-initial", dtype, (num_ranks, block))
        run.loaded = _heap_copy(ctx, run.initial)
        run.header = ctx.full((2 + num_ranks,), -1, dtype=torch.int64)
        runs.append(run)
    ctx.barrier()
    for r in runs:
        _manual_context_kernel[(1,)](context, r.data, r.header, r.loaded, n, cur_rank, num_ranks, block)
    ctx.barrier()
    for r in runs:
        check = _Checker(report, f"layout/{_name(r.dtype)}")
        check.same("header_read_in_kernel", r.header, host[:2 + num_ranks])
        every = torch.stack([_owned(q, "layout-data", r.dtype, block) for q in range(num_ranks)])
        check.rows("load_through_context_plus_2", r.loaded, every, r.initial, n)


def _check_tracing_off(ctx, report: RankReport, kernel, name: str) -> None:
    """``initialize(..., tracing=False)``: ``record_event_start`` returns 0, nothing is recorded."""
    cur_rank, num_ranks = ctx.cur_rank, ctx.num_ranks
    context_tensor = ctx.get_device_context()
    dummy = ctx.ones((16,), dtype=torch.int64)
    handles = ctx.full((2,), -1, dtype=torch.int32)
    data = _heap_copy(ctx, _owned(cur_rank, f"{name}-data", torch.float32, 4))
    put_dst = ctx.zeros(4, dtype=torch.float32)
    before = context_tensor.cpu().clone()
    ctx.barrier()
    try:
        kernel[(1,)](context_tensor, dummy, handles, data, put_dst, cur_rank=cur_rank, num_ranks=num_ranks,
                     TRACING=False)
    finally:
        ctx.barrier()
    check = _Checker(report, name)
    check.same("handles_are_zero", handles, torch.zeros(2, dtype=torch.int32))
    check.same("dummy_untouched", dummy, torch.ones(16, dtype=torch.int64))
    check.same("context_untouched", context_tensor, before)
    check.same("put_still_moved_data", put_dst, _owned((cur_rank - 1) % num_ranks, f"{name}-data", torch.float32, 4))


def _check_setup(ctx, rank: int, world: int, report: RankReport) -> None:
    check = _Checker(report, "setup")
    check.check("cur_rank", ctx.cur_rank == rank and ctx.get_rank() == rank)
    check.check("num_ranks", ctx.num_ranks == world and ctx.get_num_ranks() == world)
    bases = ctx.get_heap_bases()
    check.check("heap_bases_tensor", isinstance(bases, torch.Tensor) and tuple(bases.shape) == (world,))
    check.check("heap_bases_on_the_device", bases.device == ctx.get_device())
    check.check("heap_bases_attribute", ctx.heap_bases is bases)
    check.check("device_is_a_string", isinstance(ctx.device, str) and str(ctx.get_device()) == ctx.device)


def _worker(rank: int, world: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.iris(HEAP)
    report["device"] = str(ctx.device)
    with report.section("setup"):
        _check_setup(ctx, rank, world, report)
    sections = {
        "moves": _check_moves, "copy": _check_copy, "atomics": _check_atomics, "hints": _check_hints,
        "device_context": _check_device_context, "layout": _check_context_layout,
        "tracing": partial(_check_tracing_off, kernel=_tracing_off_literal_ids_kernel, name="tracing"),
        "trace_event": partial(_check_tracing_off, kernel=_tracing_off_kernel, name="trace_event"),
    }
    for name, section in sections.items():
        with report.section(name):
            section(ctx, report)
        ctx.barrier()
    ctx.destroy()
    return report.packed()


# -- the tests ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def reports(request) -> list[dict]:
    """Every rank's report for one world size, from one spawn: a GPU per rank when there are
    enough, every rank on GPU 0 when there is exactly one, else CPU ranks (Triton's interpreter)."""
    world = request.param
    return reports_on_available_ranks(_worker, world, world, timeout=RANK_TIMEOUT)


def _assert_checks(reports: list[dict], section: str, prefix: str, per_rank: int | None = None,
                   skip_key: str | None = None) -> dict:
    """The section completed on every rank and every check named ``prefix*`` passed (exactly
    ``per_rank`` of them on each rank, when given); skipped where a rank recorded ``skip_key``."""
    done = {r: rep.get(f"{section}/completed", "missing") for r, rep in enumerate(reports)}
    errors = {r: v for r, v in done.items() if v is not True}
    assert not errors, f"section {section!r} failed on rank(s) {sorted(errors)}:\n" + "\n".join(
        map(str, errors.values()))
    if skip_key is not None:
        reasons = {rep[skip_key] for rep in reports if skip_key in rep}
        if reasons:
            pytest.skip("; ".join(sorted(reasons)))
    checks = {f"r{r}/{k}": v for r, rep in enumerate(reports) for k, v in rep.items()
              if k.startswith(prefix) and not k.endswith("/completed")}
    failed = {k: v for k, v in checks.items() if v is not True}
    assert not failed, f"{len(failed)} of {len(checks)} checks failed (device {reports[0].get('device')}):\n" + \
        "\n".join(f"{k}: {'False' if v is False else v}" for k, v in sorted(failed.items())[:20])
    if per_rank is not None:
        for r, rep in enumerate(reports):
            mine = [k for k in rep if k.startswith(prefix) and not k.endswith("/completed")]
            assert len(mine) == per_rank, f"rank {r}: {len(mine)} checks named {prefix}*, expected {per_rank}"
    else:
        assert checks, f"no checks named {prefix}*"
    return checks


def _lanes_checks(cases) -> int:
    """Checks of one ``rows`` call per case: the lanes, plus the masked-off ones when ragged."""
    return sum(1 + (n < block) for block, n in cases)


def test_setup(reports):
    _assert_checks(reports, "setup", "setup/", per_rank=6)


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=_name)
@pytest.mark.parametrize("kind", ["load", "store", "get", "put"])
def test_load_store_get_put(reports, kind, dtype):
    _assert_checks(reports, "moves", f"{kind}/{_name(dtype)}/", per_rank=_lanes_checks(CASES))


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=_name)
def test_get_upstream_accumulating_kernel(reports, dtype):
    _assert_checks(reports, "moves", f"get_accumulate/{_name(dtype)}/", per_rank=_lanes_checks(CASES),
                   skip_key=f"skipped/get_accumulate/{_name(dtype)}")


def test_the_ranks_data_differ(reports):
    _assert_checks(reports, "moves", "data_differs/", per_rank=len(MOVE_DTYPES) * len(CASES))


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=_name)
def test_copy_get_put_local(reports, dtype):
    _assert_checks(reports, "copy", f"copy/{_name(dtype)}/", per_rank=3 * _lanes_checks(CASES))


@pytest.mark.parametrize(("op", "dtype"), ATOMIC_PARAMS, ids=[f"{op}-{_name(dt)}" for op, dt in ATOMIC_PARAMS])
def test_atomic(reports, op, dtype):
    per_rank = _lanes_checks(ATOMIC_CASES) if op in BLOCK_ATOMICS else 2 * (3 if op == "cas" else 1)
    _assert_checks(reports, "atomics", f"atomic/{op}/{_name(dtype)}/", per_rank=per_rank,
                   skip_key=f"skipped/atomic/{op}/{_name(dtype)}")


@pytest.mark.parametrize("dtype", ATOMIC_DTYPES["add"], ids=_name)
def test_atomic_add_upstream_constant_ones(reports, dtype):
    _assert_checks(reports, "atomics", f"atomic_ones/add/{_name(dtype)}/", per_rank=4,
                   skip_key=f"skipped/atomic_ones/add/{_name(dtype)}")


def test_atomics_cover_every_sem_and_scope(reports):
    checks = _assert_checks(reports, "atomics", "atomic")
    combos = {tuple(k.split("/")[-3:-1]) for k in checks if k.split("/")[-3] in SEMS}
    assert combos == set(COMBOS), sorted(combos)


@pytest.mark.parametrize("dtype", HINT_DTYPES, ids=_name)
def test_hint_int_and_tuple_give_identical_results(reports, dtype):
    one_d = sum(2 * 6 * (1 + (n < block)) + 1 for block, n in HINT_CASES)  # 6 results, twice; identical
    two_d = sum(2 * 3 * (1 + (m < bm or nn < bn)) + 1 for bm, bn, m, nn in HINT_2D)  # 3 results, twice; identical
    per_rank = one_d + two_d
    _assert_checks(reports, "hints", f"hint/{_name(dtype)}/", per_rank=per_rank)


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=_name)
def test_device_context_load_get_store_put_copy(reports, dtype):
    _assert_checks(reports, "device_context", f"dctx/{_name(dtype)}/", per_rank=6 * _lanes_checks(CASES))


@pytest.mark.parametrize("dtype", [*DCTX_ATOMIC_DTYPES, torch.bfloat16], ids=_name)
def test_device_context_atomic_add(reports, dtype):
    per_rank = _lanes_checks(DCTX_ATOMIC_CASES)
    _assert_checks(reports, "device_context", f"dctx_atomic_add/{_name(dtype)}/", per_rank=per_rank,
                   skip_key=f"skipped/dctx_atomic_add/{_name(dtype)}")


def test_device_context_atomic_cas_partner(reports):
    _assert_checks(reports, "device_context", "dctx_atomic_cas/", per_rank=3)


def test_device_context_layout_and_hand_decoding(reports):
    _assert_checks(reports, "layout", "layout/", per_rank=9 + 2 * 3)


def test_tracing_off_records_nothing(reports):
    _assert_checks(reports, "tracing", "tracing/", per_rank=4)


def test_tracing_off_with_upstream_trace_event_ids(reports):
    # Upstream's spelling, ``event_id=TraceEvent().put``, inside the kernel.
    _assert_checks(reports, "trace_event", "trace_event/", per_rank=4)


def test_trace_event_ids_are_upstreams():
    assert (TraceEvent().put, TraceEvent().load, TraceEvent().atomic_cas, TraceEvent().barrier) == (3, 0, 7, 3073)


def test_trace_event_is_importable_from_iris():
    # Upstream's test_device_context: ``from iris import DeviceContext, TraceEvent``.
    from iris_triton.device.tracing import TraceEvent as backend_trace_event

    assert DeviceContext is iris.DeviceContext
    assert getattr(iris, "TraceEvent", None) is backend_trace_event, "iris does not export TraceEvent"


# -- Gluon: the device context compiled for sm_90, as upstream's Gluon tests write kernels ----------------


try:  # upstream's Gluon tests: ``import iris.experimental.iris_gluon as iris_gl``
    import iris.experimental.iris_gluon as iris_gl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except Exception as error:  # noqa: BLE001 - the Gluon tests skip, saying why
    iris_gl = None
    GLUON_MISSING = f"the Gluon backend is not available: {type(error).__name__}: {error}"

if iris_gl is not None:

    @gluon.jit
    def _gluon_upstream_style_kernel(context_tensor, data, results, flag, n, BLOCK_SIZE: gl.constexpr,
                                     THREADS_PER_WARP: gl.constexpr):
        # Upstream writes gl.BlockedLayout([1], [64], [1], [0]): AMD's 64-lane wavefronts. An sm_90
        # warp has 32 threads, which the layout must match; the rest is upstream's.
        ctx = iris_gl.IrisDeviceCtx.initialize(context_tensor)
        layout: gl.constexpr = gl.BlockedLayout([1], [THREADS_PER_WARP], [1], [0])
        pid = gl.program_id(0)
        offsets = pid * BLOCK_SIZE + gl.arange(0, BLOCK_SIZE, layout=layout)
        mask = offsets < n
        partner = (ctx.cur_rank + 1) % ctx.num_ranks
        value = ctx.load(data + offsets, partner, mask=mask)
        ctx.store(results + offsets, value, partner, mask=mask)
        ctx.get(data + offsets, results + offsets, partner, mask=mask)
        ctx.put(data + offsets, results + offsets, partner, mask=mask)
        ctx.copy(data + offsets, results + offsets, partner, ctx.cur_rank, mask=mask)
        ctx.atomic_cas(flag, 0, 1, partner, sem="release", scope="sys")

    @gluon.jit
    def _gluon_cta_scope_control(context_tensor, flag):
        ctx = iris_gl.IrisDeviceCtx.initialize(context_tensor)
        ctx.atomic_cas(flag, 0, 1, (ctx.cur_rank + 1) % ctx.num_ranks, sem="acquire", scope="cta")

    @gluon.jit
    def _gluon_local_control(data, results, n, BLOCK_SIZE: gl.constexpr, THREADS_PER_WARP: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1], [THREADS_PER_WARP], [1], [0])
        offsets = gl.program_id(0) * BLOCK_SIZE + gl.arange(0, BLOCK_SIZE, layout=layout)
        mask = offsets < n
        gl.store(results + offsets, gl.load(data + offsets, mask=mask), mask=mask)


def _memory_instructions(ptx: str) -> list[str]:
    """Sorted unique loads, stores and atomics of ``ptx``: each line's first token, its predicate
    removed (``atom.global.release.sys.cas.b32``)."""
    ops = set()
    for line in ptx.splitlines():
        line = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        token = line.split(None, 1)[0] if line else ""
        if re.match(r"^(ld|st|atom|red)\.", token):
            ops.add(token)
    return sorted(ops)


#: The Triton kernels above that CPU ranks only interpret, compiled for sm_90 too: what the
#: interpreter does not check (how a kernel's globals and constexprs compile).
_TRITON_SIGNATURES = {
    "tracing_trace_event": ("_tracing_off_kernel", {
        "context_tensor": "*i64", "dummy_buffer": "*i64", "handles": "*i32", "data": "*fp32", "put_dst": "*fp32",
        "cur_rank": "constexpr", "num_ranks": "constexpr", "TRACING": "constexpr", "BLOCK_SIZE": "constexpr"},
        {"cur_rank": 0, "num_ranks": 2, "TRACING": False, "BLOCK_SIZE": 4}),
    "tracing_literal_ids": ("_tracing_off_literal_ids_kernel", {
        "context_tensor": "*i64", "dummy_buffer": "*i64", "handles": "*i32", "data": "*fp32", "put_dst": "*fp32",
        "cur_rank": "constexpr", "num_ranks": "constexpr", "TRACING": "constexpr", "BLOCK_SIZE": "constexpr"},
        {"cur_rank": 0, "num_ranks": 2, "TRACING": False, "BLOCK_SIZE": 4}),
    "hint_2d_tuple": ("_hint_2d_kernel", {
        "data": "*fp32", "loaded": "*fp32", "stored": "*fp32", "got": "*fp32", "M": "i32", "N": "i32",
        "HINTED": "constexpr", "cur_rank": "constexpr", "num_ranks": "constexpr", "BLOCK_SIZE_M": "constexpr",
        "BLOCK_SIZE_N": "constexpr", "heap_bases": "*i64"},
        {"HINTED": True, "cur_rank": 0, "num_ranks": 2, "BLOCK_SIZE_M": 4, "BLOCK_SIZE_N": 8}),
    "dctx_atomic_cas": ("_dctx_atomic_cas_kernel", {
        "context_tensor": "*i64", "flag": "*i32", "old_out": "*i32", "whose": "*i32", "cur_rank": "constexpr",
        "num_ranks": "constexpr"}, {"cur_rank": 1, "num_ranks": 3}),
}


def _compile_sm90() -> dict:
    """Compile the Gluon kernels above and the Triton kernels of _TRITON_SIGNATURES for sm_90 (no
    GPU needed): ``{"ops": {name: [memory instructions]}, "errors": {name: traceback}}``, Triton's
    names prefixed ``triton:``. Runs in a process without TRITON_INTERPRET: this module run as a
    script."""
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    out: dict = {"ops": {}, "errors": {}}

    def compile_one(name, source_class, fn, signature, constexprs, options):
        try:
            const = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
            source = source_class(fn=fn, signature=signature, constexprs=const, attrs={})
            out["ops"][name] = _memory_instructions(triton.compile(source, target=target, options=options).asm["ptx"])
        except Exception:  # noqa: BLE001 - reported to the test
            out["errors"][name] = traceback.format_exc()[-4000:]

    for name, (fn_name, signature, constexprs) in _TRITON_SIGNATURES.items():
        compile_one(f"triton:{name}", triton.compiler.ASTSource, globals()[fn_name], signature, constexprs, {})
    if iris_gl is not None:
        from triton.experimental.gluon._runtime import GluonASTSource

        one_d = {"BLOCK_SIZE": "constexpr", "THREADS_PER_WARP": "constexpr"}
        gluon_kernels = {
            "upstream_style": (_gluon_upstream_style_kernel,
                               {"context_tensor": "*i64", "data": "*fp32", "results": "*fp32", "flag": "*i32",
                                "n": "i32", **one_d}, {"BLOCK_SIZE": 256, "THREADS_PER_WARP": 32}),
            "cta_scope_control": (_gluon_cta_scope_control, {"context_tensor": "*i64", "flag": "*i32"}, {}),
            "local_control": (_gluon_local_control, {"data": "*fp32", "results": "*fp32", "n": "i32", **one_d},
                              {"BLOCK_SIZE": 256, "THREADS_PER_WARP": 32}),
        }
        for name, (fn, signature, constexprs) in gluon_kernels.items():
            # One warp, as the layouts' warpsPerCTA=[1] says.
            compile_one(name, GluonASTSource, fn, signature, constexprs, {"num_warps": 1})
    return out


@pytest.fixture(scope="module")
def sm90_ptx() -> dict:
    return run_without_interpreter(__file__, timeout=600, cwd=Path(__file__).parent)


@pytest.fixture
def gluon_ptx(sm90_ptx) -> dict:
    if iris_gl is None:
        pytest.skip(GLUON_MISSING)
    return sm90_ptx


def _ops(gluon_ptx: dict, name: str) -> list[str]:
    assert name not in gluon_ptx["errors"], f"{name} did not compile:\n{gluon_ptx['errors'][name]}"
    return gluon_ptx["ops"][name]


def test_gluon_device_context_compiles_to_remote_accesses(gluon_ptx):
    ops = _ops(gluon_ptx, "upstream_style")
    atomics = [op for op in ops if op.startswith("atom.")]
    # The cas with sem="release", scope="sys": one atom carrying both, at system scope.
    assert any({"cas", "sys", "release"} <= set(op.split(".")) for op in atomics), ops
    assert all("sys" in op.split(".") for op in atomics), ops
    # The data moves as global loads and stores, and the heap bases (int64) are read from the context.
    assert any(op.startswith("ld.global") and op != "ld.global.b64" for op in ops), ops
    assert any(op.startswith("st.global") for op in ops), ops
    assert "ld.global.b64" in ops, ops


def test_gluon_control_kernels_show_what_the_checks_tell_apart(gluon_ptx):
    # A cas at another scope and ordering compiles to another atom: the checks above see the arguments.
    atomics = [op for op in _ops(gluon_ptx, "cta_scope_control") if op.startswith("atom.")]
    assert atomics and all({"cas", "cta", "acquire"} <= set(op.split(".")) for op in atomics), atomics
    # A local copy reads no heap bases: the 64-bit loads above are the translation's.
    assert "ld.global.b64" not in _ops(gluon_ptx, "local_control")


@pytest.mark.parametrize("name", list(_TRITON_SIGNATURES))
def test_triton_kernels_compile_for_sm90(sm90_ptx, name):
    # CPU ranks interpret these kernels; compiled, ``TraceEvent().put`` (upstream's spelling), a
    # tuple hint and upstream's ``int(...)`` partner must compile too.
    _ops(sm90_ptx, f"triton:{name}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("TRITON_INTERPRET is set: kernels are interpreted and cannot be compiled; unset it")
    json.dump(_compile_sm90(), sys.stdout)
