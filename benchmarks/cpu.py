"""The benchmarks on 2 CPU ranks, in one launch: what ``iris bench --cpu`` runs.

Each benchmark's ``--cpu`` run (Triton's interpreter: tiny sizes, few repeats, the host clock,
gloo instead of NCCL, GPU-only baselines left out), with the rank processes started once for all
of them: starting ranks (importing torch and Triton in each) costs more than a tiny benchmark.
Every benchmark writes its JSON (``"device": "cpu"`` in its environment) and PNG files into
``--out``; the exit status is 1 when a benchmark's check failed. The times say nothing about
speed: the run checks that the benchmarks, their checks, JSON and plots work where there is no
GPU (CI).

    python -m benchmarks.cpu [--only ccl,rma_bandwidth,fused] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import time

import iris
from benchmarks.common import require_matplotlib

#: The benchmarks that run on CPU ranks, in the order they run.
ON_CPU = ("rma_bandwidth", "ccl", "fused", "torch_collectives", "hierarchical", "compiled_tp")
#: The others, and why they do not.
NOT_ON_CPU = {
    "launch_overhead": "it measures the host's cost of launching GPU kernels",
    "rma_variants": "its variants are GPU kernel forms (the bulk tensor copy engine, TMA) at 1 GiB",
    "ccl_configs": "it compares GPU launch shapes under CUDA graphs",
    "call_overhead": "it measures one GPU's cost per call, under CUDA graphs and eagerly",
}


def _run_all(rank: int, jobs: list[tuple[str, object, tuple]]) -> list[tuple[object, float]]:
    """Every job ``(benchmark, fn, arguments)`` in turn on this rank: ``[(fn's result, seconds)]``."""
    done = []
    for name, fn, arguments in jobs:
        start = time.perf_counter()
        done.append((fn(rank, *arguments), time.perf_counter() - start))
        if rank == 0:
            print(f"{name}: measured in {done[-1][1]:.1f} s", flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(ON_CPU)}")
    parser.add_argument("--out", default=None, help="directory for JSON and PNG files (default benchmarks/runs)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(ON_CPU)
    for name in names:
        if name in NOT_ON_CPU:
            parser.error(f"{name} does not run on CPU ranks: {NOT_ON_CPU[name]}")
        if name not in ON_CPU:
            parser.error(f"unknown benchmark {name}; on CPU ranks: {', '.join(ON_CPU)}")
    require_matplotlib()
    reason = iris.registry.get_backend("triton").device_ops.unavailable_reason("cpu")
    if reason is not None:
        raise SystemExit(f"the benchmarks' Triton kernels cannot run on CPU ranks here: {reason}")
    benchmarks = []  # (name, module, its arguments, how many jobs)
    jobs = []
    for name in names:
        module = importlib.import_module(f"benchmarks.{name}")
        module_args = module.parse_args(["--cpu", *(["--out", args.out] if args.out else [])])
        module_jobs = module.jobs(module_args)
        benchmarks.append((name, module, module_args, len(module_jobs)))
        jobs += [(name, fn, arguments) for fn, arguments in module_jobs]
    start = time.perf_counter()
    print(f"{len(names)} benchmark(s) on 2 CPU ranks (Triton's interpreter: the times are not a measure of speed)",
          flush=True)
    done = iris.spawn(_run_all, 2, jobs, device="cpu")[0]
    setup = time.perf_counter() - start - sum(seconds for _, seconds in done)
    summary = []
    for name, module, module_args, count in benchmarks:
        mine, done = done[:count], done[count:]
        reported = time.perf_counter()
        print(f"\n{name}:", flush=True)
        ok = module.report(module_args, [result for result, _ in mine])
        summary.append((name, ok, sum(seconds for _, seconds in mine) + time.perf_counter() - reported))
    width = max(len("benchmark"), *(len(name) for name, _, _ in summary))
    print(f"\n{'benchmark':{width}s} {'checks':8s} {'seconds':>8s}   (CPU ranks; starting them took {setup:.1f} s)")
    for name, ok, seconds in summary:
        print(f"{name:{width}s} {'ok' if ok else 'FAILED':8s} {seconds:8.1f}")
    return 0 if all(ok for _, ok, _ in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
