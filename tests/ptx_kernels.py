"""Kernels that tests/test_ptx.py compiles for sm_90 and inspects; run as a script, not imported by pytest.

Run without ``TRITON_INTERPRET`` (``triton.jit`` returns interpreted functions when it is set at
decoration time, and those cannot be compiled)::

    python tests/ptx_kernels.py

prints one JSON object: ``{"ops": {name: [unique memory instructions]}, "markers": {name: [special
registers read, and "trap"]}, "errors": {name: text}}``.
An instruction is the first token of a PTX line with its predicate removed, e.g.
``ld.global.v4.b32`` or ``atom.global.sys.acq_rel.add.f32``; only loads, stores, atomics,
reductions and fences are listed. One process compiles everything, so the tests pay Triton's
start-up once.
"""

from __future__ import annotations

import json
import re
import sys
import traceback

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

import iris
import iris_gluon
from iris_gluon.frontend import GLUON
from iris_triton.collectives import kernels as ccl
from iris_triton.collectives import low_latency
from iris_triton.collectives import sentinel
from iris_triton.protocol.barrier import device_barrier_kernel
from iris_triton.device.frontend import TRITON
from iris_triton.operations.fused import all_gather_matmul_kernel, matmul_reduce_scatter_kernel, push_rows_kernel
from iris_triton.operations.gemm import PLAIN_LOOP
from iris_triton.tuning import GEMM_SHAPES, LOW_LATENCY_SHAPES, SENTINEL_SHAPES, collective_shape
from tile_kernels import COLLECTIVES as TILE_COLLECTIVES
from tile_kernels import tile_collective, unsynchronised_all_gather

TARGET = GPUTarget("cuda", 90, 32)
SEMS = ("relaxed", "acquire", "release", "acq_rel")
SCOPES = ("cta", "gpu", "sys")
#: Element types ``load_store`` is compiled for. With BLOCK=2048 and 4 warps every thread owns at least
#: 16 contiguous bytes, so a local access of any of them moves 16-byte vectors.
VECTOR_TYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "i8": "*i8", "fp8": "*fp8e4nv", "i64": "*i64"}
VECTOR_BLOCK = 2048


# -- loads and stores ----------------------------------------------------------------------------------


@triton.jit
def load_store(buf, out, heap_bases, n, peer, RANK: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    x = iris.load(buf + offs, RANK, peer, heap_bases, mask=mask)
    iris.store(out + offs, x, RANK, peer, heap_bases, mask=mask)


# The ``*_ctx`` kernels are sources compiled by both front ends (``CTX`` is the context class).


def load_store_ctx(context, buf, out, n, peer, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                   MASKED: tl.constexpr, BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(buf, tl.program_id(0) * BLOCK, BLOCK)
    if MASKED:
        mask = offs < n
    else:
        mask = None
    x = dctx.load(buf + offs, peer, mask=mask)
    dctx.store(out + offs, x, peer, mask=mask)


@triton.jit
def get_put_copy(a, b, heap_bases, n, peer, RANK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    iris.get(a + offs, b + offs, RANK, peer, heap_bases, mask=mask)
    iris.put(b + offs, a + offs, RANK, peer, heap_bases, mask=mask)
    iris.copy(a + offs, b + offs, peer, RANK, RANK, heap_bases, mask=mask)


def get_put_copy_ctx(context, a, b, n, peer, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                     BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(a, tl.program_id(0) * BLOCK, BLOCK)
    mask = offs < n
    dctx.get(a + offs, b + offs, peer, mask=mask)
    dctx.put(b + offs, a + offs, peer, mask=mask)
    dctx.copy(a + offs, b + offs, peer, RANK, mask=mask)


@triton.jit
def local_load_store(buf, out, BLOCK: tl.constexpr):
    """Control: the same block accessed locally, without iris."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + offs, tl.load(buf + offs))


@triton.jit
def control_unhinted_translate(buf, out, heap_bases, peer, RANK: tl.constexpr, BLOCK: tl.constexpr):
    """Negative control: the same translation without ``tl.multiple_of`` loses the vector width,
    which shows that the vector checks can fail."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    distance = (tl.load(heap_bases + peer) - tl.load(heap_bases + RANK)) // 4
    x = tl.load(buf + offs + distance)
    tl.store(out + offs + distance, x)


# -- atomics -------------------------------------------------------------------------------------------


@triton.jit
def atomics(f32, i32, i64, heap_bases, peer, RANK: tl.constexpr, SEM: tl.constexpr, SCOPE: tl.constexpr,
            BLOCK: tl.constexpr):
    """Every atomic of the free-function API once, all with the same ``SEM`` and ``SCOPE``."""
    offs = tl.arange(0, BLOCK)
    one = tl.full([BLOCK], 1, tl.int32)
    big = tl.full([BLOCK], 1, tl.int64)
    f = iris.atomic_add(f32 + offs, 1.0, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    f += iris.atomic_sub(f32 + offs, 1.0, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    f += iris.atomic_min(f32 + offs, 1.0, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    f += iris.atomic_max(f32 + offs, 1.0, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i = iris.atomic_add(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_sub(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_xchg(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_and(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_or(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_xor(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_min(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_max(i32 + offs, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    i += iris.atomic_cas(i32 + offs, one * 0, one, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    j = iris.atomic_xchg(i64 + offs, big, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    j += iris.atomic_and(i64 + offs, big, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    j += iris.atomic_or(i64 + offs, big, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    j += iris.atomic_xor(i64 + offs, big, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    j += iris.atomic_cas(i64 + offs, big * 0, big, RANK, peer, heap_bases, sem=SEM, scope=SCOPE)
    tl.store(f32 + offs, f)
    tl.store(i32 + offs, i)
    tl.store(i64 + offs, j)


@triton.jit
def atomics_default(f32, i32, i64, heap_bases, peer, RANK: tl.constexpr, BLOCK: tl.constexpr):
    """The same atomics without ``sem``/``scope``: the defaults must be acq_rel at system scope."""
    offs = tl.arange(0, BLOCK)
    one = tl.full([BLOCK], 1, tl.int32)
    big = tl.full([BLOCK], 1, tl.int64)
    f = iris.atomic_add(f32 + offs, 1.0, RANK, peer, heap_bases)
    f += iris.atomic_sub(f32 + offs, 1.0, RANK, peer, heap_bases)
    f += iris.atomic_min(f32 + offs, 1.0, RANK, peer, heap_bases)
    f += iris.atomic_max(f32 + offs, 1.0, RANK, peer, heap_bases)
    i = iris.atomic_add(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_sub(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_xchg(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_and(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_or(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_xor(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_min(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_max(i32 + offs, one, RANK, peer, heap_bases)
    i += iris.atomic_cas(i32 + offs, one * 0, one, RANK, peer, heap_bases)
    j = iris.atomic_xchg(i64 + offs, big, RANK, peer, heap_bases)
    j += iris.atomic_and(i64 + offs, big, RANK, peer, heap_bases)
    j += iris.atomic_or(i64 + offs, big, RANK, peer, heap_bases)
    j += iris.atomic_xor(i64 + offs, big, RANK, peer, heap_bases)
    j += iris.atomic_cas(i64 + offs, big * 0, big, RANK, peer, heap_bases)
    tl.store(f32 + offs, f)
    tl.store(i32 + offs, i)
    tl.store(i64 + offs, j)


@triton.jit
def atomics_explicit_none(f32, i32, heap_bases, peer, RANK: tl.constexpr, BLOCK: tl.constexpr):
    """``sem=None, scope=None`` spelled out, as docs/device-api.md's signatures (and upstream iris kernels
    that forward their own arguments) write them: it must mean the defaults too."""
    offs = tl.arange(0, BLOCK)
    one = tl.full([BLOCK], 1, tl.int32)
    f = iris.atomic_add(f32 + offs, 1.0, RANK, peer, heap_bases, mask=None, sem=None, scope=None)
    i = iris.atomic_xchg(i32 + offs, one, RANK, peer, heap_bases, mask=None, sem=None, scope=None)
    i += iris.atomic_cas(i32 + offs, one * 0, one, RANK, peer, heap_bases, sem=None, scope=None)
    tl.store(f32 + offs, f)
    tl.store(i32 + offs, i)


def atomics_ctx(context, f32, i32, i64, peer, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                SEM: tl.constexpr, SCOPE: tl.constexpr, BLOCK: tl.constexpr):
    """Every atomic of the device context once, all with the same ``SEM`` and ``SCOPE``."""
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(i32, 0, BLOCK)
    one = (offs * 0 + 1).to(tl.int32)
    big = one.to(tl.int64)
    f = dctx.atomic_add(f32 + offs, 1.0, peer, sem=SEM, scope=SCOPE)
    f += dctx.atomic_sub(f32 + offs, 1.0, peer, sem=SEM, scope=SCOPE)
    f += dctx.atomic_min(f32 + offs, 1.0, peer, sem=SEM, scope=SCOPE)
    f += dctx.atomic_max(f32 + offs, 1.0, peer, sem=SEM, scope=SCOPE)
    i = dctx.atomic_add(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_sub(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_xchg(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_and(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_or(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_xor(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_min(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_max(i32 + offs, one, peer, sem=SEM, scope=SCOPE)
    i += dctx.atomic_cas(i32 + offs, one * 0, one, peer, sem=SEM, scope=SCOPE)
    j = dctx.atomic_xchg(i64 + offs, big, peer, sem=SEM, scope=SCOPE)
    j += dctx.atomic_and(i64 + offs, big, peer, sem=SEM, scope=SCOPE)
    j += dctx.atomic_or(i64 + offs, big, peer, sem=SEM, scope=SCOPE)
    j += dctx.atomic_xor(i64 + offs, big, peer, sem=SEM, scope=SCOPE)
    j += dctx.atomic_cas(i64 + offs, big * 0, big, peer, sem=SEM, scope=SCOPE)
    tl.store(f32 + offs, f)
    tl.store(i32 + offs, i)
    tl.store(i64 + offs, j)


def atomics_ctx_default(context, f32, i32, i64, peer, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                        BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, WORLD)
    offs = dctx.block_offsets(i32, 0, BLOCK)
    one = (offs * 0 + 1).to(tl.int32)
    big = one.to(tl.int64)
    f = dctx.atomic_add(f32 + offs, 1.0, peer)
    f += dctx.atomic_sub(f32 + offs, 1.0, peer)
    f += dctx.atomic_min(f32 + offs, 1.0, peer)
    f += dctx.atomic_max(f32 + offs, 1.0, peer)
    i = dctx.atomic_add(i32 + offs, one, peer)
    i += dctx.atomic_sub(i32 + offs, one, peer)
    i += dctx.atomic_xchg(i32 + offs, one, peer)
    i += dctx.atomic_and(i32 + offs, one, peer)
    i += dctx.atomic_or(i32 + offs, one, peer)
    i += dctx.atomic_xor(i32 + offs, one, peer)
    i += dctx.atomic_min(i32 + offs, one, peer)
    i += dctx.atomic_max(i32 + offs, one, peer)
    i += dctx.atomic_cas(i32 + offs, one * 0, one, peer)
    j = dctx.atomic_xchg(i64 + offs, big, peer)
    j += dctx.atomic_and(i64 + offs, big, peer)
    j += dctx.atomic_or(i64 + offs, big, peer)
    j += dctx.atomic_xor(i64 + offs, big, peer)
    j += dctx.atomic_cas(i64 + offs, big * 0, big, peer)
    tl.store(f32 + offs, f)
    tl.store(i32 + offs, i)
    tl.store(i64 + offs, j)


# -- flags ---------------------------------------------------------------------------------------------


@triton.jit
def signal_default(flag, out, heap_bases, peer, RANK: tl.constexpr):
    tl.store(out, iris.signal(flag, 7, RANK, peer, heap_bases))


@triton.jit
def signal_sem_scope(flag, out, heap_bases, peer, RANK: tl.constexpr, SEM: tl.constexpr, SCOPE: tl.constexpr):
    tl.store(out, iris.signal(flag, 7, RANK, peer, heap_bases, sem=SEM, scope=SCOPE))


@triton.jit
def wait_default(flag, out, heap_bases, peer, timeout_ns, RANK: tl.constexpr):
    tl.store(out, iris.wait_until(flag, 7, RANK, peer, heap_bases, timeout_ns).to(tl.int32))


@triton.jit
def wait_cmp(flag, out, heap_bases, peer, timeout_ns, RANK: tl.constexpr, CMP: tl.constexpr):
    tl.store(out, iris.wait_until(flag, 7, RANK, peer, heap_bases, timeout_ns, CMP=CMP).to(tl.int32))


@triton.jit
def wait_sem_scope(flag, out, heap_bases, peer, timeout_ns, RANK: tl.constexpr, SEM: tl.constexpr,
                   SCOPE: tl.constexpr):
    ok = iris.wait_until(flag, 7, RANK, peer, heap_bases, timeout_ns, sem=SEM, scope=SCOPE)
    tl.store(out, ok.to(tl.int32))


def signal_wait_ctx(context, flag, out, peer, timeout_ns, CTX: tl.constexpr, RANK: tl.constexpr,
                    WORLD: tl.constexpr):
    dctx = CTX.initialize(context, RANK, WORLD)
    old = dctx.signal(flag, 7, peer)
    ok = dctx.wait_until(flag + 1, 7, RANK, timeout_ns, CMP="eq")
    tl.store(out, old + ok.to(tl.int32))


# -- what to compile -----------------------------------------------------------------------------------

_PTR_TYPES = {"f32": "*fp32", "i32": "*i32", "i64": "*i64", "heap_bases": "*i64", "context": "*i64",
              "flag": "*i32", "out": "*i32", "state_ptr": "*i32", "headers": "*i32"}
_INT_ARGS = {"n", "m", "words", "stride", "slot_stride", "peer", "rank", "world_size", "programs", "out_numel",
             "capacity", "K", "N", "stride_sm", "stride_am", "stride_bk", "stride_om", "flag_stride", "signature"}
#: 64-bit integer arguments: a context's timeout in nanoseconds passes 2**31 from about 2.1 s on
#: (the default, 300 s, is 3e11), and Triton's launcher then specializes it as i64.
_INT64_ARGS = {"timeout_ns"}


def _spec(fn, constexprs=None, types=None, divisible=("buf", "out", "a", "b", "f32", "i32", "i64")):
    """``(fn, signature, constexprs, attrs)`` for ``triton.compile``, by argument name. Pointer
    arguments named in ``divisible`` (and ``n``) are declared 16-byte aligned (multiples of 16), as
    Triton's launcher specializes them for aligned tensors and sizes."""
    constexprs = constexprs or {}
    types = types or {}
    names = fn.arg_names
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name in _INT_ARGS:
            signature[name] = "i32"
        elif name in _INT64_ARGS:
            signature[name] = "i64"
        else:
            signature[name] = _PTR_TYPES[name]
    attrs = {(names.index(name),): [["tt.divisibility", 16]]
             for name in names if name in divisible or name == "n"}
    const = {(names.index(name),): value for name, value in constexprs.items()}
    return fn, signature, const, attrs


def _ctx_specs(frontend) -> dict:
    """The ``*_ctx`` sources compiled by ``frontend``, keyed as the Triton names; Gluon's keys get
    a ``gluon:`` prefix."""
    prefix = "" if frontend.name == "triton" else f"{frontend.name}:"
    ctx = frontend.device_context
    out = {}
    for short, ptr in VECTOR_TYPES.items():
        for masked in (False, True):
            tag = f"{short}{'_masked' if masked else ''}"
            out[f"load_store_ctx_{tag}"] = _spec(frontend.kernel(load_store_ctx),
                                                 dict(CTX=ctx, RANK=1, WORLD=2, MASKED=masked, BLOCK=VECTOR_BLOCK),
                                                 {"buf": ptr, "out": ptr})
    out["get_put_copy_ctx_fp32"] = _spec(frontend.kernel(get_put_copy_ctx), dict(CTX=ctx, RANK=0, WORLD=2, BLOCK=1024),
                                         {"a": "*fp32", "b": "*fp32"})
    for sem in SEMS:
        for scope in SCOPES:
            out[f"atomics_ctx_{sem}_{scope}"] = _spec(frontend.kernel(atomics_ctx),
                                                      dict(CTX=ctx, RANK=0, WORLD=2, SEM=sem, SCOPE=scope, BLOCK=128))
    out["atomics_ctx_default"] = _spec(frontend.kernel(atomics_ctx_default), dict(CTX=ctx, RANK=0, WORLD=2, BLOCK=128))
    out["signal_wait_ctx"] = _spec(frontend.kernel(signal_wait_ctx), dict(CTX=ctx, RANK=1, WORLD=2))
    return {prefix + name: spec for name, spec in out.items()}


#: The collectives' (push, middle, consume) steps, as the algorithms of iris_triton.collectives.kernels pass them.
CCL_STEPS = {
    "all_gather": (ccl._push_own_and_keep, None, ccl._collect),
    "all_to_all": (ccl._push_segments_and_keep, None, ccl._collect),
    "reduce_scatter": (ccl._push_segments, None, ccl._reduce_own_segment),
    "all_reduce_one_shot": (ccl._push_own, None, ccl._reduce_whole),
    "all_reduce_two_shot": (ccl._push_segments, ccl._reduce_and_share_segment, ccl._collect_shared),
    "broadcast": (ccl._push_from_source, None, ccl._take_from_source),
    "reduce": (ccl._push_own_to_root, None, ccl._reduce_at_root),
    "gather": (ccl._push_own_to_root_and_keep, None, ccl._collect_at_root),
    "scatter": (ccl._push_segments_from_root, None, ccl._take_from_source),
}
#: The rooted collectives compile differently on their root: ``<name>_root`` is rank 0 as the
#: root (the others are rank 0 with root 1), with this reduction (reduce's average divides).
CCL_ROOTS = {"reduce": "avg", "gather": "sum", "scatter": "sum"}


def _ccl_specs(frontend) -> dict:
    """The collective kernel with each collective's steps, bf16, as the GPU configuration
    launches it; Gluon's keys get a ``gluon:`` prefix."""
    prefix = "" if frontend.name == "triton" else f"{frontend.name}:"
    types = {name: "*bf16" for name in ("inp", "out", "ws")}
    types.update(sync="*i32")
    out = {}
    shape = {k: v for k, v in collective_shape("cuda", 1 << 20).items() if k != "num_warps"}
    divisible = ("context", "inp", "out", "ws", "sync", "m", "stride")
    for name, (push, middle, consume) in CCL_STEPS.items():
        roots = {"": ("sum", 1), "_root": (CCL_ROOTS[name], 0)} if name in CCL_ROOTS else {"": ("sum", 1)}
        for suffix, (op, src) in roots.items():
            constexprs = dict(CTX=frontend.device_context, TRACING=False, RANK=0, WORLD=2, PUSH=push, MIDDLE=middle,
                              CONSUME=consume, OP=op, SRC=src, SITE=2, **shape)
            out[f"{prefix}ccl_{name}{suffix}"] = _spec(frontend.kernel(ccl.collective_kernel), constexprs, types,
                                                       divisible)
    push, middle, consume = CCL_STEPS["all_reduce_one_shot"]
    for op in ("max", "min"):  # compared with NaN propagation, as torch's max and min are
        constexprs = dict(CTX=frontend.device_context, TRACING=False, RANK=0, WORLD=2, PUSH=push, MIDDLE=middle,
                          CONSUME=consume, OP=op, SRC=1, SITE=2, **shape)
        out[f"{prefix}ccl_all_reduce_{op}"] = _spec(frontend.kernel(ccl.collective_kernel), constexprs, types,
                                                    divisible)
    return out


def _announcing_all_reduce_specs(frontend) -> dict:
    """The all_reduce kernels whose data announces itself (low-latency: 1-, 2-, 4- and 8-byte
    elements in flagged 64-bit words; sentinel: 2- and 4-byte floats), with their GPU launch
    shapes; Gluon's keys get a ``gluon:`` prefix."""
    prefix = "" if frontend.name == "triton" else f"{frontend.name}:"
    kernels = {  # the low-latency kernel takes the element size; the sentinel kernel reads it off its pointers
        "low_latency": (low_latency.low_latency_kernel, LOW_LATENCY_SHAPES, "words",
                        (("i8", {"SIZE": 1}, "*i64"), ("bf16", {"SIZE": 2}, "*i64"), ("fp32", {"SIZE": 4}, "*i64"),
                         ("i64", {"SIZE": 8}, "*i64"))),
        "sentinel": (sentinel.sentinel_kernel, SENTINEL_SHAPES, "n", (("bf16", {}, "*i16"), ("fp32", {}, "*i32"))),
    }
    out = {}
    for name, (kernel, shapes, count, cases) in kernels.items():
        shape = {k: v for k, v in shapes["cuda"].items() if k not in OPTIONS}
        for dtype, element_size, workspace in cases:
            types = {"inp": f"*{dtype}", "out": f"*{dtype}", "ws": workspace, "sync": "*i32"}
            constexprs = dict(CTX=frontend.device_context, TRACING=False, RANK=0, WORLD=2, OP="sum", **element_size,
                              **shape)
            out[f"{prefix}{name}_{dtype}"] = _spec(
                frontend.kernel(kernel), constexprs, types,
                divisible=("context", "inp", "out", "ws", "sync", count, "capacity"))
    return out


def _fused_specs() -> dict:
    """The fused GEMM + communication kernels, bf16, with the GPU tile shape; unit strides
    (last dimensions) are constants, as Triton's launcher specializes them. Each GEMM by plain
    loads and (``_tma``) by tensor descriptors: ``A`` as its kernel describes it, ``B`` row-major
    for the all-gather product and column-major (a linear layer's weight) for the other."""
    config = {k: v for k, v in GEMM_SHAPES["cuda"].items() if k not in OPTIONS}
    types = {name: "*bf16" for name in ("shard", "gathered", "a", "b", "out", "recv")}
    types.update(flags="*i32", calls="*i32", partials="*fp32", arrived="*i32", parts="i32")
    divisible = ("context", "shard", "gathered", "a", "b", "out", "recv", "flags", "calls", "partials", "arrived", "m",
                 "K", "N", "stride_sm", "stride_am", "stride_bk", "stride_om", "slot_stride")
    unit = {"stride_ak": 1, "stride_bn": 1, "stride_on": 1}
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a_desc = f"tensordesc<bf16[1,1,{bm},{bk}]>"
    gemms = {
        "fused_all_gather_matmul": (all_gather_matmul_kernel, dict(stride_bn=1, stride_on=1),
                                    f"tensordesc<bf16[{bk},{bn}]>", False),
        "fused_matmul_reduce_scatter": (matmul_reduce_scatter_kernel, unit, f"tensordesc<bf16[{bn},{bk}]>", True),
    }
    specs = {"fused_push_rows": _spec(push_rows_kernel, dict(RANK=0, WORLD=2, TRACING=False, BLOCK_M=bm, BLOCK_K=128,
                                                             stride_sk=1), types, divisible)}
    for name, (kernel, strides, b_desc, column_major) in gemms.items():
        common = dict(RANK=0, WORLD=2, TRACING=False, EVEN_K=True, **config, **strides)
        specs[name] = _spec(kernel, dict(common, **PLAIN_LOOP), types, divisible)
        specs[f"{name}_tma"] = _spec(kernel, dict(common, TMA=True, B_COLUMN_MAJOR=column_major),
                                     dict(types, a_desc=a_desc, b_desc=b_desc), divisible)
    return specs


def _tile_collective_specs(frontend) -> dict:
    """The tile collectives (tests/tile_kernels.py), bf16 tiles of 64 x 64 with run-time sizes and
    unit column strides, compiled by ``frontend``; Gluon's keys get a ``gluon:`` prefix. Triton also
    compiles upstream iris's form, a collective without a sync."""
    prefix = "" if frontend.name == "triton" else f"{frontend.name}:"
    types = {"context": "*i64", "src": "*bf16", "dst": "*bf16", "sync": "*i64", "M": "i32", "N": "i32", "DM": "i32",
             "DN": "i32", "stride_sm": "i32", "stride_dm": "i32", "chunk": "i32", "root": "i32"}
    divisible = ("context", "src", "dst", "sync", "N", "DN", "stride_sm", "stride_dm", "chunk")
    unsynchronised = {"tile_unsynchronised_all_gather": _spec(
        frontend.kernel(unsynchronised_all_gather),
        dict(RANK=0, WORLD=2, BLOCK_M=64, BLOCK_N=64, M=256, N=512, stride_sm=512, stride_sn=1, stride_dm=512,
             stride_dn=1), {"src": "*bf16", "dst": "*bf16"}, ("src", "dst", "heap_bases"))} \
        if frontend.name == "triton" else {}
    return unsynchronised | {f"{prefix}tile_{collective}": _spec(
        frontend.kernel(tile_collective), dict(CTX=frontend.device_context, RANK=0, WORLD=2, COLLECTIVE=collective,
                                               TRACING=False, OP="sum", BLOCK_M=64, BLOCK_N=64, stride_sn=1,
                                               stride_dn=1),
        types, divisible) for collective in TILE_COLLECTIVES}


#: Compile options of the kernels that are not launched with Triton's defaults.
OPTIONS = {"num_warps", "num_stages"}


@gluon.jit
def upstream_style_gluon(IrisDeviceCtx: gl.constexpr, context_tensor, buf, out, source_rank: gl.constexpr,
                         num_ranks: gl.constexpr, BLOCK: gl.constexpr, LANES: gl.constexpr):
    """A Gluon kernel as upstream iris's are written: the context class a constexpr argument,
    the context built from the context tensor, a 1-D layout over one warp: ``iris_gluon.warp_layout()``
    (``LANES=0``), or written out with ``LANES`` lanes (upstream's AMD kernels: 64)."""
    ctx = IrisDeviceCtx.initialize(context_tensor)
    if LANES == 0:
        layout: gl.constexpr = iris_gluon.warp_layout()
    else:
        layout: gl.constexpr = gl.BlockedLayout([1], [LANES], [1], [0])
    offsets = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    mask = offsets < BLOCK
    partner = (source_rank + 1) % num_ranks
    data = ctx.load(buf + offsets, partner, mask=mask)
    ctx.store(out + offsets, data, partner, mask=mask)
    ctx.atomic_add(out + offsets, data, partner, mask=mask)
    ctx.get(buf + offsets, out + offsets, partner, mask=mask)
    ctx.put(buf + offsets, out + offsets, partner, mask=mask)


def _upstream_style_gluon_specs() -> dict:
    """:func:`upstream_style_gluon` with the warp's layout and with AMD's 64 lanes (one warp per
    program, as upstream launches them)."""
    types = {"context_tensor": "*i64", "buf": "*fp32", "out": "*fp32"}
    return {f"gluon:upstream_style_{name}": _spec(upstream_style_gluon, dict(
        IrisDeviceCtx=GLUON.device_context, source_rank=0, num_ranks=2, BLOCK=32, LANES=lanes), types)
        for name, lanes in (("warp_layout", 0), ("64_lanes", 64))}


def specs() -> dict:
    out = {**_ctx_specs(TRITON), **_ctx_specs(GLUON), **_ccl_specs(TRITON), **_ccl_specs(GLUON),
           **_announcing_all_reduce_specs(TRITON), **_announcing_all_reduce_specs(GLUON), **_fused_specs(),
           **_tile_collective_specs(TRITON), **_tile_collective_specs(GLUON)}
    for short, ptr in VECTOR_TYPES.items():
        types = {"buf": ptr, "out": ptr}
        for masked in (False, True):
            tag = f"{short}{'_masked' if masked else ''}"
            out[f"load_store_{tag}"] = _spec(load_store, dict(RANK=0, MASKED=masked, BLOCK=VECTOR_BLOCK), types)
    out["get_put_copy_fp32"] = _spec(get_put_copy, dict(RANK=0, BLOCK=1024), {"a": "*fp32", "b": "*fp32"})
    out["get_put_copy_bf16"] = _spec(get_put_copy, dict(RANK=0, BLOCK=1024), {"a": "*bf16", "b": "*bf16"})
    out["control_local_i8"] = _spec(local_load_store, dict(BLOCK=VECTOR_BLOCK), {"buf": "*i8", "out": "*i8"})
    out["control_unhinted_translate"] = _spec(control_unhinted_translate, dict(RANK=0, BLOCK=1024),
                                              {"buf": "*fp32", "out": "*fp32"})
    for sem in SEMS:
        for scope in SCOPES:
            out[f"atomics_{sem}_{scope}"] = _spec(atomics, dict(RANK=0, SEM=sem, SCOPE=scope, BLOCK=128))
    out["atomics_default"] = _spec(atomics_default, dict(RANK=0, BLOCK=128))
    out["atomics_explicit_none"] = _spec(atomics_explicit_none, dict(RANK=0, BLOCK=128))
    out["signal_default"] = _spec(signal_default, dict(RANK=0))
    out["signal_acq_rel_gpu"] = _spec(signal_sem_scope, dict(RANK=0, SEM="acq_rel", SCOPE="gpu"))
    out["signal_relaxed_cta"] = _spec(signal_sem_scope, dict(RANK=0, SEM="relaxed", SCOPE="cta"))
    out["wait_default"] = _spec(wait_default, dict(RANK=0))
    # A timeout below 2**31 ns (about 2.1 s) reaches the kernel as an i32.
    out["wait_default_i32_timeout"] = _spec(wait_default, dict(RANK=0), {"timeout_ns": "i32"})
    for cmp in ("eq", "ne", "gt", "ge", "lt", "le", "bogus"):
        out[f"wait_cmp_{cmp}"] = _spec(wait_cmp, dict(RANK=0, CMP=cmp))
    out["wait_relaxed_gpu"] = _spec(wait_sem_scope, dict(RANK=0, SEM="relaxed", SCOPE="gpu"))
    out["wait_acquire_cta"] = _spec(wait_sem_scope, dict(RANK=0, SEM="acquire", SCOPE="cta"))
    out["device_barrier"] = _spec(device_barrier_kernel, dict(RANK=0, WORLD=2, TRACING=False),
                                  divisible=("context", "state_ptr"))
    out.update(_upstream_style_gluon_specs())
    return out


_MEMORY_OP = re.compile(r"^(ld|st|atom|red|fence|membar|wgmma\.mma_async)\.")


def memory_instructions(ptx: str) -> list[str]:
    """Sorted unique memory instructions (and Hopper tensor-core products, ``wgmma.mma_async``)
    of ``ptx``: first tokens, predicates removed."""
    found = set()
    for line in ptx.splitlines():
        line = re.sub(r"^@!?%p\d+\s+", "", line.strip())
        token = line.split(None, 1)[0] if line else ""
        if _MEMORY_OP.match(token):
            found.add(token)
    return sorted(found)


#: Other PTX a test looks for: the special registers a kernel reads (``%globaltimer``: the clock of
#: a wait bounded in wall-clock time), the ``trap`` instruction, floating-point max/min (with
#: ``.NaN`` where a NaN operand gives NaN) and tensor copies (``cp.async.bulk.tensor``).
_MARKERS = re.compile(r"%globaltimer\w*|%clock\w*|\btrap\b|\bcp\.async\.bulk\.tensor\b"
                      r"|\b(?:max|min)(?:\.ftz)?(?:\.NaN)?\.(?:f16|bf16|f32)(?:x2)?\b")


def markers(ptx: str) -> list[str]:
    """Sorted unique :data:`_MARKERS` of ``ptx``, e.g. ``["%globaltimer", "trap"]``."""
    return sorted(set(_MARKERS.findall(ptx)))


def compile_all() -> dict:
    ops, marks, errors = {}, {}, {}
    for name, (fn, signature, constexprs, attrs) in specs().items():
        try:
            source_class = GluonASTSource if name.startswith("gluon:") else triton.compiler.ASTSource
            source = source_class(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
            fused = name.startswith("fused_")
            options = {k: v for k, v in GEMM_SHAPES["cuda"].items() if k in OPTIONS} if fused else {}
            if name.startswith("gluon:upstream_style"):
                options = {"num_warps": 1}  # as upstream launches its Gluon kernels
            ptx = triton.compile(source, target=TARGET, options=options).asm["ptx"]
            ops[name], marks[name] = memory_instructions(ptx), markers(ptx)
        except Exception:  # reported to the test, which decides whether the failure was expected
            errors[name] = traceback.format_exc()
    return {"ops": ops, "markers": marks, "errors": errors}


if __name__ == "__main__":
    if not isinstance(load_store, triton.runtime.JITFunction):
        sys.exit("TRITON_INTERPRET is set: kernels are interpreted and cannot be compiled; unset it")
    json.dump(compile_all(), sys.stdout, indent=1)
