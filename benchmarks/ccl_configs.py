"""Collective launch shapes compared on 2 GPUs: bf16, per call under CUDA graphs, slowest rank.

For each launch shape (elements per block, blocks per group, most exchanges per call, warps)
every collective runs at every size with that shape forced (``iris_triton.tuning.COLLECTIVE_SHAPES``), is
checked against torch (all_reduce against NCCL's), then timed (an in-place all_reduce on its
buffer as is, no copy per call): ``--calls`` calls captured in one
graph, the median of 5 replays, the slowest rank's. Results go to
``benchmarks/runs/ccl_configs-<date>.json`` (or ``--out``); ``benchmarks/NOTES-archive.md`` says
which shapes ``COLLECTIVE_SHAPES`` keeps. With ``--all-reduce low_latency`` the shapes (words per block,
warps) of the low-latency all_reduce (``iris_triton.tuning.LOW_LATENCY_SHAPES``) are compared
instead, against one-shot; with ``--all-reduce sentinel`` those of the sentinel all_reduce
(elements per block, warps, blocks pushed ahead: ``iris_triton.tuning.SENTINEL_SHAPES``).

    python -m benchmarks.ccl_configs [--sizes 8KiB,512KiB,4MiB,32MiB,256MiB] [--shapes 4096x4x8x8,...]
                                     [--all-reduce low_latency|sentinel] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import iris
from benchmarks.common import per_call_us
from iris.calls.repeats import invalidate as invalidate_repeats
from iris.config import parse_size
from iris_triton import tuning

SHAPES = [(4096, 4, 8, 8), (4096, 2, 8, 8), (4096, 1, 8, 8), (4096, 4, 16, 8), (4096, 4, 4, 8), (8192, 2, 8, 8),
          (8192, 4, 8, 16), (2048, 4, 8, 4), (4096, 4, 8, 16), (4096, 2, 16, 8), (2048, 8, 8, 8), (4096, 1, 32, 8)]
#: Per all_reduce algorithm with its own launch shapes: its shape table, the names of a shape's
#: values, and the shapes compared by default.
ALL_REDUCE_SHAPES = {
    "low_latency": (tuning.LOW_LATENCY_SHAPES, ("BLOCK", "num_warps"),
                    [(128, 2), (256, 2), (256, 4), (512, 4), (1024, 4), (1024, 8), (2048, 8)]),
    "sentinel": (tuning.SENTINEL_SHAPES, ("BLOCK", "num_warps", "LAG"),
                 [(2048, 8, 1 << 20), (1024, 4, 1 << 20), (4096, 8, 1 << 20), (4096, 16, 1 << 20), (1024, 4, 1),
                  (1024, 4, 2), (2048, 8, 1), (2048, 8, 2), (512, 4, 2), (4096, 8, 1)]),
}


def _collectives(ctx, x, all_reduce: str | None = None):
    """``{name: (timed call, checked call, output, expected)}`` for every collective of ``x``
    (bf16, heap), or only the ``all_reduce`` algorithm and one-shot. An in-place all_reduce is
    checked from a copy of ``x`` and timed on its buffer as is (as ``benchmarks.ccl`` does)."""
    world, n = ctx.world_size, x.numel()
    summed = x.clone()
    dist.all_reduce(summed)

    def in_place(algorithm):
        buf = ctx.empty(n, dtype=x.dtype)

        def call():
            ctx.ccl.all_reduce(buf, algorithm=algorithm)

        return call, lambda: (buf.copy_(x), call()), buf, summed

    if all_reduce:
        return {f"all_reduce_{all_reduce}": in_place(all_reduce), "all_reduce_one_shot": in_place("one_shot")}
    gathered = torch.empty(world * n, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x)
    scattered = torch.empty(n // world, dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(scattered, x)
    exchanged = torch.empty_like(x)
    dist.all_to_all_single(exchanged, x)
    ag, rs, a2a = ctx.empty(world * n, dtype=x.dtype), ctx.empty(n // world, dtype=x.dtype), ctx.empty(n, dtype=x.dtype)
    out_of_place = {
        "all_gather": (lambda: ctx.ccl.all_gather(ag, x), ag, gathered),
        "reduce_scatter": (lambda: ctx.ccl.reduce_scatter(rs, x), rs, scattered),
        "all_to_all": (lambda: ctx.ccl.all_to_all(a2a, x), a2a, exchanged),
    }
    return {"all_reduce_one_shot": in_place("one_shot"), "all_reduce_two_shot": in_place("two_shot"),
            **{name: (call, call, out, expected) for name, (call, out, expected) in out_of_place.items()}}


def _apply(shape: tuple, all_reduce: str | None) -> None:
    """Force ``shape`` for every call from now on."""
    if all_reduce:
        table, names, _ = ALL_REDUCE_SHAPES[all_reduce]
        table["cuda"] = dict(zip(names, shape, strict=True))
    else:
        block, group, syncs, warps = shape
        tuning.COLLECTIVE_SHAPES["cuda"] = ((None, dict(BLOCK=block, ROUND=group, SYNCS=syncs, num_warps=warps)),)


def _run(rank: int, sizes: list[int], shapes: list[tuple], calls: int, all_reduce: str | None,
         passes: int) -> list[dict]:
    ctx = iris.create("triton", heap_size=12 * max(sizes) + (256 << 20))
    rows = []
    for sweep in range(passes):
        for shape in shapes:
            _apply(shape, all_reduce)
            invalidate_repeats()  # they hold kernels compiled for the previous shape
            for size in sizes:
                x = ctx.randn(size // 2, dtype=torch.bfloat16, generator=torch.Generator(ctx.device).manual_seed(rank))
                row = {"pass": sweep, "shape": list(shape), "bytes": size, "correct": {}, "us": {}}
                tensors = [x]
                for name, (timed, checked, out, expected) in _collectives(ctx, x, all_reduce).items():
                    checked()
                    torch.cuda.synchronize()
                    row["correct"][name] = bool(torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2))
                    mine = per_call_us(ctx, timed, calls if size <= 32 << 20 else 3, repeats=5, graph=True)
                    row["us"][name] = max(ctx.comm.all_gather_object(mine))
                    tensors.append(out)
                for tensor in tensors:
                    ctx.free(tensor)
                rows.append(row)
    ctx.destroy()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="8KiB,512KiB,4MiB,32MiB,256MiB")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--shapes", default=None,
                        help="shapes to compare instead of the built-in list, e.g. 4096x1x8x8 (low_latency: 256x4, "
                             "sentinel: 2048x8x1)")
    parser.add_argument("--all-reduce", choices=sorted(ALL_REDUCE_SHAPES), default=None,
                        help="compare the launch shapes of this all_reduce algorithm instead")
    parser.add_argument("--passes", type=int, default=1, help="sweeps over every shape, one after another")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("ccl_configs needs 2 GPUs")
    from benchmarks.common import write_results

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    shapes = ALL_REDUCE_SHAPES[args.all_reduce][2] if args.all_reduce else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    rows = iris.spawn(_run, 2, sizes, shapes, args.calls, args.all_reduce, args.passes, device="cuda")[0]
    for row in rows:
        print(f"{str(row['shape']):>20} {row['bytes']:>10} " + " ".join(f"{k} {v:7.1f}" for k, v in row["us"].items())
              + f"  correct {all(row['correct'].values())}")
    name = f"ccl_configs_{args.all_reduce}" if args.all_reduce else "ccl_configs"
    print(f"wrote {write_results(name, {'unit': 'us per call, graph, slowest rank', 'rows': rows}, args.out)}")


if __name__ == "__main__":
    main()
