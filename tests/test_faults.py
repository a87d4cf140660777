"""Faults and bad input: no hang, no leak, no corruption, a clear error.

A collective one rank skips and a rank killed mid-run make the survivors raise IrisTimeoutError
naming the operation and the missing rank within the timeout; ranks making different calls raise
CallMismatchError at once, naming every rank's call, without debug mode; debug mode catches calls
that differ across ranks on the host; a destroyed context refuses use; heap segments are private;
ranks listen only on the loopback interface; a soak of mixed collectives and kernels stays
correct with flat memory. docs/faults.md has the table of what was tried.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import iris
from iris.errors import IrisError, IrisTimeoutError
from iris.testing import RankReport, assert_rank_checks, free_loopback_port, rank_device, spawn_reports

#: Seconds a wait may last in these tests (device-side waits and the host barrier).
SHORT_TIMEOUT = 2


# -- a collective that one rank never calls ---------------------------------------------------------------


def _mismatch_worker(rank: int, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="16MiB", device=device, timeout=SHORT_TIMEOUT)
    last = ctx.world_size - 1
    x = ctx.ones(100)
    ctx.ccl.all_reduce(x)  # every rank: fine
    ctx.barrier()
    report["error"] = "no error"
    started = time.monotonic()
    if rank != last:  # the last rank skips this all_reduce: its peers' call itself raises
        try:
            ctx.ccl.all_reduce(x)
        except IrisTimeoutError as error:
            report["error"] = str(error)
            report["nan"] = bool(x.isnan().all())
    report["seconds"] = time.monotonic() - started
    try:  # the skipping rank waits at the host barrier for peers that no longer come
        ctx.barrier()
        report["barrier"] = "no error"
    except IrisError as error:
        report["barrier"] = str(error)
    report["failed"] = ctx.failed
    try:
        ctx.destroy()
    except IrisError:
        pass  # docs/faults.md: destroy of a failed context; checked in test_failstop.py
    return report.packed()


@pytest.mark.parametrize("world", [2, 3])
def test_a_collective_one_rank_skips_times_out_naming_it(parts, world):
    reports = parts(world, "skipped")
    last = world - 1
    for rank in range(last):
        report = reports[rank]
        error = report["error"]
        assert error.startswith(f"ctx.ccl.all_reduce: on rank {rank}, a device-side wait failed: "), error
        assert f"all_reduce gave up after {SHORT_TIMEOUT:g} s waiting for world rank(s) [{last}]" in error, error
        assert report["nan"] is True  # the failed call's output
        assert SHORT_TIMEOUT <= report["seconds"] <= 1.5 * SHORT_TIMEOUT, report["seconds"]
        assert "this context failed earlier" in report["barrier"], report["barrier"]
        assert report["failed"] is True
    # The rank that skipped saw nothing wrong until the host barrier its peers never reach.
    assert reports[last]["error"] == "no error", reports[last]["error"]
    assert f"host barrier on rank {last}" in reports[last]["barrier"], reports[last]["barrier"]
    assert reports[last]["failed"] is True


# -- a late peer's data after a wait gave up ---------------------------------------------------------------


#: The all_reduce algorithms of the late-peer scenario, one after the other in one start of 2 ranks.
LATE_PEER_ALGORITHMS = ("sentinel", "low_latency")


def _late_peer_worker(rank: int, device: str) -> bytes:
    """The late-peer scenario with each of :data:`LATE_PEER_ALGORITHMS`, each on a fresh context;
    its checks named ``late/<algorithm>/...``."""
    report = RankReport(rank)
    for algorithm in LATE_PEER_ALGORITHMS:
        with report.section(f"late/{algorithm}"):
            part = RankReport(rank)
            try:
                _late_peer(rank, device, algorithm, part)
            finally:
                report.update({f"late/{algorithm}/{key.removeprefix('late/')}": value for key, value in part.items()})
    return report.packed()


def _late_peer(rank: int, device: str, algorithm: str, report: RankReport) -> None:
    ctx = iris.create(heap_size="16MiB", device=device, timeout=SHORT_TIMEOUT)
    world = ctx.world_size
    data = [torch.randint(-8, 9, (600,), generator=torch.Generator().manual_seed(q)).float() for q in range(world)]
    expected = sum(data)
    x = data[rank].clone().to(ctx.device)
    ctx.ccl.all_reduce(x, algorithm=algorithm)
    report.check("late/first_call_exact", torch.equal(x.cpu(), expected))
    ctx.barrier()
    if rank == 1:  # late by more than the timeout: rank 0 gave up on it before its push lands
        time.sleep(SHORT_TIMEOUT + 1)
    y = data[rank].clone().to(ctx.device)
    try:
        ctx.ccl.all_reduce(y, algorithm=algorithm)
        outcome = "exact" if torch.equal(y.cpu(), expected) else f"WRONG {y[:8].tolist()}"
    except IrisTimeoutError as error:
        outcome = "raised NaN" if y.isnan().all() else f"raised, output not NaN: {error}"
    if rank == 0:  # the rank that waited raised at the call itself
        report.check("late/the_waiting_rank_raises", outcome == "raised NaN")
    else:  # the late rank's push found rank 0's data: exact, or it raised; never a wrong value
        report["late/the_late_rank_exact_or_raises"] = outcome in ("exact", "raised NaN") or outcome
    started = time.monotonic()
    # The next call raises: at once where the context failed (rank 0; rank 1 if its late call raised,
    # as when a program of rank 0's kernel started after another gave up, and so sent nothing), else
    # after the timeout (rank 1 waits for a peer that makes no more calls).
    failed_already = ctx.failed
    try:
        z = data[rank].clone().to(ctx.device)
        ctx.ccl.all_reduce(z, algorithm=algorithm)
        report["late/next_call_raises"] = f"returned {z[:4].tolist()}"
    except IrisTimeoutError as error:
        report.check("late/next_call_raises", not failed_already or "this context failed earlier" in str(error))
    seconds = time.monotonic() - started
    report.check("late/next_call_time", seconds < 0.5 if failed_already else SHORT_TIMEOUT <= seconds)
    report.check("late/failed_where_it_raised", failed_already == (rank == 0 or outcome != "exact"))
    report.check("late/context_failed", ctx.failed)
    try:
        ctx.destroy()
    except IrisError:
        pass  # docs/faults.md: destroy of a failed context; checked in test_failstop.py


@pytest.mark.parametrize("algorithm", LATE_PEER_ALGORITHMS)
def test_a_late_peers_data_is_never_consumed_after_a_wait_gave_up(parts, algorithm):
    # A late peer's push lands in a region whose wait gave up: the rank that waited raised and its
    # context is failed, so nothing reads that region again; the late rank's next call fails too.
    prefix = f"late/{algorithm}/"
    # Rank 0 waits for rank 1, which is late.
    own = {0: "the_waiting_rank_raises", 1: "the_late_rank_exact_or_raises"}
    assert_rank_checks([{k: v for k, v in rep.items() if k.startswith(prefix)} for rep in parts(2, "late_peer")],
                       prefix, lambda rank: {prefix + check for check in (
                           "first_call_exact", own[rank], "next_call_raises", "next_call_time",
                           "failed_where_it_raised", "context_failed", "completed")})


# -- a kernel that starts on a failed context ------------------------------------------------------------

#: Calls of a kernel launched on a context whose failure the host has not seen yet: (collective, algorithm).
AFTER_A_FAILURE = (("all_reduce", "low_latency"), ("all_reduce", "sentinel"), ("all_reduce", "one_shot"),
                   ("all_reduce", "two_shot"), ("all_gather", None))


def _failed_sender_worker(rank: int, device: str) -> bytes:
    """For each call, a fresh context and a first call of it (exact); then rank 0's context has a
    failure recorded (as an earlier kernel leaves it on a GPU, before the host sees it) and launches
    the call's kernel as the host does before it checks, while rank 1 makes the call. Rank 0's
    kernel sends nothing, so rank 1's call gives up (NaN output) rather than take its data."""
    from iris_triton.protocol.waits import TIMEOUT, site_code

    report = RankReport(rank)
    data = [torch.randint(-8, 9, (600,), generator=torch.Generator().manual_seed(q)).float() for q in range(2)]
    for collective, algorithm in AFTER_A_FAILURE:
        name = f"sent/{collective}/{algorithm}"
        ctx = iris.create(heap_size="16MiB", device=device, timeout=SHORT_TIMEOUT)
        for call in ("first", "after"):
            x = data[rank].clone().to(ctx.device)
            out = x if collective == "all_reduce" else torch.empty(2 * x.numel(), device=ctx.device)
            if call == "first":
                getattr(ctx.ccl, collective)(*((out,) if out is x else (out, x)), algorithm=algorithm)
                expected = sum(data) if collective == "all_reduce" else torch.cat(data)
                report.check(f"{name}/first_exact", torch.equal(out.cpu(), expected))
                ctx.barrier()
            elif rank == 0:
                ctx.faults[0] = 1  # what record_failure leaves: a device barrier gave up waiting for rank 1
                ctx.faults[2] = TIMEOUT.value * 256 + site_code("device_barrier")
                ctx.ccl._dispatch(collective, algorithm, out, x, lambda: None, "sum", 0)  # past the host's guard
                report.check(f"{name}/poisoned", out.isnan().all())
            else:
                try:
                    getattr(ctx.ccl, collective)(*((out,) if out is x else (out, x)), algorithm=algorithm)
                    report[f"{name}/peer_gave_up"] = f"returned {out[:4].tolist()}: rank 0's data taken"
                except IrisTimeoutError:
                    report.check(f"{name}/peer_gave_up", out.isnan().all())
        try:
            ctx.destroy()  # failed on both ranks: without waiting for the peer
        except IrisTimeoutError:
            pass  # rank 0: the failure recorded above, raised once everything is released
    return report.packed()


def test_a_kernel_launched_on_a_failed_context_sends_its_peers_nothing(parts):
    reports = parts(2, "failed_sender")
    # Rank 0's context has the failure; rank 1 makes the call.
    after = {0: "poisoned", 1: "peer_gave_up"}
    assert_rank_checks(reports, "sent/", lambda rank: {f"sent/{collective}/{algorithm}/{check}"
                                                       for collective, algorithm in AFTER_A_FAILURE
                                                       for check in ("first_exact", after[rank])})


# -- a rank killed mid-run ----------------------------------------------------------------------------------

KILLED_RANK_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time
    import iris
    from iris.errors import IrisError, IrisTimeoutError

    ctx = iris.create(heap_size="16MiB", device=os.environ["RANK_DEVICE"])
    x = ctx.ones(100)
    ctx.ccl.all_reduce(x)
    ctx.barrier()
    if ctx.rank == ctx.world_size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        ctx.ccl.all_reduce(x)
        print("NO ERROR", flush=True)
    except IrisTimeoutError as error:
        print(f"TIMEOUT after {time.monotonic() - started:.2f} s, nan={bool(x.isnan().all())}: {error}", flush=True)
    try:
        ctx.barrier()
        print("BARRIER PASSED", flush=True)
    except IrisError as error:
        print(f"BARRIER RAISED, failed earlier: {'this context failed earlier' in str(error)}", flush=True)
    os._exit(0)  # the peer is gone: skip the collective clean-up
''')


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="CPU ranks need /dev/shm")
def test_a_killed_rank_leaves_survivors_raising_and_no_segments(tmp_path):
    world = 2 if torch.cuda.device_count() >= 2 else 3
    device = rank_device(world)  # skips where the interpreter cannot run the kernels
    script = tmp_path / "rank.py"
    script.write_text(KILLED_RANK_SCRIPT)
    before = {n for n in os.listdir("/dev/shm") if n.startswith("iris-")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_loopback_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), IRIS_TIMEOUT=str(SHORT_TIMEOUT), RANK_DEVICE=device,
               GLOO_SOCKET_IFNAME="lo", NCCL_SOCKET_IFNAME="lo")
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert procs[-1].returncode == -signal.SIGKILL
    for rank in range(world - 1):
        out, err = outputs[rank]
        assert procs[rank].returncode == 0, err[-3000:]
        found = re.search(rf"TIMEOUT after ([\d.]+) s, nan=True: ctx.ccl.all_reduce: on rank {rank}, a device-side "
                          rf"wait failed: all_reduce gave up after {SHORT_TIMEOUT:g} s waiting for world rank\(s\) "
                          rf"\[{world - 1}\]", out)
        assert found, out + err[-2000:]
        assert SHORT_TIMEOUT <= float(found.group(1)) <= 1.5 * SHORT_TIMEOUT, out
        assert "BARRIER RAISED, failed earlier: True" in out, out
    time.sleep(0.5)
    assert {n for n in os.listdir("/dev/shm") if n.startswith("iris-")} <= before


# -- debug mode: calls that differ across ranks -------------------------------------------------------------


def _debug_worker(rank: int, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="16MiB", device=device, debug=True)
    with report.section("same_call"):
        x = ctx.ones(64)
        ctx.ccl.all_reduce(x)
        report.check("debug/same_call_works", torch.equal(x.cpu(), torch.full((64,), float(ctx.world_size))))
    # Plain tensors: in debug mode a heap allocation that differs across ranks is caught earlier.
    device = ctx.device
    for name, make in (("shape", lambda: torch.ones(64 + rank, device=device)),
                       ("dtype", lambda: torch.ones(64, device=device, dtype=(torch.float32, torch.float16)[rank]))):
        try:
            ctx.ccl.all_reduce(make())
            report.check(f"debug/{name}_mismatch_raises", False)
        except IrisError as error:
            report.check(f"debug/{name}_mismatch_raises", "the ranks made different calls" in str(error)
                         and "rank 1: all_reduce" in str(error))
    with report.section("heap_unharmed"):  # a matching call afterwards still works
        y = ctx.full((10,), float(rank))
        ctx.ccl.all_reduce(y)
        report.check("debug/later_call_correct", torch.equal(y.cpu(), torch.full((10,), float(sum(range(2))))))
    ctx.barrier()
    ctx.destroy()
    return report.packed()


def test_debug_mode_catches_calls_that_differ_across_ranks(parts):
    reports = parts(2, "debug")
    assert_rank_checks(reports, "debug/", {"debug/same_call_works", "debug/shape_mismatch_raises",
                                           "debug/dtype_mismatch_raises", "debug/later_call_correct"})


# -- ranks making different calls, without debug mode -------------------------------------------------------

#: The timeout of the different-calls worlds: far longer than any raise may take.
DIFFERENT_CALLS_TIMEOUT = 60
#: The most seconds a mismatched call may take to raise on a rank, from a host barrier just before
#: it (the ranks then arrive together; the point is that nobody waits for the timeout).
DIFFERENT_CALLS_BOUND = 10

#: A call: (what, elements, dtype, options). ``what`` is a collective of ctx.ccl,
#: "all_reduce_rmsnorm" (elements: tokens, of rows of 32) or a matrix product of ctx.ops (elements:
#: rows of A on this rank for all_gather_matmul, in all for the others; options: its method, and
#: ``cols`` and ``depth``, N and K, by default 16).
AR = "all_reduce"
AGM = "all_gather_matmul"
MRS = "matmul_reduce_scatter"
BF16 = torch.bfloat16
#: ctx.ops's matrix products.
PRODUCTS = (AGM, MRS, "matmul_all_reduce")


def _call(what, n, dtype=torch.float32, **options):
    return (what, n, dtype, tuple(sorted(options.items())))


#: Elements of most calls (divisible by 2, 3 and 5; a few blocks of CPU ranks' kernels).
N = 240
#: (name, rank 0's call, every other rank's call, calls every rank makes before (warm-up): both
#: calls, which size the workspaces for both, rank 0's only, so that the other call must grow one
#: alone, or none, a first call).
DIFFERENT_CALLS = [
    *[case for algorithm in ("low_latency", "sentinel", "one_shot", "two_shot") for case in (
        (f"{algorithm}/dtype", _call(AR, N, algorithm=algorithm), _call(AR, N, torch.bfloat16, algorithm=algorithm),
         "both"),
        (f"{algorithm}/count", _call(AR, N, algorithm=algorithm), _call(AR, 2 * N, algorithm=algorithm), "rank 0's"),
        (f"{algorithm}/op", _call(AR, N, algorithm=algorithm), _call(AR, N, algorithm=algorithm, op="max"), "both"))],
    ("algorithms/low_latency_one_shot", _call(AR, N, algorithm="low_latency"), _call(AR, N, algorithm="one_shot"),
     "both"),
    ("algorithms/sentinel_two_shot", _call(AR, N, algorithm="sentinel"), _call(AR, N, algorithm="two_shot"), "both"),
    # The first tries: 1000 float32 elements on one rank, bfloat16 on the other.
    ("automatic/dtype", _call(AR, 1000), _call(AR, 1000, torch.bfloat16), "both"),
    ("automatic/dtype_first_call", _call(AR, 1000), _call(AR, 1000, torch.bfloat16), "none"),
    ("automatic/count_first_call", _call(AR, N), _call(AR, 3 * N), "none"),
    ("collective/all_reduce_all_gather", _call(AR, N), _call("all_gather", N), "both"),
    ("all_gather/count", _call("all_gather", N), _call("all_gather", 2 * N), "rank 0's"),
    ("reduce_scatter/op", _call("reduce_scatter", N), _call("reduce_scatter", N, op="min"), "both"),
    ("all_to_all/dtype", _call("all_to_all", N), _call("all_to_all", N, torch.float16), "both"),
    ("broadcast/root", _call("broadcast", N, src=0), _call("broadcast", N, src=1), "both"),
    ("reduce/root", _call("reduce", N, dst=0), _call("reduce", N, dst=1), "both"),
    ("all_reduce_rmsnorm/tokens", _call("all_reduce_rmsnorm", 6), _call("all_reduce_rmsnorm", 9), "rank 0's"),
    ("all_reduce_rmsnorm/method", _call("all_reduce_rmsnorm", 6, method="one_shot"),
     _call("all_reduce_rmsnorm", 6, method="two_shot"), "both"),
    # The fused matrix products, after a warm-up that sized their workspaces for both calls.
    ("all_gather_matmul/rows", _call(AGM, 5, BF16, method="fused"), _call(AGM, 6, BF16, method="fused"), "both"),
    ("all_gather_matmul/depth", _call(AGM, 5, BF16, method="fused"), _call(AGM, 5, BF16, method="fused", depth=32),
     "both"),
    ("all_gather_matmul/tile", _call(AGM, 5, BF16, method="fused"), _call(AGM, 5, BF16, method="fused/32x32x16"),
     "both"),
    ("all_gather_matmul/dtype", _call(AGM, 5, BF16, method="fused"), _call(AGM, 5, torch.float16, method="fused"),
     "both"),
    ("matmul_reduce_scatter/cols", _call(MRS, 30, BF16, method="fused"),
     _call(MRS, 30, BF16, method="fused", cols=32), "both"),
    ("matmul_reduce_scatter/rows", _call(MRS, 30, BF16, method="fused"), _call(MRS, 60, BF16, method="fused"),
     "both"),
    ("matmul_all_reduce/dtype", _call("matmul_all_reduce", 30, BF16, method="fused"),
     _call("matmul_all_reduce", 30, torch.float16, method="fused"), "both"),
    ("all_gather_matmul/copy_engine_rows", _call(AGM, 5, BF16, method="copy_engine"),
     _call(AGM, 6, BF16, method="copy_engine"), "both"),
    ("matmul_reduce_scatter/copy_engine_cols", _call(MRS, 30, BF16, method="copy_engine"),
     _call(MRS, 30, BF16, method="copy_engine", cols=32), "both"),
    ("matmul_all_reduce/copy_engine_depth", _call("matmul_all_reduce", 30, BF16, method="copy_engine"),
     _call("matmul_all_reduce", 30, BF16, method="copy_engine", depth=32), "both"),
]


def _tensors(ctx, call) -> tuple:
    """The tensors of ``call`` on ``ctx`` (every rank allocates those of every call, alike)."""
    what, n, dtype, options = call
    if what == "all_reduce_rmsnorm":
        return ctx.ones(n, 32, dtype=dtype), ctx.empty(n, 32, dtype=dtype)
    if what in PRODUCTS:
        cols, depth = _extents(options)
        rows = {AGM: n * ctx.world_size, MRS: n // ctx.world_size}.get(what, n)
        return ctx.ones(n, depth, dtype=dtype), ctx.ones(depth, cols, dtype=dtype), ctx.empty(rows, cols, dtype=dtype)
    if what in ("all_reduce", "broadcast", "reduce"):
        return (ctx.ones(n, dtype=dtype),)
    world = ctx.world_size
    return ctx.ones(n, dtype=dtype), ctx.empty(n * world if what == "all_gather" else n // world
                                               if what == "reduce_scatter" else n, dtype=dtype)


def _extents(options) -> tuple[int, int]:
    """N and K of a matrix product's call (its options ``cols`` and ``depth``)."""
    options = dict(options)
    return options.get("cols", 16), options.get("depth", 16)


def _run_call(ctx, call, tensors) -> None:
    """Make ``call`` with its ``tensors``."""
    what, n, dtype, options = call
    options = dict(options)
    if what in PRODUCTS:
        a, b, out = tensors
        getattr(ctx.ops, what)(out, a, b, method=options["method"])
    elif what == "all_reduce_rmsnorm":
        x, out = tensors
        ctx.ops.all_reduce_rmsnorm(out, x, torch.ones_like(x), torch.ones(32, dtype=dtype, device=ctx.device),
                                   **options)
    elif what in ("all_reduce", "broadcast", "reduce"):
        getattr(ctx.ccl, what)(tensors[0], **options)
    else:
        getattr(ctx.ccl, what)(tensors[1], tensors[0], **options)


def _written(ctx, call, tensors) -> tuple:
    """The float outputs ``call`` writes on this rank."""
    what, _, _, options = call
    if what in PRODUCTS:
        return tensors[2:]
    if what in ("all_reduce", "broadcast"):
        return tensors
    if what == "reduce":
        return tensors if dict(options)["dst"] == ctx.rank else ()
    return tensors[1:]


def _description(call, world: int) -> str:
    """How the error names ``call``: the start of its description."""
    what, n, dtype, options = call
    options = dict(options)
    name = str(dtype).removeprefix("torch.")
    if what == "all_reduce_rmsnorm":
        return f"all_reduce_rmsnorm(x ({n}, 32) {name}"
    if what in PRODUCTS:
        cols, depth = _extents(options)
        rows = {AGM: n * world, MRS: n // world}.get(what, n)
        method = options["method"]
        if method.startswith("fused"):
            method = f"fused/{method.partition('/')[2] or '16x16x16'}"  # the built-in tile, by name
        return f"{what}(({rows}, {cols}) {name}, ({n}, {depth}) {name}, ({depth}, {cols}) {name}, method={method!r})"
    out = n * world if what == "all_gather" else n // world if what == "reduce_scatter" else n
    root = options.get("src", options.get("dst", 0))
    return f"{what}(output ({out},) {name}, input ({n},) {name}, op={options.get('op', 'sum')}, src={root}"


def _different_calls_worker(rank: int, device: str, cases: list) -> bytes:
    """For each case, a fresh context: the warm-up calls on every rank, then rank 0 makes one
    call and every other rank another. Every rank must raise at once, naming both calls."""
    import torch.distributed as dist

    from iris.errors import CallMismatchError

    report = RankReport(rank)
    for name, first, other, warm in cases:
        with report.section(f"different/{name}"):
            ctx = iris.create(heap_size="32MiB", device=device, timeout=DIFFERENT_CALLS_TIMEOUT)
            world = ctx.world_size
            tensors = {call: _tensors(ctx, call) for call in (first, other)}
            for call in {"both": (first, other), "rank 0's": (first,), "none": ()}[warm]:
                _run_call(ctx, call, tensors[call])
            ctx.barrier()
            mine = first if rank == 0 else other
            started = time.monotonic()
            try:
                _run_call(ctx, mine, tensors[mine])
                ctx.check()  # GPUs: the host raises once it sees what the kernel recorded
                error = None
            except IrisError as raised:
                error = raised
            seconds = time.monotonic() - started
            report[f"seconds/{name}"] = round(seconds, 2)
            message = str(error)
            named = isinstance(error, CallMismatchError) and "made different calls" in message and \
                f"rank 0: {_description(first, world)}" in message and \
                f"rank {world - 1}: {_description(other, world)}" in message
            report[f"different/{name}/raised"] = True if named else f"{type(error).__name__}: {message}"
            report.check(f"different/{name}/in_time", seconds < DIFFERENT_CALLS_BOUND)
            report.check(f"different/{name}/nan", all(t.isnan().all() for t in _written(ctx, mine, tensors[mine])))
            report.check(f"different/{name}/failed", ctx.failed)
            ctx.destroy()
            dist.barrier()
    return report.packed()


@pytest.mark.parametrize("world, cases", [(2, DIFFERENT_CALLS), (5, DIFFERENT_CALLS[1::3])], ids=["2", "5"])
def test_ranks_making_different_calls_raise_at_once_naming_both_calls(world, cases):
    """Rank 0 makes one call, every other rank another. On 2 ranks one peer differs, in every
    case; on 5 (odd, sizes divided by 5) several peers make the same other call and the last rank
    named is not rank 1, which every case shows alike: a third of the cases run there, among them
    each all_reduce algorithm's size mismatch (sizes that split unevenly). A world of 3 shows
    nothing more: several peers making the other call, an odd world."""
    device = rank_device(world)
    started = time.monotonic()
    reports = spawn_reports(_different_calls_worker, world, device, cases, device=device,
                            timeout=DIFFERENT_CALLS_TIMEOUT)
    seconds = {name: max(r.get(f"seconds/{name}", -1) for r in reports) for name, *_ in cases}
    print(f"world {world}: {time.monotonic() - started:.1f} s in all; slowest raise per case: {seconds}")
    assert_rank_checks(reports, "different/", {f"different/{name}/{check}" for name, *_ in cases
                                               for check in ("raised", "in_time", "nan", "failed", "completed")})


# -- a destroyed context ------------------------------------------------------------------------------------


def test_a_destroyed_context_refuses_use_clearly():
    ctx = iris.create(heap_size="8MiB", device="cpu" if not torch.cuda.is_available() else "cuda")
    x = ctx.ones(8)
    kept = ctx.ccl
    kept.all_reduce(x)
    ctx.destroy()
    ctx.destroy()  # a second destroy is a no-op
    assert ctx.destroyed and ctx.rank == 0 and "destroyed" in repr(ctx)
    for use in (lambda: ctx.zeros(3), lambda: ctx.ccl, lambda: kept.all_reduce(x), lambda: ctx.barrier(),
                lambda: ctx.get_heap_bases(), lambda: ctx.ops):
        with pytest.raises(IrisError, match=r"this context \(rank 0\) was destroyed; create a new one"):
            use()


# -- security ------------------------------------------------------------------------------------------------


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1].split(":")[0])
    return found


def _listening_worker(rank: int, device: str) -> list[str]:
    ctx = iris.create(heap_size="8MiB", device=device)
    ctx.ccl.all_reduce(ctx.ones(4))
    addresses = _listening_addresses(os.getpid())
    ctx.barrier()
    ctx.destroy()
    return addresses


def test_ranks_listen_on_the_loopback_interface_only(parts):
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc writes them
    for addresses in parts(2, "listening"):
        assert set(addresses) <= loopback, addresses


# -- soak ------------------------------------------------------------------------------------------------------

#: Operations of the soak test: a short run by default, ``IRIS_SOAK_OPS=10000`` for the full one.
SOAK_OPS = int(os.environ.get("IRIS_SOAK_OPS", "36"))


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def _soak_worker(rank: int, device: str, ops: int) -> bytes:
    import triton

    from iris_triton.demo import ring_store_kernel
    from iris.testing import seeded_generator

    report = RankReport(rank)
    ctx = iris.create(heap_size="32MiB", device=device)
    world = ctx.world_size
    choices = seeded_generator("soak")  # the same sequence of operations on every rank
    live = []
    memory = []
    wrong = 0
    for i in range(ops):
        kind = int(torch.randint(0, 5, (1,), generator=choices))
        n = world * int(torch.randint(1, 200, (1,), generator=choices))
        data = [torch.randn(n, generator=seeded_generator("soak", i, q)) for q in range(world)]
        mine = data[rank].to(ctx.device)
        if kind == 0:
            result, expected = ctx.ccl.all_reduce(mine.clone()), sum(data)
        elif kind == 1:
            result = ctx.ccl.all_gather(torch.empty(world * n, device=ctx.device), mine)
            expected = torch.cat(data)
        elif kind == 2:
            result = ctx.ccl.reduce_scatter(torch.empty(n // world, device=ctx.device), mine)
            expected = sum(data)[rank * (n // world):(rank + 1) * (n // world)]
        elif kind == 3:
            result = ctx.ccl.all_to_all(torch.empty(n, device=ctx.device), mine)
            expected = torch.stack([d.view(world, -1)[rank] for d in data]).reshape(-1)
        else:  # an RMA kernel: every rank stores its tensor into its right neighbour's heap
            source, target = ctx.as_symmetric(mine), ctx.zeros(n)
            live += [source, target]
            ctx.barrier()
            ring_store_kernel[(triton.cdiv(n, 256),)](source, target, n, ctx.get_heap_bases(), RANK=rank, WORLD=world,
                                                      BLOCK=256, TRACING=False)
            ctx.barrier()
            result, expected = target, data[(rank - 1) % world]
        wrong += not torch.allclose(result.cpu(), expected, rtol=1e-4, atol=1e-4)
        if len(live) > 4 and bool(torch.randint(0, 2, (1,), generator=choices)):  # occasional frees
            ctx.barrier()
            ctx.free(live.pop(0))
        if i % max(1, ops // 6) == 0:
            memory.append((_resident_kib(), ctx.heap.allocator.free_bytes))
    ctx.barrier()
    report.check("soak/all_correct", wrong == 0)
    report.check("soak/context_not_failed", not ctx.failed)
    report["memory"] = memory
    ctx.destroy()
    return report.packed()


def test_soak_of_mixed_collectives_and_kernels_stays_correct_and_flat(parts):
    world = 3
    reports = parts(world, "soak")
    assert_rank_checks(reports, "soak/", {"soak/all_correct", "soak/context_not_failed"})
    for report in reports:
        memory = report["memory"]
        resident = [kib for kib, _ in memory[1:]]  # after the first operations compiled and warmed up
        assert max(resident) - min(resident) < 64 * 1024, memory  # under 64 MiB of drift
        free_heap = [free for _, free in memory]
        assert max(free_heap) - min(free_heap) <= 4 * 1 << 20, memory  # at most a few live tensors


# -- one start of the ranks per world size for the checks above ---------------------------------------------

#: What the one start of 2 ranks, and of 3, runs, in this order, each part on contexts of its own.
#: The ranks that skip a collective come last: there the last rank's host barrier times out,
#: after which the ranks' process group is not used again.
PARTS = {2: ("debug", "listening", "late_peer", "failed_sender", "skipped"), 3: ("soak", "skipped")}
_PART_WORKERS = {"debug": _debug_worker, "listening": _listening_worker, "late_peer": _late_peer_worker,
                 "failed_sender": _failed_sender_worker, "skipped": _mismatch_worker,
                 "soak": lambda rank, device: _soak_worker(rank, device, SOAK_OPS)}


def _parts_worker(rank: int, device: str, names: tuple) -> bytes:
    """Each part of ``names`` in turn: its worker's result (a report unpacked), or the traceback
    of what it raised."""
    import pickle
    import traceback
    import zlib

    outcomes = {}
    for name in names:
        try:
            outcome = _PART_WORKERS[name](rank, device)
            outcomes[name] = pickle.loads(zlib.decompress(outcome)) if isinstance(outcome, bytes) else outcome
        except Exception:  # noqa: BLE001 - the part's test fails with it
            outcomes[name] = f"raised on rank {rank}: {traceback.format_exc()[-3000:]}"
    return zlib.compress(pickle.dumps(outcomes))  # as RankReport.packed(), for spawn_reports


@pytest.fixture(scope="module")
def parts():
    """``parts(world, name)``: every rank's result of part ``name`` of :data:`PARTS`, from one
    start of ``world`` ranks per world size (made when a test first asks)."""
    started: dict[int, list[dict]] = {}

    def results(world: int, name: str) -> list:
        if world not in started:
            device = rank_device(world)
            started[world] = spawn_reports(_parts_worker, world, device, PARTS[world], device=device)
        outcomes = [rep[name] for rep in started[world]]
        raised = [o for o in outcomes if isinstance(o, str) and o.startswith("raised on rank")]
        assert not raised, "\n".join(raised)
        return outcomes

    return results


# -- debug mode: pointers outside the heap -------------------------------------------------------------------

DEBUG_POINTER_SCRIPT = textwrap.dedent('''
    import os
    os.environ["IRIS_DEBUG"] = "1"   # before iris is imported: kernels compile the checks in
    os.environ["TRITON_INTERPRET"] = "1"
    import triton, triton.language as tl
    import iris, torch
    from iris.errors import IrisError

    @triton.jit
    def poke(buf, heap_bases, offset, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        iris.store(buf + offset + offs, tl.zeros((BLOCK,), tl.float32) + 1, 0, 0, heap_bases, mask=offs < n)

    def outcome(buf, offset, n):
        """WROTE, or STOPPED and the error the launch raised, as it reaches the caller."""
        try:
            poke[(1,)](buf, ctx.get_heap_bases(), offset, n, BLOCK=64)
        except Exception as error:
            return f"STOPPED {type(error).__name__}: {error}"
        return "WROTE"

    ctx = iris.create(heap_size="4MiB", device="cpu")
    buf = ctx.zeros(64)
    print("inside:", outcome(buf, 0, 64), buf.sum().item(), flush=True)
    print("masked off:", outcome(buf, 10**7, 0), flush=True)
    # Host memory off the heap, where a stray write would land unnoticed.
    target = torch.zeros(64)
    print("off the heap:", outcome(buf, (target.data_ptr() - buf.data_ptr()) // 4, 64),
          "target", "changed" if target.any() else "unchanged", flush=True)
    print("first byte past the end:", outcome(buf, (ctx.heap_size - ctx.heap.offset_of(buf)) // 4, 1), flush=True)
    ctx.destroy()
    print("EXITING", flush=True)
''')


def test_debug_mode_stops_a_kernel_that_leaves_the_heap(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a device-side assertion would end the GPU context of the test process; checked on CPU ranks")
    script = tmp_path / "poke.py"
    script.write_text(DEBUG_POINTER_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("IRIS_")})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (f"the process ended with {proc.returncode} (a write landed outside the heap?)\n"
                                  f"{out[-3000:]}")
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert lines.get("inside") == "WROTE 64.0", out[-3000:]
    assert lines.get("masked off") == "WROTE", out[-3000:]  # masked-off lanes are not checked
    # The check's own IrisError, as raised inside the kernel: not Triton's InterpreterError around
    # the repr of an InterpreterError around ... (one per device-function call level).
    stopped = (r"STOPPED IrisError: iris \(IRIS_DEBUG\): rank 0 addressed rank 0's heap at byte offset {}, outside "
               r"the heap of 4194304 bytes \(\d+ address\(es\) outside, the lowest shown\); pass pointers into "
               r"tensors on the symmetric heap \(ctx.empty/zeros/...\) and mask off the lanes past their end")
    assert re.fullmatch(stopped.format(r"-?\d+") + r" target unchanged", lines.get("off the heap", "")), out[-3000:]
    assert re.fullmatch(stopped.format(4194304), lines.get("first byte past the end", "")), out[-3000:]
    assert proc.stdout.rstrip().endswith("EXITING"), out[-3000:]


DEBUG_GPU_SCRIPT = textwrap.dedent('''
    import os
    os.environ["IRIS_DEBUG"] = "1"   # before iris is imported: kernels compile the checks in
    import triton, triton.language as tl
    import iris, torch

    @triton.jit
    def twice(src, dst, heap_bases, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        iris.store(dst + offs, 2 * iris.load(src + offs, 0, 0, heap_bases, mask=mask), 0, 0, heap_bases, mask=mask)

    ctx = iris.create(heap_size="4MiB", device="cuda")
    src = ctx.randn(1000)
    dst = ctx.zeros(1000)
    twice[(1,)](src, dst, ctx.get_heap_bases(), 1000, BLOCK=1024)
    torch.cuda.synchronize()
    print("equal:", bool(torch.equal(dst, 2 * src)), flush=True)
    ctx.destroy()
''')


@pytest.mark.gpu
def test_debug_mode_lets_accesses_inside_the_heap_through_on_a_gpu(tmp_path):
    """The compiled checks read the heap size from the heap's debug header on the GPU: accesses
    inside the heap pass them (a wrong size would stop the kernel with a device assertion)."""
    script = tmp_path / "inside.py"
    script.write_text(DEBUG_GPU_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False,
                          env={k: v for k, v in os.environ.items() if not k.startswith("IRIS_")})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "equal: True" in proc.stdout.splitlines(), out[-3000:]
