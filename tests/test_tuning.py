"""Tuning of the automatic choices (``iris.tuning``): agreement across ranks, the cache, the fallbacks.

One spawn of 2 ranks makes most checks, each section with a context of its own and a cache
directory of the test's own (never the user's): timings injected per rank that disagree (each
rank alone would choose another candidate) give one choice on every rank, the argmin of the
slowest rank's figures; a candidate wrong on one rank is dropped on all; the saved cache, loaded
by a new ``create()``, changes which algorithm the automatic choice runs (a registered probe
algorithm records its calls); a mismatched, corrupt or outdated cache falls back with a warning;
``all_reduce_rmsnorm``'s method is tuned the same way (the method the kernel is launched with is
recorded); ranks that would time different candidates raise. A 3-rank spawn checks the
agreement again, and ``iris tune`` runs end to end on 2 CPU ranks.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import iris
import iris.tuning as tuning
import iris.tuning.cache as tuning_cache
from iris.collectives import (MOVED_ONLY_DTYPES, REDUCING, Algorithm, CallShape, algorithm_registry,
                              register_algorithm)
from iris.errors import IrisError
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

SMALL = 256  # bytes per rank of the tuned bucket: 64 float32
OTHER = 1024  # a second bucket
ELEMENTS = SMALL // 4


# -- algorithms registered on the ranks ------------------------------------------------------------------


def _one_shot():
    from iris_triton.collectives.kernels import ALL_REDUCE_ONE_SHOT

    return ALL_REDUCE_ONE_SHOT


#: Sizes (elements) of the calls the probe algorithm ran, in this process.
PROBE_CALLS: list[int] = []


def _probe_run(call):
    """Records the call, then runs one_shot's kernel; no repeat, so that every call is seen."""
    PROBE_CALLS.append(call.input.numel())
    _one_shot().run(call)


def _broken_run(call):
    """one_shot's result, off by one on rank 1."""
    _one_shot().run(call)
    if call.context.rank == 1:
        call.output.add_(1)


#: The launch shapes the ``shaped`` test algorithm declares, and the shape each of its calls got.
TEST_SHAPES = {device: {"narrow": {"BLOCK": 64}, "wide": {"BLOCK": 128}} for device in ("cpu", "cuda")}
SHAPED_CALLS: list[str | None] = []
#: The algorithm named in the calls after tuning ``shaped``, and the launch shape each call must get
#: (None: the automatic choice, the tuned shape; "shaped": its own choice, no shape given).
SHAPE_CHOICES = ((None, "wide"), ("shaped/narrow", "narrow"), ("shaped", None))
#: dtypes every tunable collective is tuned in: reduced and moved; moved only.
EVERY_COLLECTIVE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


def _shaped_run(call):
    """one_shot, noting the launch shape the call was given (its own shapes are not these)."""
    SHAPED_CALLS.append(call.launch_shape)
    _one_shot().run(attrs.evolve(call, launch_shape=None))


def _check_launch_shapes(ctx, report: RankReport) -> None:
    """An algorithm with two launch shapes is timed once per shape; the tuned shape reaches its
    calls, as a named one does; a shape it lacks is refused."""
    with algorithm_registry("all_reduce").restored():
        register_algorithm(Algorithm(name="shaped", collective="all_reduce", run=_shaped_run,
                                     languages=_one_shot().languages, chosen_up_to={None: 0},
                                     launch_shapes=TEST_SHAPES))
        table = ctx.ccl.tune(["all_reduce"], [torch.float32], [SMALL], save=False,
                             timer=lambda trial: 1.0 if trial.candidate == "shaped/wide" else DEFAULT_MS)
        entry = table.entries[("all_reduce", "float32", SMALL)]
        report.check("shapes/each shape a candidate", {"shaped/narrow", "shaped/wide"} <= set(entry.times))
        report.check("shapes/the fastest shape chosen", entry.chosen == "shaped/wide")
        parts = [torch.randn(ELEMENTS, generator=seeded_generator("shapes", r)) for r in range(ctx.world_size)]
        expected = torch.stack(parts).sum(0)
        for algorithm, shape in SHAPE_CHOICES:
            result = ctx.ccl.all_reduce(parts[ctx.rank].to(ctx.device, copy=True), algorithm=algorithm).cpu()
            report.check(f"shapes/{algorithm} runs with {shape}", SHAPED_CALLS[-1] == shape)
            report.check(f"shapes/{algorithm} right", torch.allclose(result, expected, atol=1e-5))
        try:
            ctx.ccl.all_reduce(parts[ctx.rank].to(ctx.device, copy=True), algorithm="shaped/huge")
            report.check("shapes/an unknown shape refused", False)
        except IrisError as error:
            report.check("shapes/an unknown shape refused", "no launch shape 'huge'" in str(error)
                         and "['narrow', 'wide']" in str(error))
    result = ctx.ccl.all_reduce(parts[ctx.rank].to(ctx.device, copy=True)).cpu()  # "shaped" is gone again
    report.check("shapes/a tuned algorithm that is gone falls back", torch.allclose(result, expected, atol=1e-5))
    from iris_triton.collectives.kernels import ALL_REDUCE_TWO_SHOT

    for name in ALL_REDUCE_TWO_SHOT.launch_shapes[ctx.device.type]:  # the collective kernel's own, by name
        result = ctx.ccl.all_reduce(parts[ctx.rank].to(ctx.device, copy=True), algorithm=f"two_shot/{name}").cpu()
        report.check(f"shapes/two_shot/{name} right", torch.allclose(result, expected, atol=1e-5))


def _fused_columns(ctx, run) -> int | None:
    """How many tile columns ``run()``'s fused matmul_reduce_scatter computed (its trace events
    say so), or None when it ran no fused kernel."""
    ctx.tracing.enable(max_events=4096)
    run()
    names = ctx.tracing.event_names()
    events = ctx.tracing.events()["device"]
    ctx.tracing.disable()
    if not any(names[e["kind"]] == "matmul_reduce_scatter" for e in events):
        return None
    return 1 + max(e["tile_n"] for e in events if names[e["kind"]] == "compute")


def _check_matmul_methods(ctx, report: RankReport) -> None:
    """matmul_reduce_scatter's methods and the fused method's tiles timed (each checked against
    torch first), the favoured one chosen, and the automatic method then the tuned one, with its
    tile, for that bucket only."""
    world, rank = ctx.world_size, ctx.rank
    rows, k, n = 16 * world, 16, 64
    table = ctx.ops.tune_matmul("matmul_reduce_scatter", n, k, [rows], save=False,
                                timer=_favouring("fused/32x32x16"))
    entry = table.entries[("matmul_reduce_scatter", "bfloat16", n, k, rows)]
    report.check("matmul/every method and tile right against torch", all(t is not None for t in entry.times.values())
                 and set(entry.times) == {"copy_engine", "sequential", "fused/16x16x16", "fused/32x32x16"})
    report.check("matmul/the favoured tile chosen", entry.chosen == "fused/32x32x16")
    a = torch.randn(rows, k, generator=seeded_generator("mm", rank)).bfloat16().to(ctx.device)
    b = torch.randn(k, n, generator=seeded_generator("mm-b")).bfloat16().to(ctx.device)
    out = torch.empty(rows // world, n, dtype=torch.bfloat16, device=ctx.device)
    report.check("matmul/tuned bucket runs the tuned tile",
                 _fused_columns(ctx, lambda: ctx.ops.matmul_reduce_scatter(out, a, b)) == n // 32)
    wide = torch.empty(rows, n, dtype=torch.bfloat16, device=ctx.device)
    columns = _fused_columns(ctx, lambda: ctx.ops.matmul_reduce_scatter(wide, torch.cat([a] * world), b))
    # CPU ranks' built-in method is fused with the 16 x 16 tile; GPUs' is the estimate's, never the tuned tile
    report.check("matmul/another bucket keeps the built-in method",
                 columns == n // 16 if ctx.device.type == "cpu" else columns != n // 32)
    try:
        ctx.ops.matmul_reduce_scatter(out, a, b, method="fused/1x1x1")
        report.check("matmul/an unknown tile refused", False)
    except IrisError as error:
        report.check("matmul/an unknown tile refused", "fused/32x32x16" in str(error))


def _register_test_algorithms() -> None:
    """A probe and a broken all_reduce, never taken by the built-in choice."""
    for name, run in (("probe", _probe_run), ("broken", _broken_run)):
        register_algorithm(Algorithm(name=name, collective="all_reduce", run=run, languages=_one_shot().languages,
                                     chosen_up_to={None: 0}), clobber=True)


# -- per-rank timings -----------------------------------------------------------------------------------

#: Milliseconds each rank's timer reports for the SMALL bucket (others: DEFAULT_MS): rank 0 alone
#: would choose low_latency, rank 1 alone two_shot; the slowest rank's figure chooses sentinel.
#: broken is fastest everywhere but wrong on rank 1.
DISAGREEING = [{"low_latency": 1.0, "two_shot": 9.0, "sentinel": 3.0, "broken": 0.5},
               {"low_latency": 9.0, "two_shot": 1.0, "sentinel": 3.0, "broken": 0.5},
               {"low_latency": 2.0, "two_shot": 2.0, "sentinel": 4.0, "broken": 0.5}]
DEFAULT_MS = 5.0


def _disagreeing_timer(rank: int):
    def timer(trial: tuning.Trial) -> float:
        if trial.bucket == (OTHER,):
            return 2.0  # every candidate ties on every rank
        return DISAGREEING[rank].get(trial.candidate, DEFAULT_MS)

    return timer


def _favouring(name: str):
    """A timer under which ``name`` is fastest on every rank."""
    return lambda trial: 1.0 if trial.candidate == name else DEFAULT_MS


def _argmin(times: dict[str, float]) -> str:
    return min(times, key=times.get)  # the first of equal times, in the candidates' order


def _check_agreement(ctx, report: RankReport, label: str) -> None:
    """Tune all_reduce float32 in two buckets with the disagreeing timer, and check the decision
    against the argmin of the slowest rank's figures, computed here from every rank's timer."""
    world = ctx.world_size
    table = ctx.ccl.tune(["all_reduce"], [torch.float32], [SMALL, OTHER], timer=_disagreeing_timer(ctx.rank))
    probe = torch.empty(ELEMENTS, device="meta")
    candidates = ctx.ccl.algorithms("all_reduce", applying_to=probe, op="sum")
    right = [c for c in candidates if c != "broken"]
    slowest = {c: max(DISAGREEING[r].get(c, DEFAULT_MS) for r in range(world)) for c in right}
    expected = _argmin(slowest)
    alone = [_argmin({c: DISAGREEING[r].get(c, DEFAULT_MS) for c in right}) for r in range(world)]
    report.check(f"{label}/each rank alone would choose otherwise", expected not in alone)
    entry = table.entries[("all_reduce", "float32", SMALL)]
    report.check(f"{label}/chosen is the argmin of the slowest rank", entry.chosen == expected)
    report.check(f"{label}/times are the slowest rank's",
                 all(entry.times[c] == pytest.approx(slowest[c]) for c in right))
    report.check(f"{label}/wrong candidate dropped", "broken" not in candidates or entry.times["broken"] is None)
    tie = table.entries[("all_reduce", "float32", OTHER)]
    report.check(f"{label}/a tie takes the first right candidate", tie.chosen == right[0])
    chosen = ctx.comm.all_gather_object((entry.chosen, tie.chosen))
    report.check(f"{label}/the same on every rank", all(c == chosen[0] for c in chosen))
    shape = CallShape(collective="all_reduce", nbytes=SMALL, world_size=world, dtype=torch.float32,
                      device_type=ctx.device.type, language=ctx.kernel_language, op="sum")
    report.check(f"{label}/in force on the context", ctx.tuning.algorithm(shape).name == expected)


# -- the 2-rank checks ----------------------------------------------------------------------------------


def _all_reduce_runs_probe(ctx, elements: int, seed) -> tuple[bool, bool]:
    """(whether an automatic all_reduce of ``elements`` float32 ran the probe, whether it was right)."""
    parts = [torch.randn(elements, generator=seeded_generator(*seed, r)) for r in range(ctx.world_size)]
    before = len(PROBE_CALLS)
    result = ctx.ccl.all_reduce(parts[ctx.rank].to(ctx.device, copy=True)).cpu()
    return len(PROBE_CALLS) > before, torch.allclose(result, torch.stack(parts).sum(0), atol=1e-5)


class _Warnings(logging.Handler):
    """The warnings of the iris loggers while installed."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _fallback(ctx_options: dict, report: RankReport, label: str, contents: str | None, warned: str) -> None:
    """With ``contents`` as the cache file (rank 0 writes it), a new context warns (rank 0,
    a message containing ``warned``) and its automatic all_reduce is the built-in one."""
    probe_ctx = iris.create(**ctx_options)
    path = tuning.cache_directory() / probe_ctx.tuning.key.file_name
    if probe_ctx.rank == 0 and contents is not None:
        path.write_text(contents)
    probe_ctx.barrier()
    probe_ctx.destroy()
    handler = _Warnings()
    logging.getLogger("iris").addHandler(handler)
    try:
        ctx = iris.create(**ctx_options)
    finally:
        logging.getLogger("iris").removeHandler(handler)
    try:
        if ctx.rank == 0:
            report.check(f"{label}/warned", any(warned in m and str(path) in m for m in handler.messages))
        ran, right = _all_reduce_runs_probe(ctx, ELEMENTS, label)
        report.check(f"{label}/built-in choice", not ran and right)
    finally:
        ctx.destroy()


#: The cache files a new context falls back from, in the order the worker writes them.
FALLBACKS = ("mismatched key", "corrupt", "vanished algorithm")


def _rmsnorm_reference(xs, residual, weight, eps=1e-6):
    s = torch.stack(xs).sum(0) + residual
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rmsnorm_method(ctx, tokens: int, hidden: int) -> tuple[str, bool]:
    """(the method an automatic all_reduce_rmsnorm of ``tokens x hidden`` float32 launched, whether it was right)."""
    import iris_triton.operations.rmsnorm as rmsnorm

    g = seeded_generator("rmsnorm", tokens, hidden)
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(ctx.world_size)]
    residual, weight = torch.randn(tokens, hidden, generator=g), torch.randn(hidden, generator=g)
    launched = []
    signature = rmsnorm._signature
    rmsnorm._signature = lambda method, *rest: launched.append(method) or signature(method, *rest)
    try:
        out = torch.empty(tokens, hidden, device=ctx.device)
        ctx.ops.all_reduce_rmsnorm(out, xs[ctx.rank].to(ctx.device), residual.to(ctx.device), weight.to(ctx.device))
    finally:
        rmsnorm._signature = signature
    right = torch.allclose(out.cpu(), _rmsnorm_reference(xs, residual, weight), atol=1e-4, rtol=1e-4)
    return launched[0], right


def _two_rank_checks(rank: int, cache: str) -> bytes:
    os.environ[tuning.CACHE_ENV] = cache
    report = RankReport(rank)
    _register_test_algorithms()
    options = dict(heap_size="32MiB")
    with report.section("agreement"):
        ctx = iris.create(**options)
        ran, right = _all_reduce_runs_probe(ctx, ELEMENTS, "before")
        report.check("agreement/probe is not the built-in choice", not ran and right)
        _check_agreement(ctx, report, "agreement")
        ctx.destroy()
    with report.section("cache"):
        ctx = iris.create(**options)
        ctx.ccl.tune(["all_reduce"], ["float32"], [SMALL], timer=_favouring("probe"))
        ran, right = _all_reduce_runs_probe(ctx, ELEMENTS, "tuned")
        report.check("cache/the tuning is in force where it ran", ran and right)
        ctx.destroy()
        ctx = iris.create(**options)
        ran, right = _all_reduce_runs_probe(ctx, ELEMENTS, "loaded")
        report.check("cache/a new context runs the tuned algorithm", ran and right)
        ran, right = _all_reduce_runs_probe(ctx, 2 * ELEMENTS, "untuned bucket")
        report.check("cache/an untuned bucket takes the built-in choice", not ran and right)
        saved = (tuning.cache_directory() / ctx.tuning.key.file_name).read_text()
        ctx.destroy()
        os.environ[tuning.SWITCH_ENV] = "off"
        ctx = iris.create(**options)
        ran, right = _all_reduce_runs_probe(ctx, ELEMENTS, "off")
        report.check("cache/IRIS_TUNING=off leaves it unread", not ran and right)
        ctx.destroy()
        del os.environ[tuning.SWITCH_ENV]
    with report.section("fallback"):
        data = json.loads(saved)
        data["key"]["world_size"] = 5
        _fallback(options, report, f"fallback/{FALLBACKS[0]}", json.dumps(data), "was made for")
        _fallback(options, report, f"fallback/{FALLBACKS[1]}", saved[: len(saved) // 2], "cannot be read")
        data = json.loads(saved)
        for entry in data["entries"]:
            entry["chosen"] = "vanished"
        _fallback(options, report, f"fallback/{FALLBACKS[2]}", json.dumps(data), "not installed")
    with report.section("rmsnorm"):
        ctx = iris.create(**options)
        tokens, hidden = 2, 32
        report.check("rmsnorm/built-in method", _rmsnorm_method(ctx, tokens, hidden) == ("one_shot", True))
        times = [{"one_shot": 1.0, "two_shot": 2.0}, {"one_shot": 4.0, "two_shot": 3.0}]
        table = ctx.ops.tune(hidden, [tokens], ["float32"], timer=lambda trial: times[rank][trial.candidate])
        entry = table.entries[("all_reduce_rmsnorm", "float32", hidden, tokens)]
        report.check("rmsnorm/chosen by the slowest rank", entry.chosen == "two_shot" and entry.times == {
            "one_shot": pytest.approx(4.0), "two_shot": pytest.approx(3.0)})
        report.check("rmsnorm/tuned method runs", _rmsnorm_method(ctx, tokens, hidden) == ("two_shot", True))
        report.check("rmsnorm/untuned bucket", _rmsnorm_method(ctx, 3, hidden) == ("one_shot", True))
        ctx.destroy()
        ctx = iris.create(**options)
        report.check("rmsnorm/loaded by a new context", _rmsnorm_method(ctx, tokens, hidden) == ("two_shot", True))
        ctx.destroy()
    with report.section("every collective"):
        ctx = iris.create(**options)
        dtypes = EVERY_COLLECTIVE_DTYPES
        table = ctx.ccl.tune(tuning.TUNABLE, dtypes, [SMALL], timer=_favouring("direct"), save=False)
        for collective in tuning.TUNABLE:
            for dtype in dtypes:
                if collective in REDUCING and dtype in MOVED_ONLY_DTYPES:
                    continue
                entry = table.entries.get((collective, str(dtype).removeprefix("torch."), SMALL))
                report.check(f"every collective/{collective} {dtype}: every candidate right against torch",
                             entry is not None and all(ms is not None for name, ms in entry.times.items()
                                                       if name != "broken"))
        ctx.destroy()
    with report.section("matmul"):
        ctx = iris.create(**options)
        _check_matmul_methods(ctx, report)
        ctx.destroy()
    with report.section("shapes"):
        ctx = iris.create(**options)
        _check_launch_shapes(ctx, report)
        ctx.destroy()
    with report.section("plans"):
        ctx = iris.create(**options)
        with algorithm_registry("all_reduce").restored():
            if rank == 1:
                register_algorithm(Algorithm(name="only_here", collective="all_reduce", run=_probe_run,
                                             languages=_one_shot().languages))
            try:
                ctx.ccl.tune(["all_reduce"], ["float32"], [SMALL], timer=_favouring("probe"), save=False)
                report.check("plans/different candidates raise", False)
            except IrisError as error:
                report.check("plans/different candidates raise",
                             "rank 1" in str(error) and "only_here" in str(error))
        ctx.destroy()
    return report.packed()


def _agreement_names(label: str) -> set[str]:
    """The checks of :func:`_check_agreement` under ``label``."""
    return {f"{label}/{check}" for check in (
        "each rank alone would choose otherwise", "chosen is the argmin of the slowest rank",
        "times are the slowest rank's", "wrong candidate dropped", "a tie takes the first right candidate",
        "the same on every rank", "in force on the context")}


def test_on_two_ranks(tmp_path):
    from iris_triton.collectives.kernels import ALL_REDUCE_TWO_SHOT

    reports = reports_on_available_ranks(_two_rank_checks, 2, str(tmp_path), timeout=120)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # where reports_on_available_ranks ran them
    assert_rank_checks(reports, "agreement/", _agreement_names("agreement") | {
        "agreement/probe is not the built-in choice", "agreement/completed"})
    assert_rank_checks(reports, "cache/", {f"cache/{check}" for check in (
        "the tuning is in force where it ran", "a new context runs the tuned algorithm",
        "an untuned bucket takes the built-in choice", "IRIS_TUNING=off leaves it unread", "completed")})
    # Rank 0 wrote each cache file, and its new context warns.
    assert_rank_checks(reports, "fallback/", lambda rank: {f"fallback/{case}/built-in choice" for case in FALLBACKS} | (
        {f"fallback/{case}/warned" for case in FALLBACKS} if rank == 0 else set()) | {"fallback/completed"})
    assert_rank_checks(reports, "rmsnorm/", {f"rmsnorm/{check}" for check in (
        "built-in method", "chosen by the slowest rank", "tuned method runs", "untuned bucket",
        "loaded by a new context", "completed")})
    assert_rank_checks(reports, "every collective/", {
        f"every collective/{collective} {dtype}: every candidate right against torch" for collective in tuning.TUNABLE
        for dtype in EVERY_COLLECTIVE_DTYPES if not (collective in REDUCING and dtype in MOVED_ONLY_DTYPES)} | {
        "every collective/completed"})
    assert_rank_checks(reports, "matmul/", {f"matmul/{check}" for check in (
        "every method and tile right against torch", "the favoured tile chosen", "tuned bucket runs the tuned tile",
        "another bucket keeps the built-in method", "an unknown tile refused", "completed")})
    assert_rank_checks(reports, "shapes/", {f"shapes/{algorithm} {check}" for algorithm, shape in SHAPE_CHOICES
                                            for check in (f"runs with {shape}", "right")} | {
        f"shapes/two_shot/{name} right" for name in ALL_REDUCE_TWO_SHOT.launch_shapes[device_type]} | {
        f"shapes/{check}" for check in ("each shape a candidate", "the fastest shape chosen",
                                        "an unknown shape refused", "a tuned algorithm that is gone falls back",
                                        "completed")})
    assert_rank_checks(reports, "plans/", {"plans/different candidates raise", "plans/completed"})


def _three_rank_checks(rank: int, cache: str) -> bytes:
    os.environ[tuning.CACHE_ENV] = cache
    report = RankReport(rank)
    with report.section("world3"):
        ctx = iris.create(heap_size="32MiB")
        _check_agreement(ctx, report, "world3")
        ctx.destroy()
    return report.packed()


def test_world3_agreement(tmp_path):
    reports = reports_on_available_ranks(_three_rank_checks, 3, str(tmp_path), timeout=120)
    assert_rank_checks(reports, "world3/", _agreement_names("world3") | {"world3/completed"})


# -- iris tune ------------------------------------------------------------------------------------------


def test_iris_tune_on_two_cpu_ranks(tmp_path):
    beside = Path(sys.executable).parent / "iris"
    executable = str(beside) if beside.is_file() else shutil.which("iris")
    env = dict(os.environ, IRIS_TUNING_CACHE=str(tmp_path))
    proc = subprocess.run([executable, "tune", "--nprocs", "2", "--device", "cpu", "--collectives", "all_reduce",
                           "--dtypes", "float32", "--sizes", "200", "--repeats", "1", "--rmsnorm-hidden", "32",
                           "--rmsnorm-tokens", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (saved,) = tmp_path.glob("*.json")
    data = json.loads(saved.read_text())
    assert data["key"]["device"] == "cpu" and data["key"]["world_size"] == 2
    entries = {(e["what"], tuple(e["bucket"])): e for e in data["entries"]}
    assert set(entries) == {("all_reduce", (SMALL,)), ("all_reduce_rmsnorm", (32, 2))}
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.startswith("all_reduce")}
    for (what, _), entry in entries.items():
        timed = {name: ms for name, ms in entry["times"].items() if ms is not None}
        assert entry["chosen"] == min(timed, key=timed.get)
        assert rows[what][4 if what == "all_reduce" else 5] == entry["chosen"]
    assert str(saved) in proc.stdout


# -- in one process -------------------------------------------------------------------------------------


def test_buckets_are_powers_of_two_from_above():
    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 255, 256, 257)] == [0, 1, 2, 4, 256, 256, 512]


def _table() -> tuning.TuningTable:
    key = tuning.CacheKey(device="cpu", world_size=2, topology="shared-memory", iris_version="1")
    return tuning.TuningTable(key, {
        ("all_reduce", "float32", SMALL): tuning.Entry("one_shot", {"low_latency": 2.5, "one_shot": 1.5,
                                                                    "broken": None}),
        ("all_reduce_rmsnorm", "bfloat16", 4096, 16): tuning.Entry("two_shot", {"one_shot": 3.0, "two_shot": 2.0}),
    })


def test_the_table_survives_json_and_malformed_files_are_refused():
    table = _table()
    assert tuning.TuningTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    for spoil in (lambda d: d.update(format=99), lambda d: d["key"].pop("topology"),
                  lambda d: d["entries"][0].update(bucket="256"), lambda d: d["entries"][0].update(dtype="int3"),
                  lambda d: d["entries"][1]["times"].update(one_shot="fast"), lambda d: d.update(entries={"a": 1})):
        data = table.to_json()
        spoil(data)
        with pytest.raises(ValueError):
            tuning.TuningTable.from_json(json.loads(json.dumps(data)))


def test_lookups_fall_back_where_the_entry_does_not_apply():
    from iris_triton.collectives.kernels import ALL_REDUCE_ONE_SHOT

    table = _table()

    def shape(**changes):
        values = dict(collective="all_reduce", nbytes=SMALL - 4, world_size=2, dtype=torch.float32,
                      device_type="cpu", language=next(iter(ALL_REDUCE_ONE_SHOT.languages)), op="sum")
        return CallShape(**(values | changes))

    assert table.algorithm(shape()) is ALL_REDUCE_ONE_SHOT
    assert table.algorithm(shape(nbytes=SMALL + 4)) is None  # another bucket
    assert table.algorithm(shape(world_size=3)) is None
    assert table.algorithm(shape(dtype=torch.bfloat16)) is None
    assert table.algorithm(shape(language="no such language")) is None  # the algorithm does not apply
    methods = ("one_shot", "two_shot")
    assert table.method("all_reduce_rmsnorm", methods, 2, torch.bfloat16, (4096,), 9) == "two_shot"
    assert table.method("all_reduce_rmsnorm", methods, 2, torch.bfloat16, (4096,), 17) is None
    assert table.method("all_reduce_rmsnorm", ("one_shot",), 2, torch.bfloat16, (4096,), 16) is None


def test_the_cache_directory_and_switch(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_directory() == tmp_path / "xdg" / "iris" / "tuning"
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "mine"))
    assert tuning.cache_directory() == tmp_path / "mine"
    for value, enabled in (("off", False), ("0", False), ("on", True), ("", True)):
        monkeypatch.setenv(tuning.SWITCH_ENV, value)
        assert tuning.loading_enabled() is enabled
    monkeypatch.setenv(tuning.SWITCH_ENV, "sometimes")
    with pytest.raises(ValueError, match="IRIS_TUNING"):
        tuning.loading_enabled()


def test_keys_name_distinct_files():
    key = _table().key
    other = tuning.CacheKey(device="cpu", world_size=4, topology="shared-memory", iris_version="1")
    assert key.file_name != other.file_name and key.file_name.startswith("cpu-2ranks-")


def test_the_printed_table_lists_every_candidate():
    text = tuning.format_table(_table())
    row = next(line for line in text.splitlines() if line.startswith("all_reduce "))
    assert row.split()[4] == "one_shot"
    assert "low_latency 2.5000 ms" in row and "broken dropped" in row


TOPO = ("\t\x1b[4mGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
        "GPU0\t X \tNV18\tPIX\tSYS\t0-47\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tNV18\tSYS\t0-47\t0\t\tN/A\n"
        "GPU2\tPIX\tNV18\t X \tSYS\t0-47\t0\t\tN/A\n"
        "NIC0\tSYS\tSYS\tSYS\t X \t\t\t\t\n\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set "
        "of # NVLinks\n")


def test_the_link_types_are_read_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(tuning_cache.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(tuning_cache.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, TOPO, ""))
    assert tuning_cache._nvidia_smi_links() == "NV18,PIX"
    monkeypatch.setattr(tuning_cache.shutil, "which", lambda name: None)
    assert tuning_cache._nvidia_smi_links() == "unknown"
