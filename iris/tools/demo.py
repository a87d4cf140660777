"""``iris demo``: ranks, a symmetric heap, a kernel writing into peers' memory, and every collective,
each checked against torch, with timings.

Spawns one rank per GPU (two CPU ranks when no GPU is visible). Each rank allocates on the heap,
runs the backend's own demo steps (the Triton backend: a kernel storing into the right
neighbour's heap), crosses a device-side barrier, then runs every collective of ``ctx.ccl`` (every
registered all_reduce algorithm) on random data and compares the result with a torch reference
built from every rank's input. Rank 0 prints one
line per step as soon as every rank finished it: whether every rank got it right, and the slowest
rank's time (first calls, so compilation is included).
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import torch

import iris

#: Elements per rank of the demo's tensors (divisible by any small world size's segments).
ELEMENTS = 4096 * 3


def _timed(fn: Callable[[], bool]) -> tuple[bool, float]:
    start = time.perf_counter()
    ok = fn()
    return bool(ok), time.perf_counter() - start


def _inputs(world: int, device) -> list[torch.Tensor]:
    """Every rank's input, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(2026)
    return [torch.randn(ELEMENTS, generator=g).to(device) for _ in range(world)]


def _collectives(ctx, inputs) -> dict[str, Callable[[], bool]]:
    """``{step: check}`` for every collective, against torch on the gathered inputs."""
    rank, world = ctx.rank, ctx.world_size
    mine, stacked = inputs[rank], torch.stack(inputs)
    share = ELEMENTS // world

    def close(result, expected) -> bool:
        ctx.barrier()
        return torch.allclose(result, expected, rtol=1e-4, atol=1e-4)

    def all_reduce(algorithm: str | None, op: str) -> bool:
        expected = {"sum": stacked.sum(0), "max": stacked.max(0).values}[op]
        return close(ctx.ccl.all_reduce(mine.clone(), op, algorithm=algorithm), expected)

    steps = {f"all_reduce (sum, {name})": functools.partial(all_reduce, name, "sum")
             for name in ctx.ccl.algorithms("all_reduce", applying_to=mine)}
    return steps | {
        "all_reduce (max, automatic choice)": lambda: all_reduce(None, "max"),
        "all_gather": lambda: close(ctx.ccl.all_gather(torch.empty(world, ELEMENTS, device=ctx.device), mine),
                                    stacked),
        "reduce_scatter": lambda: close(ctx.ccl.reduce_scatter(torch.empty(share, device=ctx.device), mine),
                                        stacked.sum(0)[rank * share:(rank + 1) * share]),
        "all_to_all": lambda: close(ctx.ccl.all_to_all(torch.empty(ELEMENTS, device=ctx.device), mine),
                                    stacked.view(world, world, share)[:, rank].reshape(-1)),
        "broadcast (from the last rank)": lambda: close(ctx.ccl.broadcast(mine.clone(), src=world - 1),
                                                        inputs[world - 1]),
    }


def _report(ctx, step: str, ok: bool, seconds: float) -> bool:
    """Whether ``step`` was right on every rank; rank 0 prints its line as soon as every rank is
    done with it (so a slow step shows which one it is). This is a collective operation."""
    results = ctx.comm.all_gather_object((ok, seconds))
    everywhere = all(right for right, _ in results)
    if ctx.rank == 0:
        print(f"{step:44s} {'ok' if everywhere else 'FAILED':8s} {max(t for _, t in results) * 1e3:11.1f} ms",
              flush=True)
    return everywhere


def run_rank(rank: int, trace: str | None = None) -> bool:
    """The demo's steps on one rank, each reported as it finishes; whether every step was right
    on every rank. With ``trace``, every step is traced (:mod:`iris.tracing`) into that file."""
    start = time.perf_counter()
    ctx = iris.create(heap_size="64MiB")
    if trace is not None:
        ctx.tracing.enable()
    if ctx.rank == 0:
        print(f"{'step':44s} {'result':8s} {'slowest rank':>14s}", flush=True)
    right = _report(ctx, f"create context ({ctx.device.type}, {ctx.world_size} ranks)", True,
                    time.perf_counter() - start)
    inputs = _inputs(ctx.world_size, ctx.device)
    for name, check in ctx._demo_steps(inputs).items():
        right &= _report(ctx, name, *_timed(check))
    right &= _report(ctx, "device-side barrier", *_timed(lambda: (ctx.device_barrier(), ctx.barrier()) and True))
    for name, check in _collectives(ctx, inputs).items():
        right &= _report(ctx, name, *_timed(check))
    if trace is not None:
        ctx.tracing.export(trace)
        if ctx.rank == 0:
            print(f"trace of every rank written to {trace} (open it in ui.perfetto.dev)", flush=True)
    ctx.destroy()
    return right


def main(nprocs: int | None = None, trace: str | None = None) -> int:
    """Run the demo on ``nprocs`` ranks (default: every GPU, else 2 CPU ranks), traced into the
    file ``trace`` if given; 0 when every step was right on every rank."""
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= 1 else "cpu"
    nprocs = nprocs or (gpus if device == "cuda" else 2)
    print(f"iris {iris.__version__}: {nprocs} {'GPU' if device == 'cuda' else 'CPU'} ranks, backends "
          f"{iris.available_backends()}", flush=True)
    return 0 if all(iris.spawn(run_rank, nprocs, trace, device=device)) else 1
