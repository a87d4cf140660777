"""``ctx.ops.all_reduce_rmsnorm`` (all_reduce + residual add + RMSNorm in one kernel) against torch.

One spawn per world size (2, 3 and 5 CPU ranks; GPUs where there are) runs every check, and each
rank returns ``{check name: True | False | error text}``: both methods and the automatic choice,
bf16 and fp32, with and without ``residual_out`` (and with ``residual_out`` the residual itself,
updated in place), a single-chunk row, a row of two chunks of a hidden size that is not a power
of two, fewer tokens than ranks (two-shot shares left empty), every configuration called twice
with new data (the slots and sequence numbers of consecutive calls), a group of two of three
ranks (``group=``), and last calls that differ between ranks (another method), which must raise
instead of mixing the two. Five ranks run only the named methods in bf16 (:func:`_calls`): their
two-shot shares are uneven. Each rank regenerates every rank's seeded input and compares with
``torch.nn.functional.rms_norm`` of the float32 sum plus the residual.

In-process (the session context, one rank): the argument errors, ``torch.compile`` (the custom
operator, no graph break), the automatic method's threshold, and on GPUs CUDA-graph capture and
replay by the Triton and Gluon backends. A PTX check compiles the kernel for sm_90 (no GPU
needed) under both front ends.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import iris
from iris.errors import IrisError
from iris.testing import (RankReport, assert_rank_checks, reports_on_available_ranks, run_without_interpreter,
                          seeded_generator)

#: (tokens, hidden) on CPU ranks (chunks of 64 elements there): one chunk; two chunks, ragged.
SHAPES = ((1, 40), (7, 96))
DTYPES = (torch.bfloat16, torch.float32)
METHODS = (None, "one_shot", "two_shot")
#: What residual_out is (:func:`_check_call`), taken in turn.
KEEPS = ("none", "new", "in_place")
#: Tolerance of out and residual_out against the float32 reference: a bf16 result is rounded
#: once (half a unit in the last place, 2**-8 relative) from nearly the reference's value.
TOLERANCE = {torch.bfloat16: dict(rtol=2**-7, atol=1e-3), torch.float32: dict(rtol=1e-5, atol=1e-5)}
EPS = 1e-6


def _inputs(world: int, tokens: int, hidden: int, dtype, *seed):
    """Every rank's x, the residual and the weight (the same on every rank), and the float32
    reference ``(out, s)``."""
    xs = [torch.randn(tokens, hidden, generator=seeded_generator("x", q, tokens, hidden, *seed)).to(dtype)
          for q in range(world)]
    residual = torch.randn(tokens, hidden, generator=seeded_generator("residual", tokens, hidden, *seed)).to(dtype)
    weight = (1 + torch.randn(hidden, generator=seeded_generator("weight", hidden, *seed)) / 4).to(dtype)
    s = sum(x.float() for x in xs) + residual.float()
    return xs, residual, weight, (torch.nn.functional.rms_norm(s, (hidden,), weight.float(), EPS), s)


def _close(got: torch.Tensor, expected: torch.Tensor, dtype) -> bool | str:
    if torch.allclose(got.float().cpu(), expected, **TOLERANCE[dtype]):
        return True
    return f"max |difference| {float((got.float().cpu() - expected).abs().max()):.3g}"


def _check_call(ctx, report: RankReport, key: str, tokens: int, hidden: int, dtype, method, keep: str, seed):
    """One call; ``keep``: ``"none"`` (no residual_out), ``"new"`` (a residual_out tensor) or
    ``"in_place"`` (residual_out is the residual)."""
    rank, device = ctx.rank, ctx.device
    xs, residual, weight, (expected, s) = _inputs(ctx.world_size, tokens, hidden, dtype, seed)
    x, residual = xs[rank].to(device), residual.to(device)
    if keep == "new":  # a float32 weight with 16-bit rows, as some models keep their norms
        weight = weight.float()
    out = torch.full((tokens, hidden), 7.0, dtype=dtype, device=device)
    residual_out = {"none": None, "new": torch.full_like(out, 7.0), "in_place": residual}[keep]
    returned = ctx.ops.all_reduce_rmsnorm(out, x, residual, weight.to(device), EPS, residual_out, method=method)
    report[f"{key}/out"] = _close(out, expected, dtype)
    report.check(f"{key}/returns_out", returned is out)
    report.check(f"{key}/x_unchanged", torch.equal(x.cpu(), xs[rank]))
    if residual_out is not None:
        report[f"{key}/residual_out"] = _close(residual_out, s, dtype)


def _mismatch(ctx, report: RankReport) -> None:
    """Rank 0 one-shot, the others two-shot, of one shape: every rank raises, its out NaN. The
    calls before (both methods, this shape in float32 with residual_out) sized the workspace for
    both, so neither grows it: that would be a host barrier only some ranks make."""
    tokens, hidden = SHAPES[1]
    xs, residual, weight, _ = _inputs(ctx.world_size, tokens, hidden, torch.bfloat16, "mismatch")
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=ctx.device)
    try:
        ctx.ops.all_reduce_rmsnorm(out, xs[ctx.rank].to(ctx.device), residual.to(ctx.device),
                                   weight.to(ctx.device), method="one_shot" if ctx.rank == 0 else "two_shot")
        ctx.check()  # on GPUs the kernel's failure surfaces at the next iris call
        report.check("mismatch/raised", False)
    except IrisError as error:
        report.check("mismatch/raised", "made a different call" in str(error))
        report.check("mismatch/out_nan", bool(out.float().isnan().all()))


#: The methods the group of ranks 0 and 2 calls.
GROUP_METHODS = ("one_shot", "two_shot")


def _group(ctx, report: RankReport) -> None:
    """Ranks 0 and 2 of 3 (``group=``): both methods, against their two inputs only; rank 1
    makes no call."""
    group = ctx.new_group([0, 2])
    if ctx.rank == 1:
        return
    tokens, hidden = SHAPES[1]
    xs, residual, weight, _ = _inputs(3, tokens, hidden, torch.float32, "group")
    s = xs[0] + xs[2] + residual
    expected = torch.nn.functional.rms_norm(s, (hidden,), weight, EPS)
    for method in GROUP_METHODS:
        out = torch.empty(tokens, hidden, device=ctx.device)
        ctx.ops.all_reduce_rmsnorm(out, xs[ctx.rank].to(ctx.device), residual.to(ctx.device), weight.to(ctx.device),
                                   method=method, group=group)
        report[f"group/{method}"] = _close(out, expected, torch.float32)


#: What the five-rank world runs of the grid (:func:`_calls`): the named methods in bf16, where
#: two-shot shares are uneven (7 tokens: shares of 2, 2, 2, 1 and 0 rows; 1 token: 1, 0, 0, 0, 0).
WORLD5_GRID = dict(dtypes=(torch.bfloat16,), methods=("one_shot", "two_shot"))


def _calls(world: int) -> list[tuple]:
    """The calls the worker makes on ``world`` ranks, as ``(key, tokens, hidden, dtype, method,
    keep, repeat)``: every shape, dtype and method (five ranks: :data:`WORLD5_GRID`), each twice,
    ``residual_out`` taken in turn."""
    grid = WORLD5_GRID if world == 5 else dict(dtypes=DTYPES, methods=METHODS)
    calls = []
    for i, (tokens, hidden) in enumerate(SHAPES):
        for j, dtype in enumerate(grid["dtypes"]):
            for k, method in enumerate(grid["methods"]):
                keep = KEEPS[(i + j + k) % len(KEEPS)]
                for repeat in range(2):
                    key = f"calls/{tokens}x{hidden}/{str(dtype)[6:]}/{method}/{keep}/{repeat}"
                    calls.append((key, tokens, hidden, dtype, method, keep, repeat))
    return calls


def _worker(rank: int, world: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="16MiB")
    with report.section("calls"):
        for key, tokens, hidden, dtype, method, keep, repeat in _calls(world):
            _check_call(ctx, report, key, tokens, hidden, dtype, method, keep, (method, repeat))
    if world == 3:
        with report.section("group"):
            _group(ctx, report)
    ctx.barrier()
    report.check("no_wait_failed/after_the_calls", not ctx.failed)
    with report.section("mismatch"):
        _mismatch(ctx, report)
    try:
        ctx.destroy()
    except IrisError:  # the mismatch failed the context, as it must
        pass
    return report.packed()


@pytest.fixture(scope="module", params=(2, 3, 5), ids=lambda w: f"world{w}")
def reports(request) -> list[dict]:
    return reports_on_available_ranks(_worker, request.param, request.param, timeout=60)


def _call_names(world: int) -> set[str]:
    """The checks of the calls on ``world`` ranks (:func:`_check_call`) and their section's completion."""
    return {f"{key}/{check}" for key, *_, keep, _ in _calls(world)
            for check in ("out", "returns_out", "x_unchanged") + (("residual_out",) if keep != "none" else ())} | {
        "calls/completed"}


def test_every_method_dtype_and_shape_matches_torch(reports):
    assert_rank_checks(reports, "calls/", _call_names(len(reports)))
    assert_rank_checks(reports, "no_wait_failed/", {"no_wait_failed/after_the_calls"})
    kept = {key.split("/")[4] for key in reports[0] if key.startswith("calls/") and key != "calls/completed"}
    assert kept == set(KEEPS), kept


def test_a_group_of_two_of_three_ranks_reduces_only_its_members(reports):
    if len(reports) != 3:
        pytest.skip("the group check runs on 3 ranks")
    # Rank 1 is not in the group [0, 2].
    assert_rank_checks(reports, "group/", lambda rank: {"group/completed"} | (
        set() if rank == 1 else {f"group/{method}" for method in GROUP_METHODS}))


def test_a_call_that_differs_between_ranks_raises_on_every_rank_with_nan_output(reports):
    assert_rank_checks(reports, "mismatch/", {"mismatch/raised", "mismatch/out_nan", "mismatch/completed"})


# -- one rank, in process ------------------------------------------------------------------------------


def test_bad_arguments_raise_saying_what_is_wrong(ctx):
    device = ctx.device
    x = torch.randn(4, 24, device=device, dtype=torch.bfloat16)
    weight = torch.ones(24, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    rms = ctx.ops.all_reduce_rmsnorm
    cases = {
        "method": (lambda: rms(out, x, x, weight, method="ring"), "is not one of one_shot, two_shot"),
        "residual_shape": (lambda: rms(out, x, x[:2], weight), "residual has shape (2, 24)"),
        "out_shape": (lambda: rms(out[:2], x, x, weight), "out has shape (2, 24)"),
        "out_not_contiguous": (lambda: rms(torch.empty(24, 4, device=device, dtype=x.dtype).t(), x, x, weight),
                               "out is not contiguous; pass a contiguous output"),
        "weight_shape": (lambda: rms(out, x, x, weight[:8]), "weight has shape (8,)"),
        "x_vector": (lambda: rms(out[0], x[0], x[0], weight), "x must be [tokens, hidden]"),
        "int_dtype": (lambda: rms(out, x, x.to(torch.int32), weight), "residual has dtype torch.int32"),
        "mixed_dtypes": (lambda: rms(out, x, x.float(), weight), "use x's dtype"),
        "device": (lambda: rms(out, x, torch.empty(4, 24, device="meta", dtype=x.dtype), weight), "is on meta"),
        "not_contiguous": (lambda: rms(out, x, torch.empty(24, 4, device=device, dtype=x.dtype).t(), weight),
                           "residual is not contiguous"),
        "eps": (lambda: rms(out, x, x, weight, -1.0), "eps must be a number >= 0"),
        "same_outputs": (lambda: rms(out, x, x, weight, residual_out=out), "residual_out and out are the same"),
    }
    for call, message in cases.values():
        with pytest.raises(IrisError, match=re.escape(message)):
            call()
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        rms(out, x, x, [1.0] * 24)
    # After the refusals the context works: one rank, so the sum is x itself.
    residual = torch.randn_like(x)
    rms(out, x, residual, weight)
    s = x.float() + residual.float()
    assert torch.allclose(out.float(), torch.nn.functional.rms_norm(s, (24,), weight.float(), 1e-6),
                          **TOLERANCE[torch.bfloat16])


def test_torch_compile_calls_the_custom_operator_without_a_graph_break(ctx):
    from torch._dynamo.testing import CompileCounterWithBackend

    def layer(x, residual, weight):
        out, residual_out = torch.empty_like(x), torch.empty_like(x)
        ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, EPS, residual_out)
        normed = torch.empty_like(x)
        ctx.ops.all_reduce_rmsnorm(normed, out, residual_out, weight, method="two_shot")
        return out, residual_out, normed

    g = seeded_generator("compile")
    x, residual, weight = (torch.randn(shape, generator=g).to(ctx.device) for shape in ((3, 40), (3, 40), (40,)))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)(x, residual, weight)
    eager = layer(x, residual, weight)
    assert counter.frame_count == 1
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
    s = x.float() + residual.float()
    assert torch.allclose(compiled[0].float(), torch.nn.functional.rms_norm(s, (40,), weight.float(), EPS),
                          **TOLERANCE[torch.float32])


def test_the_automatic_method_follows_the_tuning_threshold():
    from iris_triton.operations.rmsnorm import choose_method
    from iris_triton.tuning import ALL_REDUCE_RMSNORM_ONE_SHOT_UP_TO as limits

    for world in (2, 3, 8):
        limit = limits.get(world, limits[None])
        assert choose_method(world, limit) == "one_shot"
        assert choose_method(world, limit + 1) == "two_shot"


#: The methods captured in a CUDA graph, and the replays of each.
GRAPH_METHODS = ("one_shot", "two_shot")
GRAPH_REPLAYS = 3


def _graph_worker(rank: int, backend: str) -> bytes:
    """World size 1 on a GPU: both methods captured in a CUDA graph, replayed with new data."""
    report = RankReport(rank)
    ctx = iris.create(backend, heap_size="256MiB")
    with report.section("graph"):
        tokens, hidden, dtype, device = 96, 8192, torch.bfloat16, ctx.device
        x = torch.empty(tokens, hidden, dtype=dtype, device=device)
        residual, out, residual_out = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)
        weight = torch.empty(hidden, dtype=dtype, device=device)
        for method in GRAPH_METHODS:
            ctx.ops.all_reduce_rmsnorm(out, x.zero_(), residual.zero_(), weight.zero_(), EPS, residual_out,
                                       method=method)  # sizes the workspace before the capture
            torch.cuda.synchronize(device)
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, EPS, residual_out, method=method)
            for replay in range(GRAPH_REPLAYS):
                xs, r, w, (expected, s) = _inputs(1, tokens, hidden, dtype, "graph", method, replay)
                x.copy_(xs[0])
                residual.copy_(r)
                weight.copy_(w)
                graph.replay()
                torch.cuda.synchronize(device)
                report[f"graph/{method}/{replay}/out"] = _close(out, expected, dtype)
                report[f"graph/{method}/{replay}/residual_out"] = _close(residual_out, s, dtype)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_cuda_graph_capture_and_replay_match_torch(backend):
    reports = reports_on_available_ranks(_graph_worker, 1, backend, backend=backend, timeout=120)
    assert_rank_checks(reports, "graph/", {f"graph/{method}/{replay}/{output}" for method in GRAPH_METHODS
                                           for replay in range(GRAPH_REPLAYS) for output in ("out", "residual_out")}
                       | {"graph/completed"})


# -- PTX (sm_90, no GPU needed) ------------------------------------------------------------------------

#: (front end, method, chunks per row) compiled by :func:`_compile_ptx`, as the GPU launches them
#: (bf16, chunks of 8192, 16 warps).
PTX_CASES = [(frontend, method, chunks) for frontend in ("triton", "gluon") for method, chunks in
             (("one_shot", 1), ("two_shot", 1), ("two_shot", 2))]


def _compile_ptx() -> dict:
    """``{"frontend/method": [memory instructions] or error text}``: run as a script (without
    TRITON_INTERPRET), with the helpers of tests/ptx_kernels.py."""
    import traceback

    import triton
    from triton.experimental.gluon._runtime import GluonASTSource

    import ptx_kernels
    from iris_gluon.frontend import GLUON
    from iris_triton.device.frontend import TRITON
    from iris_triton.operations.rmsnorm import SITE, all_reduce_rmsnorm_kernel
    from iris_triton.tuning import RMSNORM_SHAPES
    from iris_triton.protocol.waits import site_code

    shape = RMSNORM_SHAPES["cuda"]
    types = {name: "*bf16" for name in ("x", "residual", "weight", "out", "residual_out", "ws")}
    types.update(sync="*i32", tokens="i32", share="i32", hidden="i32", region="i32", eps="fp32")
    divisible = ("context", "x", "residual", "weight", "out", "residual_out", "ws", "sync", "hidden", "region")
    results = {}
    for frontend_name, method, chunks in PTX_CASES:
        frontend = {"triton": TRITON, "gluon": GLUON}[frontend_name]
        constexprs = dict(CTX=frontend.device_context, TRACING=False, RANK=0, WORLD=2, TWO_SHOT=method == "two_shot",
                          RESIDUAL_OUT=True, SITE=site_code(SITE), BLOCK=shape["MAX_BLOCK"], CHUNKS=chunks)
        fn, signature, const, attrs = ptx_kernels._spec(frontend.kernel(all_reduce_rmsnorm_kernel), constexprs,
                                                        types, divisible)
        source_class = GluonASTSource if frontend_name == "gluon" else triton.compiler.ASTSource
        try:
            source = source_class(fn=fn, signature=signature, constexprs=const, attrs=attrs)
            ptx = triton.compile(source, target=ptx_kernels.TARGET,
                                 options={"num_warps": shape["MAX_WARPS"]}).asm["ptx"]
            results[f"{frontend_name}/{method}/{chunks}"] = {"ops": ptx_kernels.memory_instructions(ptx),
                                                     "markers": ptx_kernels.markers(ptx)}
        except Exception:  # reported to the test
            results[f"{frontend_name}/{method}/{chunks}"] = traceback.format_exc()[-4000:]
    return results


@pytest.fixture(scope="module")
def ptx() -> dict:
    here = Path(__file__)
    return run_without_interpreter(here, "--ptx", timeout=600, cwd=here.parent)


@pytest.mark.parametrize("frontend, method, chunks", PTX_CASES)
def test_the_kernel_moves_16_byte_vectors_and_bounds_its_waits(ptx, frontend, method, chunks):
    # Rows move in 16-byte vectors (bf16), local and remote alike; a signal is a release exchange
    # and a wait an acquire load at system scope, bounded by the global timer, its give-up
    # written through to the host-visible fault words, with the trap of on_timeout="trap".
    compiled = ptx[f"{frontend}/{method}/{chunks}"]
    assert isinstance(compiled, dict), compiled
    ops, marks = compiled["ops"], compiled["markers"]
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert [op for op in ops if op.startswith(("atom.", "red."))] == ["atom.global.sys.release.exch.b32"], ops
    assert "ld.global.sys.acquire.b32" in ops and "st.global.wt.b32" in ops, ops
    assert "%globaltimer" in marks and "trap" in marks, marks


if __name__ == "__main__" and sys.argv[1:] == ["--ptx"]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("TRITON_INTERPRET is set: kernels are interpreted and cannot be compiled; unset it")
    json.dump(_compile_ptx(), sys.stdout)
