"""What every benchmark records beside its figures: when, where, and with which versions."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

RUNS_DIR = Path(__file__).resolve().parent / "runs"


def environment() -> dict[str, Any]:
    """Date, machine and software versions of this run."""
    import triton

    import iris

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "iris": iris.__version__,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["cpus"] = os.cpu_count()
    return info


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min and max of a list of timings."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def write_results(name: str, payload: dict[str, Any], out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``payload`` plus the environment as ``<name>-<date>.json``; returns the path."""
    record = {"benchmark": name, "environment": environment(), **payload}
    directory = Path(out_dir) if out_dir else RUNS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stamp = record["environment"]["date"][:10]
    path = directory / f"{name}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def _warmed_graph(fn, calls: int, stream) -> "torch.cuda.CUDAGraph":
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


def per_call_us(ctx, fn, calls: int, repeats: int, graph: bool) -> float:
    """This rank's median time per call of ``fn`` in microseconds: ``calls`` calls back to back
    between two CUDA events (captured as one CUDA graph when ``graph``, else launched eagerly),
    ``repeats`` times, each after a host barrier of every rank."""
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
    slow drifts of the clocks (a GPU warming up under a long product) hit every one alike."""
    stream = torch.cuda.Stream(ctx.device)
    graphs = {name: _warmed_graph(fn, calls, stream) for name, fn in fns.items()}
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, graph in graphs.items():
            samples[name].append(_sample_us(ctx, graph.replay, calls))
    return {name: statistics.median(values) for name, values in samples.items()}
