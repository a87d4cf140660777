"""Heap creation on every GPU (or CPU rank): time to create, and a peer write/read check.

Each rank creates a context with the given heap size, writes random data into the next rank's
heap through the peer mapping near both ends of the heap, and checks what its own predecessor
wrote. Usage: python benchmarks/heap_creation.py [--sizes 1GiB 64GiB] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import torch

import iris
from iris.config import parse_size


def _rank_data(rank: int, n: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(1234 + rank)
    return torch.randn(n, generator=generator, device=device)


def _run(rank: int, sizes: list[int]) -> list[dict]:
    rows = []
    for size in sizes:
        start = time.perf_counter()
        ctx = iris.create(heap_size=size)
        created = time.perf_counter() - start
        world = ctx.world_size
        n = 1 << 20  # 4 MiB of float32 at each end
        head = ctx.empty(n, dtype=torch.float32)
        ctx.empty((size - 16 * n) // 4, dtype=torch.uint8)  # fill the middle
        tail = ctx.empty(n, dtype=torch.float32)
        succ, pred = (rank + 1) % world, (rank - 1) % world
        for t in (head, tail):
            ctx.heap.peer_view(t, succ).copy_(_rank_data(rank, n, ctx.device))
        ctx.barrier()
        expected = _rank_data(pred, n, ctx.device)
        ok = bool(torch.equal(head, expected) and torch.equal(tail, expected))
        rows.append({"rank": rank, "context": repr(ctx), "heap_size": size, "create_seconds": created,
                     "heap_seconds": ctx.heap_creation_seconds, "peer_write_ok": ok,
                     "tail_offset": ctx.heap.offset_of(tail)})
        ctx.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", nargs="+", default=["1GiB", "64GiB"])
    parser.add_argument("--nprocs", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from benchmarks.common import write_results

    device = "cuda" if torch.cuda.is_available() else "cpu"
    nprocs = args.nprocs or (torch.cuda.device_count() if device == "cuda" else 2)
    sizes = [parse_size(s) for s in args.sizes]
    per_rank = iris.spawn(_run, nprocs, sizes, device=device)
    rows = [row for rank_rows in per_rank for row in rank_rows]
    for row in rows:
        print(row['context'])
        print(f"rank {row['rank']} heap {row['heap_size'] / 2**30:6.1f} GiB: create {row['create_seconds']:.3f} s "
              f"(heap {row['heap_seconds']:.3f} s), peer write/read {'ok' if row['peer_write_ok'] else 'FAILED'}")
    path = write_results(f"heap_creation-{device}", {"rows": rows}, args.out)
    print(f"wrote {path}")
    if not all(row["peer_write_ok"] for row in rows):
        raise SystemExit("peer write/read check failed")


if __name__ == "__main__":
    main()
