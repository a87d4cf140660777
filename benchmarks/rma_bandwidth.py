"""Remote load, store, get, put and atomic_add bandwidth from rank 0 to rank 1.

Rank 0 runs one persistent kernel that moves ``size`` bytes between its heap and rank 1's heap
(rank 1 stays idle), timed with CUDA events (median of repeats). The kernel is one source,
compiled by each backend's front end (a Triton kernel, a Gluon kernel). Torch's peer copy (the
copy engine, ``tensor.to("cuda:1")``) of the same bytes is measured in the same run. Results go
to ``benchmarks/runs/rma_bandwidth-<backend>-<date>.json`` (or ``--out``) with a PNG plot.

With ``--cpu`` the ranks are 2 CPU ranks (Triton's interpreter, Triton backend only): one launch
geometry and no cache modifiers are tried, the peer copy is torch's copy into rank 1's heap as
rank 0 maps it, times are taken by the host clock, and the defaults are tiny (16 and 64 KiB, two
repeats); the results go to ``rma_bandwidth-<backend>-cpu-<date>.json``. The figures say nothing
of speed: such a run checks the benchmark, its check, JSON and plot where there is no GPU.

    python -m benchmarks.rma_bandwidth [--cpu] [--min 4KiB] [--max 1GiB] [--backends triton,gluon] [--out DIR]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

import iris
from benchmarks.common import (
    add_device_option,
    ranks_label,
    resolve,
    run_command_line,
    size_ladder,
    synchronize,
    write_results,
)

MODES = ("load", "store", "get", "put", "atomic_add")
#: Cache modifiers tried on the remote access once the best geometry is known (GPU ranks only:
#: the interpreter has no caches).
CACHE_MODIFIERS = {"load": (".cg", ".cv"), "store": (".cs", ".wt", ".cg")}
#: Defaults per device type: CPU ranks interpret every kernel.
DEFAULTS = {"cuda": {"min": "4KiB", "max": "1GiB", "repeats": 20, "backends": "triton,gluon"},
            "cpu": {"min": "16KiB", "max": "64KiB", "repeats": 2, "backends": "triton"}}
#: (grid, block, warps) of the check before anything is timed, per device type.
CHECK_GEOMETRY = {"cuda": (132, 1024, 4), "cpu": (2, 1024, 4)}


def transfer_kernel(context, src, dst, n, heap_bases, peer, CTX: tl.constexpr, RANK: tl.constexpr,
                    MODE: tl.constexpr, BLOCK: tl.constexpr, CACHE: tl.constexpr):
    """Move ``n`` float32 between this rank's and ``peer``'s heap; grid-stride over blocks.
    ``CACHE`` is the cache modifier of the remote access in the load and store modes."""
    dctx = CTX.initialize(context, RANK, 2)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = dctx.block_offsets(src, start, BLOCK)
        mask = offs < n
        if MODE == "load":  # peer's src -> local dst
            tl.store(dst + offs, iris.load(src + offs, RANK, peer, heap_bases, mask=mask, cache_modifier=CACHE),
                     mask=mask)
        elif MODE == "store":  # local src -> peer's dst
            iris.store(dst + offs, tl.load(src + offs, mask=mask), RANK, peer, heap_bases, mask=mask,
                       cache_modifier=CACHE)
        elif MODE == "get":
            iris.get(src + offs, dst + offs, RANK, peer, heap_bases, mask=mask)  # peer's src -> local dst
        elif MODE == "put":
            iris.put(src + offs, dst + offs, RANK, peer, heap_bases, mask=mask)
        else:
            tl.static_assert(MODE == "atomic_add")
            iris.atomic_add(dst + offs, tl.load(src + offs, mask=mask), RANK, peer, heap_bases, mask=mask,
                            sem="relaxed", scope="sys")


def _time_ms(fn, repeats: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn`` after one untimed call: CUDA events on
    a GPU, the host clock on CPU ranks (whose kernels have run when the launch returns)."""
    fn()
    synchronize(device)
    samples = []
    if device.type != "cuda":
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return samples
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def _launcher(ctx, mode, src, dst, n, grid, block, warps, cache=""):
    """A no-argument launch of one configuration; ``grid`` None means one program per block."""
    bases, context, front = ctx.get_heap_bases(), ctx.get_device_context(), ctx.frontend
    programs = triton.cdiv(n, block) if grid is None else grid
    kernel = front.kernel(transfer_kernel)
    return lambda: kernel[(programs,)](context, src, dst, n, bases, 1 - ctx.rank, CTX=front.device_context,
                                       RANK=ctx.rank, MODE=mode, BLOCK=block, CACHE=cache, num_warps=warps)


def _check(ctx, src, dst, n) -> bool:
    """One store and one load round trip checked against torch before anything is timed."""
    peer_dst, geometry = ctx.heap.peer_view(dst, 1), CHECK_GEOMETRY[ctx.device.type]
    _launcher(ctx, "store", src, dst, n, *geometry)()
    synchronize(ctx.device)
    ok = torch.equal(peer_dst[:n], src[:n])
    peer_dst[:n].copy_(torch.randn(n, device=ctx.device))
    synchronize(ctx.device)
    expected = peer_dst[:n].clone()
    _launcher(ctx, "load", dst, src, n, *geometry)()
    synchronize(ctx.device)
    return bool(ok and torch.equal(src[:n], expected))


def _run(rank: int, backend: str, sizes: list[int], configs: list[tuple[int, int, int]], repeats: int):
    ctx = iris.create(backend, heap_size=2 * max(sizes) + (64 << 20))
    n_max = max(sizes) // 4
    src = ctx.randn(n_max, generator=torch.Generator(ctx.device).manual_seed(rank))
    dst = ctx.zeros(n_max)
    rows = []
    ctx.barrier()
    if rank == 0:
        correct = _check(ctx, src, dst, min(n_max, 1 << 20))
        # Pick the fastest (grid, block, warps) per mode at the largest size, then the fastest
        # cache modifier at that geometry (on GPUs); rank 1 is idle.
        device, best = ctx.device, {}
        for mode in MODES:
            if len(configs) == 1:
                timings = {(*configs[0], ""): 0.0}
            else:
                timings = {(*cfg, ""): min(_time_ms(_launcher(ctx, mode, src, dst, n_max, *cfg), 5, device))
                           for cfg in configs}
            geometry = min(timings, key=timings.get)[:3]
            for cache in CACHE_MODIFIERS.get(mode, ()) if device.type == "cuda" else ():
                timings[(*geometry, cache)] = min(_time_ms(_launcher(ctx, mode, src, dst, n_max, *geometry, cache), 5,
                                                           device))
            best[mode] = min(timings, key=timings.get)
        # The copy engine into GPU 1; on CPU ranks, torch's copy into rank 1's heap as rank 0 maps it.
        peer_buffer = torch.empty(n_max, device="cuda:1") if device.type == "cuda" else ctx.heap.peer_view(dst, 1)
        for size in sizes:
            n = size // 4
            row = {"bytes": size, "correct": correct}
            for mode in MODES:
                samples = _time_ms(_launcher(ctx, mode, src, dst, n, *best[mode]), repeats, device)
                median = sorted(samples)[len(samples) // 2]
                row[mode] = {"median_ms": median, "GBps": size / median / 1e6, "config": best[mode]}
            samples = _time_ms(lambda n=n: peer_buffer[:n].copy_(src[:n], non_blocking=True), repeats, device)
            median = sorted(samples)[len(samples) // 2]
            row["torch_peer_copy"] = {"median_ms": median, "GBps": size / median / 1e6}
            rows.append(row)
    ctx.barrier()
    ctx.destroy()
    return rows


def plot(rows: list[dict], backend: str, path, device: str = "cuda") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    sizes = [r["bytes"] for r in rows]
    for key in (*MODES, "torch_peer_copy"):
        ax.plot(sizes, [r[key]["GBps"] for r in rows], marker="o", label=key)
    if device == "cuda":
        ax.axhline(478, color="grey", linestyle="--", label="NVLink per direction (478 GB/s)")
    else:
        ax.set_yscale("log")  # the interpreted kernels are orders of magnitude below torch's copy
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per transfer")
    ax.set_ylabel("GB/s (rank 0 <-> rank 1)")
    ax.set_title(f"iris remote memory access ({backend} backend)\n{ranks_label(device)}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rma_bandwidth", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min", default=None, help="smallest transfer (default 4KiB; 16KiB with --cpu)")
    parser.add_argument("--max", default=None, help="largest transfer (default 1GiB; 64KiB with --cpu)")
    parser.add_argument("--repeats", type=int, default=None, help="samples per figure (default 20; 2 with --cpu)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backends to measure (default triton,gluon; triton with --cpu)")
    parser.add_argument("--out", default=None)
    add_device_option(parser)
    return resolve(parser.parse_args(argv), DEFAULTS)


def jobs(args: argparse.Namespace) -> list[tuple]:
    """What every rank runs: ``[(function, its arguments after the rank)]``, one per backend."""
    sizes = size_ladder(args.min, args.max, step=4)
    if args.device == "cuda":
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        grids = [sms * k for k in (1, 2, 4)] + [None]  # None: one program per block
        configs = [(grid, block, warps) for grid in grids for block in (2048, 4096, 8192) for warps in (4, 8, 16)]
    else:
        configs = [CHECK_GEOMETRY["cpu"]]  # the interpreter runs the programs one after another
    return [(_run, (backend, sizes, configs, args.repeats)) for backend in args.backends.split(",")]


def report(args: argparse.Namespace, results: list) -> bool:
    """Print, write the JSON and the plot of each backend; whether every check passed."""
    correct = True
    for (_, (backend, _, configs, _)), rows in zip(jobs(args), results):
        print(f"{backend} backend")
        print(f"{'bytes':>12} " + " ".join(f"{k:>16}" for k in (*MODES, "torch_peer_copy")) + "   (GB/s)")
        digits = ".1f" if args.device == "cuda" else ".3g"  # the interpreter's figures are tiny
        for r in rows:
            print(f"{r['bytes']:>12} " + " ".join(f"{r[k]['GBps']:>16{digits}}" for k in (*MODES, "torch_peer_copy")))
        name = f"rma_bandwidth-{backend}" + ("-cpu" if args.device == "cpu" else "")
        timing = "CUDA events" if args.device == "cuda" else "host clock (time.perf_counter)"
        path = write_results(name, {"backend": backend, "timing": timing, "rows": rows, "configs_tried": configs},
                             args.out, args.device)
        plot(rows, backend, path.with_suffix(".png"), args.device)
        ok = all(r["correct"] for r in rows)
        print(f"wrote {path} and {path.with_suffix('.png')}; correct: {ok}")
        correct &= ok
    return correct


def main(argv: list[str] | None = None) -> None:
    run_command_line(argv, parse_args, jobs, report, "the store and load check failed (correct: False above)")


if __name__ == "__main__":
    main()
