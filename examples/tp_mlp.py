"""A tensor-parallel MLP with iris inside a compiled PyTorch program, checked against torch.

The first layer is column-parallel: each rank holds a block of ``W1``'s columns and its block of
the rows of the activations, and ``ctx.ops.all_gather_matmul`` gathers the rows while it
multiplies. The second layer is row-parallel: each rank holds the matching rows of ``W2``, and
``ctx.ops.matmul_reduce_scatter`` sums the partial products and leaves each rank its rows.
``ctx.ccl.all_reduce`` then sums a statistic over every row. The step is compiled with
``torch.compile(fullgraph=True)`` (the iris calls become ``torch.ops.iris.*`` operators, no graph
break); on GPUs it is also captured in a CUDA graph after a warm-up call and replayed on new
data, and an asynchronous all_reduce overlaps other work on the current stream.

    python examples/tp_mlp.py [--rows 8] [--width 64] [--hidden 128]

Runs on 2 GPUs when there are, else on 2 CPU ranks (Triton's interpreter; compiled with the
``aot_eager`` backend there, inductor on GPUs).
"""

from __future__ import annotations

import argparse
import math

import torch

import iris


def tp_mlp(ctx, x_shard, w1_shard, w2_shard):
    """This rank's rows of ``relu(X @ W1) @ W2`` and the column sums of its squares over all rows."""
    rows, world = x_shard.shape[0], ctx.world_size
    h = torch.empty(world * rows, w1_shard.shape[1], dtype=x_shard.dtype, device=x_shard.device)
    ctx.ops.all_gather_matmul(h, x_shard, w1_shard)          # column-parallel: all of X @ my W1 columns
    h = torch.relu(h)
    y = torch.empty(rows, w2_shard.shape[1], dtype=x_shard.dtype, device=x_shard.device)
    ctx.ops.matmul_reduce_scatter(y, h, w2_shard)            # row-parallel: my rows of the sum over ranks
    stats = (y.float() ** 2).sum(0)
    ctx.ccl.all_reduce(stats)
    return y, stats


def model(world: int, rows: int, width: int, hidden: int, seed: int):
    """The whole input and weights, the same on every rank (fp16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * rows, width, generator=g)
    w1 = torch.randn(width, hidden, generator=g) / math.sqrt(width)
    w2 = torch.randn(hidden, width, generator=g) / math.sqrt(hidden)
    return x.half(), w1.half(), w2.half()


def shards(ctx, rows: int, width: int, hidden: int, seed: int):
    world, rank = ctx.world_size, ctx.rank
    x, w1, w2 = model(world, rows, width, hidden, seed)
    h = hidden // world
    return (x[rank * rows:(rank + 1) * rows].to(ctx.device), w1[:, rank * h:(rank + 1) * h].contiguous().to(ctx.device),
            w2[rank * h:(rank + 1) * h].contiguous().to(ctx.device))


def error(ctx, got, rows: int, width: int, hidden: int, seed: int) -> float:
    """The largest difference from the float32 torch reference."""
    x, w1, w2 = (t.float() for t in model(ctx.world_size, rows, width, hidden, seed))
    y = torch.relu(x @ w1) @ w2
    rank = ctx.rank
    return max((got[0].float().cpu() - y[rank * rows:(rank + 1) * rows]).abs().max().item(),
               ((got[1].cpu() - (y ** 2).sum(0)).abs() / (y ** 2).sum(0)).max().item())


def run(rank: int, device: str, rows: int, width: int, hidden: int) -> list[str]:
    ctx = iris.create(heap_size="256MiB" if device == "cuda" else "32MiB")
    on_gpu = ctx.device.type == "cuda"
    step = torch.compile(lambda *a: tp_mlp(ctx, *a), fullgraph=True, backend="inductor" if on_gpu else "aot_eager")
    lines = []
    inputs = shards(ctx, rows, width, hidden, seed=0)
    lines.append(f"compiled step: max error {error(ctx, step(*inputs), rows, width, hidden, 0):.2e}")
    if on_gpu:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):                        # warmed up above: no workspace grows here
            captured = step(*inputs)
        for target, value in zip(inputs, shards(ctx, rows, width, hidden, seed=1)):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        lines.append(f"CUDA graph replay on new data: max error {error(ctx, captured, rows, width, hidden, 1):.2e}")
    # Asynchronous: the all_reduce runs on a side stream while this stream goes on.
    t = torch.full((1024,), float(rank + 1), device=ctx.device)
    work = ctx.ccl.all_reduce(t, async_op=True)
    other = torch.randn(256, 256, device=ctx.device) @ torch.randn(256, 256, device=ctx.device)
    work.wait()                                              # this stream now waits for the all_reduce
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    lines.append(f"async all_reduce: {'right' if bool((t == expected).all()) else 'WRONG'} "
                 f"(completed: {work.is_completed()}, overlapped a {tuple(other.shape)} product)")
    ctx.barrier()
    ctx.destroy()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="rows of activations per rank")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128, help="hidden width (divisible by the ranks)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    for rank, lines in enumerate(iris.spawn(run, 2, device, args.rows, args.width, args.hidden, device=device)):
        for line in lines:
            print(f"rank {rank} ({device}): {line}")


if __name__ == "__main__":
    main()
