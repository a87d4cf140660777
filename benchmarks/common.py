"""What every benchmark records beside its figures (when, where, and with which versions), and
how it times a call: CUDA events (and CUDA graphs) on GPU ranks, the host clock on CPU ranks.

On CPU ranks (``--cpu``: Triton's interpreter runs the kernels, ``TRITON_INTERPRET=1``) the
figures say nothing about speed; such a run checks that the benchmarks, their checks, JSON and
plots work, on machines without GPUs (CI).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from iris.config import parse_size

RUNS_DIR = Path(__file__).resolve().parent / "runs"
#: What a run on CPU ranks measures, in its JSON.
CPU_CAVEAT = "kernels run in Triton's interpreter (TRITON_INTERPRET=1): the times check the plumbing, not the speed"


def default_device() -> str:
    """``"cuda"`` where a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def environment(device: str | None = None) -> dict[str, Any]:
    """Date, machine and software versions of this run, whose ranks ran on ``device``
    (``"cuda"`` or ``"cpu"``; default: GPUs where one is visible)."""
    import numpy
    import triton

    import iris

    device = device or default_device()
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "iris": iris.__version__,
    }
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["cpus"] = os.cpu_count()
        info["numpy"] = numpy.__version__
        info["note"] = CPU_CAVEAT
    return info


def ranks_label(device: str, world: int = 2) -> str:
    """Where the ranks ran, for a plot's title: ``2 x NVIDIA H200`` or ``2 CPU ranks (...)``."""
    if device == "cuda":
        names = sorted({torch.cuda.get_device_name(i) for i in range(min(world, torch.cuda.device_count()))})
        return f"{world} x {' + '.join(names)}"
    return f"{world} CPU ranks (Triton's interpreter: not a measure of speed)"


def require_matplotlib() -> None:
    """Exit with a message naming the ``bench`` extra where matplotlib (the plots) is missing;
    called before anything is measured."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("the benchmarks draw their plots with matplotlib, which is not installed: "
                         "pip install 'iris[bench]' (or pip install matplotlib)") from None


#: Bytes per rank above which a timed sample holds :data:`LARGE_CALLS` calls: one call takes long
#: enough by itself there.
LARGE_BYTES = 32 << 20
LARGE_CALLS = 4


def calls_per_sample(calls: int, size: int) -> int:
    """The calls per timed sample at ``size`` bytes per rank: ``calls``, or :data:`LARGE_CALLS`
    above :data:`LARGE_BYTES`."""
    return calls if size <= LARGE_BYTES else LARGE_CALLS


def size_ladder(smallest: str, largest: str, step: int = 8) -> list[int]:
    """Sizes in bytes from ``smallest`` up to ``largest`` (sizes such as ``"8KiB"``), each ``step``
    times the one before."""
    sizes, size = [], parse_size(smallest)
    while size <= parse_size(largest):
        sizes.append(size)
        size *= step
    return sizes


def add_device_option(parser: argparse.ArgumentParser) -> None:
    """``--cpu``: 2 CPU ranks instead of 2 GPUs."""
    parser.add_argument("--cpu", action="store_true",
                        help="2 CPU ranks (Triton's interpreter) instead of 2 GPUs, with tiny defaults: checks "
                             "the benchmark, its JSON and plots; the times are not a measure of speed")


def add_sampling_options(parser: argparse.ArgumentParser, defaults: dict[str, dict[str, Any]]) -> None:
    """``--calls`` and ``--repeats`` (their help gives each device type's default in ``defaults``),
    ``--out`` and ``--cpu``: the options every benchmark that times calls shares."""
    for option, what in (("calls", "calls per timed sample"), ("repeats", "samples per figure")):
        parser.add_argument(f"--{option}", type=int, default=None,
                            help=f"{what} (default {defaults['cuda'][option]}; {defaults['cpu'][option]} with --cpu)")
    parser.add_argument("--out", default=None, help="directory for the results (default benchmarks/runs)")
    add_device_option(parser)


def resolve(args: argparse.Namespace, defaults: dict[str, dict[str, Any]]) -> argparse.Namespace:
    """Set ``args.device`` (``"cpu"`` with ``--cpu``, else ``"cuda"``) and every option left
    unset (None) to its default on that device: ``defaults[device]``."""
    args.device = "cpu" if args.cpu else "cuda"
    for key, value in defaults[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def spawn_jobs(args: argparse.Namespace, jobs: list[tuple[Callable, tuple]]) -> list:
    """Run each of ``jobs`` (``(fn, arguments)``: ``fn(rank, *arguments)`` on every rank) on 2
    fresh ranks on ``args.device``; rank 0's results. ``python -m benchmarks.cpu`` runs the jobs
    of several benchmarks in one launch instead."""
    import iris

    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"the benchmark measures 2 GPUs; {torch.cuda.device_count()} visible (--cpu: CPU ranks)")
    return [iris.spawn(fn, 2, *arguments, device=args.device)[0] for fn, arguments in jobs]


def run_command_line(argv: list[str] | None, parse_args: Callable, jobs: Callable, report: Callable,
                     failure: str) -> None:
    """A benchmark module's ``main``: parse ``argv``, run its jobs on 2 fresh ranks and report;
    exits with ``failure`` when a result failed its check."""
    args = parse_args(argv)
    require_matplotlib()
    if not report(args, spawn_jobs(args, jobs(args))):
        raise SystemExit(failure)


def run_as_this_rank(args: argparse.Namespace, job: Callable, report: Callable, failure: str) -> None:
    """A ``main`` for benchmarks whose process is one rank (of ``torchrun``'s world, or a world of
    one on one GPU), or which run on 2 fresh CPU ranks with ``--cpu``: ``job(args)`` gives the
    function every rank runs and its arguments after the rank; rank 0 passes the rows it returns
    to ``report(args, rows)``, and the process exits with ``failure`` when a result failed its check."""
    fn, arguments = job(args)
    if args.device == "cpu":
        rows = spawn_jobs(args, [(fn, arguments)])[0]
    else:
        rank = int(os.environ.get("RANK", "0"))
        rows = fn(rank, *arguments)
        if rank != 0:
            return
    if not report(args, rows):
        raise SystemExit(failure)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``; nothing to wait for on CPU ranks, whose kernels
    (Triton's interpreter) have run when their launch returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min and max of a list of timings."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def write_results(name: str, payload: dict[str, Any], out_dir: str | os.PathLike | None = None,
                  device: str | None = None) -> Path:
    """Write ``payload`` plus the environment (ranks on ``device``, see :func:`environment`) as
    ``<name>-<date>.json``; returns the path."""
    record = {"benchmark": name, "environment": environment(device), **payload}
    directory = Path(out_dir) if out_dir else RUNS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stamp = record["environment"]["date"][:10]
    path = directory / f"{name}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _sample_us(ctx, launch, calls: int) -> float:
    """Microseconds per call of ``launch()`` (which runs ``calls`` calls) between two CUDA events,
    after a host barrier of every rank."""
    ctx.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _host_sample_us(ctx, fn, calls: int) -> float:
    """Microseconds per call of ``fn`` by the host clock over ``calls`` calls, after a host
    barrier of every rank."""
    ctx.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) * 1e6 / calls


def host_per_call_us(ctx, fn, calls: int, repeats: int) -> float:
    """This rank's median host time per call of ``fn`` in microseconds: ``calls`` calls back to
    back by the host clock, ``repeats`` times, each after a host barrier of every rank. On GPUs it
    is what the host spends enqueuing the calls (nothing waits for the device), beside
    :func:`per_call_us`'s figure, which the device's events also bound."""
    return statistics.median(_host_sample_us(ctx, fn, calls) for _ in range(repeats))


def host_work_us(ctx, call, bare, calls: int, repeats: int) -> dict[str, float]:
    """By the host clock, this rank's median time per call of ``call`` and of ``bare`` (the same
    device work launched without ``call``'s own host work) and the median of their differences,
    in microseconds: ``calls`` calls of each in turn, ``repeats`` times, each sample starting with
    the device idle, after a host barrier of every rank. Taken in pairs, so that a host whose speed
    drifts during the run (another process, a clock) slows both sides of a difference alike."""
    pairs = []
    for _ in range(repeats):
        synchronize(ctx.device)
        mine = _host_sample_us(ctx, call, calls)
        synchronize(ctx.device)
        pairs.append((mine, _host_sample_us(ctx, bare, calls)))
    return {"host_call_us": statistics.median(mine for mine, _ in pairs),
            "host_bare_us": statistics.median(theirs for _, theirs in pairs),
            "host_work_us": statistics.median(mine - theirs for mine, theirs in pairs)}


def per_call_us(ctx, fn, calls: int, repeats: int, graph: bool) -> float:
    """This rank's median time per call of ``fn`` in microseconds: ``calls`` calls back to back
    between two CUDA events (captured as one CUDA graph when ``graph``, else launched eagerly),
    ``repeats`` times, each after a host barrier of every rank.

    On CPU ranks the calls are timed by the host clock (``time.perf_counter``), without the
    warm-up calls (the interpreter compiles nothing; call ``fn`` once before, as the checks
    do), and ``graph`` must be False: CUDA graphs need GPUs."""
    if ctx.device.type != "cuda":
        if graph:
            raise ValueError("CUDA graphs need GPU ranks; time CPU ranks' calls with graph=False")
        return statistics.median(_host_sample_us(ctx, fn, calls) for _ in range(repeats))
    if graph:
        return interleaved_per_call_us(ctx, {"fn": fn}, calls, repeats)["fn"]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()

    def eagerly():
        for _ in range(calls):
            fn()

    return statistics.median(_sample_us(ctx, eagerly, calls) for _ in range(repeats))


def interleaved_per_call_us(ctx, fns: dict, calls: int, repeats: int) -> dict[str, float]:
    """This rank's median time per call of each of ``fns`` (``{name: callable}``) in
    microseconds, under CUDA graphs: each is captured once (``calls`` calls in one graph), then
    every repeat replays each graph once, in turn, after a host barrier of every rank, so that
    slow drifts of the clocks (a GPU warming up under a long product) hit every one alike.
    On CPU ranks each is called eagerly instead, timed by the host clock (no warm-up: call each
    once before)."""
    if ctx.device.type != "cuda":
        samples = {name: [] for name in fns}
        for _ in range(repeats):
            for name, fn in fns.items():
                samples[name].append(_host_sample_us(ctx, fn, calls))
        return {name: statistics.median(values) for name, values in samples.items()}
    stream = torch.cuda.Stream(ctx.device)
    return replayed_per_call_us(ctx, {name: captured(fn, calls, stream) for name, fn in fns.items()}, calls, repeats)


def captured(fn, calls: int, stream) -> torch.cuda.CUDAGraph:
    """``fn`` run three times (compiling, sizing workspaces), then ``calls`` calls of it captured
    on ``stream`` as one CUDA graph."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph


def replayed_per_call_us(ctx, graphs: dict, calls: int, repeats: int) -> dict[str, float]:
    """This rank's median time per call of each of ``graphs`` (``{name: CUDA graph of calls
    calls}``, from :func:`captured`), every repeat replaying each once, in turn, after a host
    barrier of every rank (as :func:`interleaved_per_call_us`)."""
    samples = {name: [] for name in graphs}
    for _ in range(repeats):
        for name, graph in graphs.items():
            samples[name].append(_sample_us(ctx, graph.replay, calls))
    return {name: statistics.median(values) for name, values in samples.items()}


def in_place(buf, x, call):
    """An in-place implementation on ``buf``: ``(timed call, checked call, output)``, checked from
    a copy of ``x``, timed on ``buf`` as it is."""
    return call, lambda: (buf.copy_(x), call()), buf


def slowest_per_call_us(ctx, fns: dict, mode: str, calls: int, repeats: int) -> dict[str, float]:
    """Each of ``fns``'s (``{name: callable}``) median time per call in microseconds on the
    slowest rank: under CUDA graphs, replayed in turn (``mode == "graph"``), or called eagerly
    one after another (``"eager"``)."""
    if mode == "graph":
        mine = interleaved_per_call_us(ctx, fns, calls, repeats)
    else:
        mine = {name: per_call_us(ctx, fn, calls, repeats, graph=False) for name, fn in fns.items()}
    everyone = ctx.comm.all_gather_object(mine)
    return {name: max(rank[name] for rank in everyone) for name in fns}


#: How a result file's calls were timed, per device type: what :func:`write_checked_rows` records.
TIMING = {"cuda": "CUDA events around the calls, graph: captured as one CUDA graph per implementation, replayed "
                  "in turn",
          "cpu": "host clock (time.perf_counter) around eager calls"}


def write_checked_rows(name: str, args: argparse.Namespace, payload: dict[str, Any]) -> bool:
    """Write ``payload`` (its ``rows`` each with ``correct``: implementation -> bool) as ``name``'s
    results of a run on ``args.device`` (``name-cpu`` on CPU ranks, where CUDA graphs are left
    out), with how the calls were timed, and say where; whether every implementation of every row
    matched the reference."""
    payload = {**payload, "timing": TIMING[args.device]}
    if args.device == "cpu":
        payload["left_out"] = {"graph": "CUDA graphs need GPU ranks"}
    path = write_results(name + ("-cpu" if args.device == "cpu" else ""), payload, args.out, args.device)
    print(f"wrote {path}")
    return all(all(row["correct"].values()) for row in payload["rows"])
