"""What tracing costs: iris's all_reduce and fused matmul_reduce_scatter with tracing off and on,
against NCCL (torch.distributed) and cuBLAS + NCCL, in one run.

For each all_reduce size (bf16 bytes per rank) and the fused GEMM shape, the call is captured in a
CUDA graph before ``ctx.tracing.enable()`` (kernels compiled without tracing: what every call
runs while tracing is off) and again after it (kernels that record their events; each replay
appends them), then the graphs are replayed in turn (``benchmarks.common.replayed_per_call_us``):
each rank's median per call, the slowest rank's is the figure. Results are checked against the
baseline's first. The trace buffer is reset before each size, so no event is dropped.

    python -m benchmarks.tracing [--ranks 1] [--sizes 8KiB,1MiB,64MiB] [--gemm 4096x4096x4096] [--out DIR]

On one GPU ``--ranks 1`` times the kernels with no peer; 2 needs 2 GPUs.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import iris
from benchmarks.common import captured, replayed_per_call_us, write_results
from iris.config import parse_size

CALLS, REPEATS = 20, 15
#: Events each buffer holds: every program of every traced call of one size, with room.
MAX_EVENTS = 1 << 22
#: Calls traced per size: the three before the capture, then every replay's.
TRACED_CALLS = 3 + REPEATS * CALLS


def _slowest(ctx, times: dict) -> dict:
    every_rank = ctx.comm.all_gather_object(times)
    return {name: max(rank[name] for rank in every_rank) for name in times}


def _graphs_off_and_on(ctx, fn, stream) -> dict:
    """``fn`` captured with tracing off, then on (the buffer reset first)."""
    ctx.tracing.disable()
    off = captured(fn, CALLS, stream)
    ctx.tracing.enable(max_events=MAX_EVENTS)
    return {"iris tracing off": off, "iris tracing on": captured(fn, CALLS, stream)}


def _all_reduce(ctx, size: int, stream) -> dict:
    data = torch.randn(size // 2, generator=torch.Generator().manual_seed(ctx.rank)).to(torch.bfloat16)
    data = data.to(ctx.device)
    buf, reference = ctx.empty_like(data), data.clone()
    dist.all_reduce(reference)
    buf.copy_(data)
    ctx.ccl.all_reduce(buf)
    ok = bool(torch.allclose(buf.float(), reference.float(), rtol=2e-2, atol=2e-2))
    graphs = _graphs_off_and_on(ctx, lambda: ctx.ccl.all_reduce(buf), stream)
    nccl = data.clone()
    graphs["torch.distributed"] = captured(lambda: dist.all_reduce(nccl), CALLS, stream)
    times = replayed_per_call_us(ctx, graphs, CALLS, REPEATS)
    record = ctx.tracing.events()
    return {"bytes": size, "check": ok, "events_per_call": len(record["device"]) // TRACED_CALLS,
            "dropped": record["dropped"], "us_slowest_rank": _slowest(ctx, times)}


def _matmul_reduce_scatter(ctx, m: int, k: int, n: int, stream) -> dict:
    g = torch.Generator().manual_seed(ctx.rank)
    a = torch.randn(m, k, generator=g).to(torch.bfloat16).to(ctx.device)
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16).to(ctx.device)
    out = torch.empty(m // ctx.world_size, n, dtype=torch.bfloat16, device=ctx.device)
    reference = torch.empty_like(out)
    dist.reduce_scatter_tensor(reference, a @ b)
    ctx.ops.matmul_reduce_scatter(out, a, b, method="fused")
    ok = bool(torch.allclose(out.float(), reference.float(), rtol=3e-2, atol=1.0))
    graphs = _graphs_off_and_on(ctx, lambda: ctx.ops.matmul_reduce_scatter(out, a, b, method="fused"), stream)
    graphs["cuBLAS + torch.distributed"] = captured(lambda: dist.reduce_scatter_tensor(reference, a @ b), CALLS,
                                                    stream)
    times = replayed_per_call_us(ctx, graphs, CALLS, REPEATS)
    record = ctx.tracing.events()
    return {"shape": [m, k, n], "check": ok, "events_per_call": len(record["device"]) // TRACED_CALLS,
            "dropped": record["dropped"], "us_slowest_rank": _slowest(ctx, times)}


def _run(rank: int, sizes: list[int], gemm: tuple[int, int, int]) -> list[dict]:
    with iris.create(heap_size="1GiB") as ctx:
        stream = torch.cuda.Stream(ctx.device)
        rows = [_all_reduce(ctx, size, stream) for size in sizes]
        rows.append(_matmul_reduce_scatter(ctx, *gemm, stream))
        ctx.tracing.disable()
        return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None, help="ranks (one GPU each); default: the GPUs, at most 2")
    parser.add_argument("--sizes", default="8KiB,1MiB,64MiB", help="all_reduce bytes per rank, comma separated")
    parser.add_argument("--gemm", default="4096x4096x4096", help="matmul_reduce_scatter M x K x N")
    parser.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/runs)")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count()
    ranks = args.ranks or min(2, gpus)
    if not 1 <= ranks <= gpus:
        raise SystemExit(f"--ranks {ranks}: {gpus} GPU(s) visible; this benchmark needs a GPU per rank")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    gemm = tuple(int(d) for d in args.gemm.lower().split("x"))
    rows = iris.spawn(_run, ranks, sizes, gemm, device="cuda")[0]
    path = write_results(f"tracing-{ranks}rank", {"ranks": ranks, "calls": CALLS, "repeats": REPEATS, "rows": rows},
                         args.out, "cuda")
    for row in rows:
        what = f"{row['bytes']} B/rank" if "bytes" in row else f"GEMM {row['shape']}"
        figures = ", ".join(f"{name} {us:.1f} us" for name, us in row["us_slowest_rank"].items())
        print(f"{what} on {ranks} rank(s): {figures}; {row['events_per_call']} events per call, "
              f"{row['dropped']} dropped; check {row['check']}")
    print(f"wrote {path}")
    if not all(row["check"] for row in rows):
        raise SystemExit("a traced call's result differs from the baseline's")


if __name__ == "__main__":
    main()
