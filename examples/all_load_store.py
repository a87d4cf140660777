"""All-load and all-store bandwidth: every rank reads from (or writes to) every peer at once.

All-load: each rank gathers every peer's slice with remote loads. All-store: each rank scatters
its slice into every peer with remote stores. Both results are checked against torch, then
timed. Runs on all GPUs when there are at least two, else on CPU ranks (--nprocs).

    python examples/all_load_store.py [--nprocs 2] [--size 1MiB]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import triton
import triton.language as tl

import iris
from iris.config import parse_size


@triton.jit
def all_load_kernel(slices, gathered, n, heap_bases, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """gathered[p] = peer p's slice, for every p (read remotely)."""
    peer = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    data = iris.load(slices + offs, RANK, peer, heap_bases, mask=mask)
    tl.store(gathered + peer * n + offs, data, mask=mask)


@triton.jit
def all_store_kernel(slices, gathered, n, heap_bases, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Peer p's gathered[RANK] = this rank's slice, for every p (written remotely)."""
    peer = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    data = tl.load(slices + offs, mask=mask)
    iris.store(gathered + RANK * n + offs, data, RANK, peer, heap_bases, mask=mask)


def _slice(rank: int, n: int, device) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator(device).manual_seed(rank), device=device)


def _run(rank: int, nbytes: int, repeats: int) -> dict:
    with iris.create(heap_size=max(64 << 20, 3 * nbytes * 8)) as ctx:
        world, n = ctx.world_size, nbytes // 4
        slices = ctx.as_symmetric(_slice(rank, n, ctx.device))
        expected = torch.stack([_slice(p, n, ctx.device) for p in range(world)])
        block = 1024 if ctx.device.type == "cuda" else 256
        grid = (triton.cdiv(n, block), world)
        args = (ctx.get_heap_bases(),)
        results = {}
        for name, kernel in (("all_load", all_load_kernel), ("all_store", all_store_kernel)):
            gathered = ctx.zeros(world, n)
            ctx.barrier()
            launch = functools.partial(kernel[grid], slices, gathered, n, *args, RANK=rank, WORLD=world, BLOCK=block)
            launch()
            ctx.barrier()
            correct = torch.equal(gathered, expected)
            start = time.perf_counter()
            for _ in range(repeats):
                launch()
            ctx.barrier()
            seconds = (time.perf_counter() - start) / repeats
            # bytes that crossed to/from peers (the rank's own slice stays local)
            results[name] = {"correct": bool(correct), "GBps": (world - 1) * nbytes / seconds / 1e9}
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=None)
    parser.add_argument("--size", default=None, help="bytes per rank slice (default 256MiB on GPUs, 64KiB on CPU)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= 2 else "cpu"
    nprocs = args.nprocs or (gpus if device == "cuda" else 2)
    nbytes = parse_size(args.size or ("256MiB" if device == "cuda" else "64KiB"))
    repeats = 20 if device == "cuda" else 2
    per_rank = iris.spawn(_run, nprocs, nbytes, repeats, device=device)
    for name in ("all_load", "all_store"):
        ok = all(r[name]["correct"] for r in per_rank)
        slowest = min(r[name]["GBps"] for r in per_rank)
        print(f"{name:9s} {nprocs} ranks on {device}, {nbytes} bytes per slice: "
              f"{'correct' if ok else 'WRONG'}, slowest rank {slowest * 1e3:.3g} MB/s")
    if not all(r[k]["correct"] for r in per_rank for k in ("all_load", "all_store")):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
