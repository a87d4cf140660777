"""Tile collectives inside a kernel (``iris_triton.tiles``) against the host-launched collectives, in one run.

For each size (bytes per rank of a bf16 ``rows x 8192`` matrix), a persistent kernel (one program
per multiprocessor) all-reduces every ``64 x 128`` tile of it with ``tiles.all_reduce`` (one-shot) and
``tiles.all_reduce_two_shot``, each tile synchronised by a tile sync; the same bytes go through
``ctx.ccl.all_reduce`` and through NCCL (torch.distributed, GPU ranks). Every implementation is
checked against NCCL's (gloo's on CPU ranks) result first, then timed per call under CUDA graphs
(``benchmarks.common.interleaved_per_call_us``): each rank's median, and the slowest rank's is the
figure. What the kernel-level form costs beyond the host-launched collective is the price of its
per-tile signals; what it buys is that the tiles can come out of the caller's own computation.

    python -m benchmarks.tile_collectives [--ranks 2] [--sizes 64KiB,1MiB,16MiB] [--cpu] [--out DIR]

``--ranks 1`` on one GPU times the kernels with no peer (the protocol's fixed cost); 2 needs 2
GPUs. ``--cpu``: 2 CPU ranks (Triton's interpreter), tiny sizes: checks the plumbing, not speed.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import iris
import iris_triton.tiles as tiles
from benchmarks.common import CPU_CAVEAT, interleaved_per_call_us, write_results
from iris.config import parse_size

COLUMNS = 8192
BLOCK_M, BLOCK_N = 64, 128
DEFAULTS = {"cuda": {"sizes": "64KiB,1MiB,16MiB,64MiB", "calls": 20, "repeats": 10},
            "cpu": {"sizes": "16KiB", "calls": 1, "repeats": 1}}
VARIANTS = {"tile_one_shot": "one_shot", "tile_two_shot": "two_shot"}


def all_reduce_tiles(context, src, dst, sync, M, N, CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                     TWO_SHOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Every tile of the row-major ``M x N`` ``src`` all-reduced into ``dst``, program ``p``
    taking tiles ``p, p + P, ...``."""
    dctx = CTX.initialize(context, RANK, WORLD)
    src_view = tiles.make_tensor_view(src, M, N, N, 1)
    dst_view = tiles.make_tensor_view(dst, M, N, N, 1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        tile = tiles.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        if TWO_SHOT:
            tiles.all_reduce_two_shot(tile, src_view, dst_view, dctx, sync)
        else:
            tiles.all_reduce(tile, src_view, dst_view, dctx, sync)


def _measure(ctx, kernel, programs: int, size: int, calls: int, repeats: int) -> dict:
    """Check and time every implementation at ``size`` bytes per rank: one row of the results."""
    rows = max(1, size // (2 * COLUMNS))
    data = torch.randn(rows, COLUMNS, generator=torch.Generator().manual_seed(ctx.rank)).to(torch.bfloat16)
    data = data.to(ctx.device)
    src, dst = ctx.as_symmetric(data), ctx.zeros(rows, COLUMNS, dtype=torch.bfloat16)
    sync = ctx.tile_sync(triton.cdiv(rows, BLOCK_M) * triton.cdiv(COLUMNS, BLOCK_N))
    reference = data.clone()
    dist.all_reduce(reference)
    constants = dict(CTX=ctx.frontend.device_context, RANK=ctx.rank, WORLD=ctx.world_size, BLOCK_M=BLOCK_M,
                     BLOCK_N=BLOCK_N)
    fns = {name: (lambda two=(variant == "two_shot"): kernel[(programs,)](
        ctx.get_device_context(), src, dst, sync, rows, COLUMNS, TWO_SHOT=two, **constants))
        for name, variant in VARIANTS.items()}
    iris_buf, nccl_buf = ctx.empty(rows, COLUMNS, dtype=torch.bfloat16), data.clone()
    fns["iris_ccl"] = lambda: ctx.ccl.all_reduce(iris_buf)
    fns["torch.distributed"] = lambda: dist.all_reduce(nccl_buf)
    checks = {}
    for name in VARIANTS:
        dst.zero_()
        fns[name]()
        ctx.check()
        checks[name] = bool(torch.allclose(dst.float(), reference.float(), rtol=2e-2, atol=2e-2))
    iris_buf.copy_(data)
    fns["iris_ccl"]()
    checks["iris_ccl"] = bool(torch.allclose(iris_buf.float(), reference.float(), rtol=2e-2, atol=2e-2))
    times = interleaved_per_call_us(ctx, fns, calls, repeats)
    ctx.check()
    slowest = {}
    for name, us in times.items():
        every_rank = [None] * ctx.world_size
        dist.all_gather_object(every_rank, us)
        slowest[name] = max(every_rank)
    return {"bytes": rows * COLUMNS * 2, "checks": checks, "us_slowest_rank": slowest}


def _run(rank: int, sizes: list[int], calls: int, repeats: int) -> list[dict]:
    with iris.create(heap_size="2GiB" if torch.cuda.is_available() else "64MiB") as ctx:
        programs = ctx.get_cu_count() if ctx.device.type == "cuda" else 2
        kernel = ctx.frontend.kernel(all_reduce_tiles)
        return [_measure(ctx, kernel, programs, size, calls, repeats) for size in sizes]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None, help="ranks (one GPU each); default: the GPUs, at most 2")
    parser.add_argument("--sizes", default=None, help="bytes per rank, comma separated (e.g. 64KiB,16MiB)")
    parser.add_argument("--calls", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--cpu", action="store_true", help="2 CPU ranks (Triton's interpreter), tiny sizes")
    parser.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/runs)")
    args = parser.parse_args(argv)
    device = "cpu" if args.cpu else "cuda"
    for key, value in DEFAULTS[device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    ranks = args.ranks or (2 if args.cpu else min(2, torch.cuda.device_count()))
    if device == "cuda" and not 1 <= ranks <= torch.cuda.device_count():
        raise SystemExit(f"--ranks {ranks}: {torch.cuda.device_count()} GPU(s) visible (--cpu: CPU ranks)")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = iris.spawn(_run, ranks, sizes, args.calls, args.repeats, device=device)[0]
    payload = {"ranks": ranks, "columns": COLUMNS, "tile": [BLOCK_M, BLOCK_N], "rows": rows}
    if device == "cpu":
        payload["caveat"] = CPU_CAVEAT
    path = write_results(f"tile_collectives-{ranks}rank{'-cpu' if args.cpu else ''}", payload, args.out, device)
    for row in rows:
        figures = ", ".join(f"{name} {us:.1f} us" for name, us in row["us_slowest_rank"].items())
        print(f"{row['bytes']} B/rank on {ranks} {device} rank(s): {figures}; checks {row['checks']}")
    print(f"wrote {path}")
    if not all(all(row["checks"].values()) for row in rows):
        raise SystemExit("a tile collective's result differs from torch.distributed's")


if __name__ == "__main__":
    main()
