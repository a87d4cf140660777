"""``ctx.tracing``: device-side events from iris's kernels and a user's, host ranges, the merged
Chrome trace, and tracing compiled out.

One spawn of 2 CPU ranks (GPUs where there are) traces a user kernel that records ``put``,
``store`` (upstream's ``record_event_start`` with a mask) and instant ``compute`` events
(tests/tracing_kernels.py), all_reduce, all_gather, a tile all_reduce inside a kernel, the
fused matmul_reduce_scatter and all_reduce_rmsnorm, every result checked against torch. Each
rank checks its own events (kinds, target ranks, bytes, call numbers, and where kernels run
synchronously every device event of a call inside that call's host range), then a full buffer
(events counted as dropped, the kept ones intact), then tracing off again (the user kernel's
events go nowhere: the context tensor and the data stay as they were). The parent checks the
merged file: the Chrome trace format, every rank a process, events nested on every track.

In-process: argument errors, torch.profiler names, and the lanes of overlapping kernels. A PTX
check (tests/tracing_ptx.py) compiles iris's kernels with tracing off, on, and from their source
without the tracing statements: off and without are the same PTX.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import iris
from iris.heap.device_context import trailer_index
from iris.testing import (RankReport, assert_rank_checks, reports_on_available_ranks, run_without_interpreter,
                          seeded_generator)
from iris.tracing import chrome_trace
from trace_checks import check_chrome_trace

HERE = Path(__file__).parent
N, BLOCK = 100, 64
PROGRAMS = -(-N // BLOCK)
#: Calls of the traced section whose device events each rank finds by name.
TRACED_CALLS = ("all_gather", "matmul_reduce_scatter", "all_reduce_rmsnorm", "wait", "tile all_reduce")


def _ring_put(ctx, tracing: bool) -> bool:
    """The user kernel; whether every rank's ``dst`` holds the previous rank's data."""
    from tracing_kernels import traced_ring_put

    world = ctx.world_size
    src = ctx.zeros(N)
    src.copy_(torch.randn(N, generator=seeded_generator("ring", ctx.rank)).to(ctx.device))
    dst = ctx.zeros(N)
    ctx.barrier()
    traced_ring_put[(PROGRAMS,)](ctx.get_device_context(), src, dst, N, TRACING=tracing, RANK=ctx.rank,
                                 WORLD=world, BLOCK=BLOCK)
    ctx.barrier()
    expected = torch.randn(N, generator=seeded_generator("ring", (ctx.rank - 1) % world))
    return torch.equal(dst.cpu(), expected)


def _collectives(ctx, report: RankReport) -> None:
    from tile_kernels import tile_collective

    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    parts = [torch.randn(256, generator=seeded_generator("ar", q)) for q in range(world)]
    for call in range(2):
        x = ctx.zeros(256)
        x.copy_(parts[rank].to(device))
        report.check(f"calls/all_reduce{call}", torch.allclose(ctx.ccl.all_reduce(x).cpu(), sum(parts), atol=1e-5))
    gathered = ctx.ccl.all_gather(torch.empty(world, 256, device=device), parts[rank].to(device))
    report.check("calls/all_gather", torch.equal(gathered.cpu(), torch.stack(parts)))
    a = [torch.randn(16 * world, 16, generator=seeded_generator("a", q)).bfloat16() for q in range(world)]
    b = torch.randn(16, 16, generator=seeded_generator("b")).bfloat16()
    out = torch.empty(16, 16, dtype=torch.bfloat16, device=device)
    ctx.ops.matmul_reduce_scatter(out, a[rank].to(device), b.to(device), method="fused")
    expected = sum(x.float() @ b.float() for x in a)[16 * rank:16 * (rank + 1)]
    report.check("calls/matmul_reduce_scatter", torch.allclose(out.float().cpu(), expected, rtol=2e-2, atol=5e-2))
    tiles = [torch.randn(16, 16, generator=seeded_generator("tile", q)) for q in range(world)]
    src, dst = ctx.as_symmetric(tiles[rank].to(device)), ctx.zeros(16, 16)
    ctx.frontend.kernel(tile_collective)[(1,)](
        ctx.get_device_context(), src, dst, ctx.tile_sync(1), 16, 16, 16, 16, 16, 1, 16, 1, 1, 0,
        CTX=ctx.frontend.device_context, RANK=rank, WORLD=world, COLLECTIVE="all_reduce", OP="sum", BLOCK_M=16,
        BLOCK_N=16, TRACING=True)
    ctx.check()
    report.check("calls/tile_all_reduce", torch.allclose(dst.cpu(), sum(tiles), atol=1e-5))
    xs = [torch.randn(3, 64, generator=seeded_generator("x", q)) for q in range(world)]
    residual, weight = torch.randn(3, 64, generator=seeded_generator("r")), torch.ones(64)
    normed = torch.empty(3, 64, device=device)
    ctx.ops.all_reduce_rmsnorm(normed, xs[rank].to(device), residual.to(device), weight.to(device))
    reference = torch.nn.functional.rms_norm(sum(xs) + residual, (64,), weight, 1e-6)
    report.check("calls/all_reduce_rmsnorm", torch.allclose(normed.cpu(), reference, rtol=1e-4, atol=1e-4))


def _check_events(ctx, report: RankReport, record: dict) -> None:
    """This rank's events of the traced section."""
    names = ctx.tracing.event_names()
    device = [dict(e, name=names.get(e["kind"])) for e in record["device"]]
    by_name: dict[str, list[dict]] = {}
    for e in device:
        by_name.setdefault(e["name"], []).append(e)
    peer = (ctx.rank + 1) % ctx.world_size
    puts, stores, computes = by_name.get("put", []), by_name.get("store", []), by_name.get("compute", [])
    report.check("events/put_per_program", sorted(e["program"] for e in puts) == list(range(PROGRAMS)))
    report.check("events/put_fields", all(e["target_rank"] == peer and e["op"] == 7 and e["end_ns"] >= e["start_ns"]
                                          for e in puts))
    report.check("events/put_bytes", sum(e["bytes"] for e in puts) == N * 4)
    report.check("events/store_bytes_from_mask", sorted(e["bytes"] for e in stores) == sorted(
        min(BLOCK, N - p * BLOCK) * 4 for p in range(PROGRAMS)))
    report.check("events/store_tile", all(e["tile"] == e["program"] and e["tile_n"] == 1 for e in stores))
    report.check("events/compute_instant", len([e for e in computes if e["end_ns"] == -1]) == PROGRAMS)
    reduces = by_name.get("all_reduce", [])
    report.check("events/all_reduce_calls", len({e["op"] for e in reduces}) >= 2 and all(
        e["bytes"] == 256 * 4 for e in reduces))
    for name in TRACED_CALLS:
        report.check(f"events/{name}", bool(by_name.get(name)))
    report.check("events/gemm_tiles", any(e["op"] >= 0 and e["target_rank"] == peer for e in computes))
    report.check("events/none_dropped", record["dropped"] == 0)
    host = record["host"]
    report.check("host/calls", {"iris.ccl.all_reduce", "iris.ops.matmul_reduce_scatter"} <= {n for n, _, _ in host})
    if ctx.device.type == "cpu":  # the interpreter runs a kernel inside its call, on the host's clock
        ranges = [(s, e) for n, s, e in host if n == "iris.ccl.all_reduce"]
        report.check("host/device_inside_call", all(any(s <= d["start_ns"] <= d["end_ns"] <= e for s, e in ranges)
                                                    for d in reduces))


def _worker(rank: int, path: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="16MiB")
    with report.section("traced"):
        ctx.tracing.enable(max_events=4096)
        report.check("calls/ring_put", _ring_put(ctx, True))
        _collectives(ctx, report)
        ctx.barrier()
        _check_events(ctx, report, ctx.tracing.events())
        ctx.tracing.export(path)
    with report.section("full"):
        ctx.tracing.enable(max_events=3)
        report.check("full/ring_put", _ring_put(ctx, True))
        record = ctx.tracing.events()
        report.check("full/dropped", record["appended"] > 3 and record["dropped"] == record["appended"] - 3)
        report.check("full/kept", len(record["device"]) == 3 and all(e["end_ns"] != 0 for e in record["device"]))
        report.check("full/trace_counter", int(ctx.tracing.trace_counter.item()) == record["appended"])
    with report.section("off"):
        ctx.tracing.disable()
        before = ctx.get_device_context().clone()
        report.check("off/ring_put", _ring_put(ctx, True))
        report.check("off/context_unchanged", torch.equal(ctx.get_device_context(), before))
        trace_words = [trailer_index(name, ctx.world_size) for name in ("trace_distance", "trace_capacity")]
        report.check("off/trailer_empty", ctx.get_device_context()[trace_words].tolist() == [0, 0])
        report.check("off/trace_counter", ctx.tracing.trace_counter is None)
        try:
            ctx.tracing.events()
            report.check("off/events_refused", False)
        except RuntimeError as error:
            report.check("off/events_refused", "not enabled" in str(error))
    ctx.destroy()
    return report.packed()


def test_traced_kernels_and_calls_export_one_trace_of_every_rank(tmp_path):
    path = tmp_path / "trace.json"
    reports = reports_on_available_ranks(_worker, 2, str(path))
    assert_rank_checks(reports, "calls/", {f"calls/{name}" for name in (
        "ring_put", "all_reduce0", "all_reduce1", "all_gather", "matmul_reduce_scatter", "tile_all_reduce",
        "all_reduce_rmsnorm")})
    assert_rank_checks(reports, "events/", {f"events/{name}" for name in (
        "put_per_program", "put_fields", "put_bytes", "store_bytes_from_mask", "store_tile", "compute_instant",
        "all_reduce_calls", *TRACED_CALLS, "gemm_tiles", "none_dropped")})
    on_cpu = not torch.cuda.is_available()  # where reports_on_available_ranks ran the 2 ranks
    assert_rank_checks(reports, "host/", {"host/calls"} | ({"host/device_inside_call"} if on_cpu else set()))
    assert_rank_checks(reports, "full/", {"full/completed", "full/ring_put", "full/dropped", "full/kept",
                                          "full/trace_counter"})
    assert_rank_checks(reports, "off/", {"off/completed", "off/ring_put", "off/context_unchanged",
                                         "off/trailer_empty", "off/events_refused", "off/trace_counter"})
    trace = json.loads(path.read_text())
    assert check_chrome_trace(trace, 2) == []
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"put", "store", "compute", "wait", "all_reduce", "all_gather", "matmul_reduce_scatter",
            "all_reduce_rmsnorm", "iris.ccl.all_reduce", "iris.ops.all_reduce_rmsnorm"} <= names, names
    programs = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"host", "program 0", "program 1"} <= programs, programs
    assert trace["otherData"]["dropped"] == {"0": 0, "1": 0}


# -- in-process -------------------------------------------------------------------------------------------


def test_bad_arguments_and_calls_before_enable_are_refused(ctx):
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="max_events must be a positive int"):
            ctx.tracing.enable(max_events=bad)
    for call in (ctx.tracing.events, ctx.tracing.reset, ctx.tracing.export):
        with pytest.raises(RuntimeError, match="call ctx.tracing.enable"):
            call()


def test_calls_appear_in_torch_profiler_under_readable_names(ctx):
    x = ctx.zeros(64)
    with torch.profiler.profile() as profile:
        ctx.ccl.all_reduce(x)
        ctx.barrier()
    names = {event.name for event in profile.events()}
    assert {"iris.ccl.all_reduce", "iris.barrier"} <= names, sorted(names)[:50]
    ctx.free(x)


def _event(program, start, end, kind=0):
    return {"kind": kind, "program": program, "tile": 0, "tile_n": 0, "target_rank": -1, "start_ns": start,
            "end_ns": end, "bytes": 0, "op": 0}


def test_overlapping_kernels_of_one_program_get_tracks_of_their_own():
    # Program 0 of two kernels at once (a GEMM and the kernel feeding it): [0, 100] with a wait
    # [10, 20] inside, and [50, 150], which overlaps without nesting; an instant at 60.
    events = [_event(0, 0, 100), _event(0, 10, 20), _event(0, 50, 150), _event(0, 60, -1), _event(1, 5, 6)]
    record = {"rank": 0, "device": events, "host": [("iris.x", 0, 200)], "appended": 5, "dropped": 0}
    trace = chrome_trace([record], {0: "load"})
    assert check_chrome_trace(trace, 1) == []
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert set(tracks) == {"host", "program 0", "program 0 (2)", "program 1"}
    by_start = {e["ts"] * 1e3: e for e in trace["traceEvents"] if e.get("cat") == "device"}
    assert by_start[10]["tid"] == by_start[0]["tid"] == tracks["program 0"]
    assert by_start[50]["tid"] == tracks["program 0 (2)"] and by_start[60]["ph"] == "i"
    # The checker itself finds overlaps that do not nest.
    bad = {"traceEvents": trace["traceEvents"] + [dict(by_start[50], tid=tracks["program 0"])]}
    assert any("without nesting" in p for p in check_chrome_trace(bad, 1))


def test_kernels_compiled_without_tracing_are_the_kernels_without_the_feature():
    result = run_without_interpreter(HERE / "tracing_ptx.py", timeout=600, cwd=HERE)
    assert result["errors"] == {}, "\n".join(result["errors"].values())[-5000:]
    assert set(result["kernels"]) == {"all_reduce", "gluon:all_reduce", "matmul_reduce_scatter"}
    assert all(removed > 0 for removed in result["removed"].values()), result["removed"]
    for name, ptx in result["kernels"].items():
        assert ptx["off"] == ptx["without"], f"{name}: tracing compiled out changes the PTX"
        assert ptx["on"] != ptx["off"] and ptx["on"].count("%globaltimer") > ptx["off"].count("%globaltimer"), name
