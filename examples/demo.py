"""iris in one minute: ranks, a symmetric heap, and a Triton kernel writing into peers' memory.

Spawns one rank per GPU (CPU ranks running Triton's interpreter when no GPU is visible),
allocates tensors on the symmetric heap, has every rank store into its right neighbour's heap
from inside a Triton kernel, passes messages under a flag protocol, and checks each step
against torch. Prints a short table.

    python examples/demo.py [--nprocs N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

import iris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from message_passing import exchange  # noqa: E402


@triton.jit
def ring_store_kernel(src, dst, n, heap_bases, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Store this rank's ``src`` into ``dst`` on rank ``RANK + 1`` (remote stores)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    iris.store(dst + offs, tl.load(src + offs, mask=mask), RANK, (RANK + 1) % WORLD, heap_bases, mask=mask)


def _data(rank: int, n: int, device) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator(device).manual_seed(rank), device=device)


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _run(rank: int) -> list[tuple[str, bool, float]]:
    steps = []
    ctx, seconds = _timed(lambda: iris.create(heap_size="64MiB"))
    steps.append((f"create context ({ctx.device.type}, {ctx.world_size} ranks)", True, seconds))
    world, n = ctx.world_size, 4099
    src = ctx.as_symmetric(_data(rank, n, ctx.device))
    dst = ctx.zeros(n)
    ctx.barrier()

    def ring():
        ring_store_kernel[(triton.cdiv(n, 1024),)](src, dst, n, ctx.get_heap_bases(), RANK=rank, WORLD=world,
                                                   BLOCK=1024)
        ctx.barrier()
        return torch.equal(dst, _data((rank - 1) % world, n, ctx.device))

    ok, seconds = _timed(ring)
    steps.append(("remote store into the next rank", ok, seconds))

    def device_barrier():
        ctx.device_barrier()
        ctx.barrier()
        return True

    ok, seconds = _timed(device_barrier)
    steps.append(("device-side barrier", ok, seconds))
    if world >= 2:
        rounds = 100 if ctx.device.type == "cuda" else 10
        ok, seconds = _timed(lambda: exchange(ctx, rounds=rounds, n=256) if rank < 2 else True)
        ctx.barrier()
        steps.append((f"message passing, {rounds} rounds rank 0 -> 1", ok, seconds))
    ctx.destroy()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=None)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= 1 else "cpu"
    nprocs = args.nprocs or (gpus if device == "cuda" else 2)
    print(f"iris {iris.__version__}: {nprocs} {'GPU' if device == 'cuda' else 'CPU'} ranks, backends {iris.available_backends()}")
    per_rank = iris.spawn(_run, nprocs, device=device)
    failed = False
    print(f"{'step':48s} {'result':8s} {'slowest rank':>14s}")
    for i, (name, _, _) in enumerate(per_rank[0]):
        ok = all(steps[i][1] for steps in per_rank)
        failed |= not ok
        slowest = max(steps[i][2] for steps in per_rank)
        print(f"{name:48s} {'ok' if ok else 'FAILED':8s} {slowest * 1e3:11.1f} ms")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
