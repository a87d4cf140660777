"""Remote store and load at 1 GiB by kernel form, rank 0 to rank 1, interleaved repeats.

Three forms of the same copy between this rank's heap and the peer's heap:

- ``iris``: the grid-stride kernel of ``benchmarks.rma_bandwidth`` (``iris.load``/``iris.store``),
  at launch geometries from 32 programs (fewer writers than multiprocessors) to one per block;
- ``unroll2``: two blocks per iteration, both loads issued before either store;
- ``tma``: the bulk tensor copy engine (``tl.make_tensor_descriptor`` on the translated
  pointer: rows of ``C`` elements, ``R`` rows per copy);
- ``chunked``: each program copies one contiguous chunk instead of striding over the grid;
- ``generated`` (stores only, not a copy): values made in registers are stored, so no local
  read shares the program's time: the ceiling of the stores alone. Checked against the same
  values made by torch.

Every variant is checked against torch first; then each repeat times every variant once, in turn,
so clock drift hits all alike. Torch's peer copy is measured the same way. Results go to
``benchmarks/runs/rma_variants-<date>.json`` (or ``--out``).

    python -m benchmarks.rma_variants [--size 1GiB] [--repeats 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

import iris
import iris_triton.device.functions as device
from benchmarks.rma_bandwidth import transfer_kernel
from iris.config import parse_size


@triton.jit
def tma_kernel(src, dst, rows, heap_bases, peer, RANK: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
               STORE: tl.constexpr):
    """Copy ``rows x C`` float32 with bulk tensor copies: local ``src`` to the peer's ``dst``
    (``STORE``), or the peer's ``src`` to local ``dst``."""
    if STORE:
        source, target = src, device.translate(dst, RANK, peer, heap_bases)
    else:
        source, target = device.translate(src, RANK, peer, heap_bases), dst
    source_desc = tl.make_tensor_descriptor(source, shape=[rows, C], strides=[C, 1], block_shape=[R, C])
    target_desc = tl.make_tensor_descriptor(target, shape=[rows, C], strides=[C, 1], block_shape=[R, C])
    for r in range(tl.program_id(0) * R, rows, tl.num_programs(0) * R):
        target_desc.store([r, 0], source_desc.load([r, 0]))


@triton.jit
def unrolled_kernel(src, dst, n, heap_bases, peer, RANK: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr):
    """Grid-stride copy of ``n`` float32, two blocks per iteration with both loads first."""
    for start in range(tl.program_id(0) * 2 * BLOCK, n, tl.num_programs(0) * 2 * BLOCK):
        first = start + tl.arange(0, BLOCK)
        second = first + BLOCK
        if STORE:
            a = tl.load(src + first, mask=first < n)
            b = tl.load(src + second, mask=second < n)
            device.store(dst + first, a, RANK, peer, heap_bases, mask=first < n)
            device.store(dst + second, b, RANK, peer, heap_bases, mask=second < n)
        else:
            a = device.load(src + first, RANK, peer, heap_bases, mask=first < n)
            b = device.load(src + second, RANK, peer, heap_bases, mask=second < n)
            tl.store(dst + first, a, mask=first < n)
            tl.store(dst + second, b, mask=second < n)


@triton.jit
def chunked_kernel(src, dst, n, chunk, heap_bases, peer, RANK: tl.constexpr, BLOCK: tl.constexpr,
                   STORE: tl.constexpr):
    """Copy ``n`` float32, program ``p`` taking the contiguous elements ``[p * chunk, (p + 1) * chunk)``."""
    first = tl.program_id(0) * chunk
    for start in range(first, tl.minimum(first + chunk, n), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        if STORE:
            device.store(dst + offs, tl.load(src + offs, mask=mask), RANK, peer, heap_bases, mask=mask)
        else:
            tl.store(dst + offs, device.load(src + offs, RANK, peer, heap_bases, mask=mask), mask=mask)


@triton.jit
def generated_store_kernel(dst, n, heap_bases, peer, RANK: tl.constexpr, BLOCK: tl.constexpr):
    """Store ``float(i % 4096)`` at element ``i`` of the peer's ``dst``, grid-stride, reading nothing."""
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        device.store(dst + offs, (offs % 4096).to(tl.float32), RANK, peer, heap_bases, mask=offs < n)


def _variants(ctx, src, dst, n) -> dict:
    """``{name: launch}`` for every variant; names start with the mode."""
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    bases, context, front = ctx.get_heap_bases(), ctx.get_device_context(), ctx.frontend
    grid_stride = front.kernel(transfer_kernel)
    variants = {}
    for mode in ("store", "load"):
        store = mode == "store"
        for block, warps, grid in ((4096, 16, None), (2048, 16, None), (4096, 8, sms), (8192, 8, 2 * sms),
                                   (4096, 16, 32), (4096, 16, 64), (8192, 16, 96), (1024, 4, None), (2048, 8, None)):
            programs = triton.cdiv(n, block) if grid is None else grid
            variants[f"{mode}_iris_b{block}_w{warps}_g{grid}"] = (
                lambda p=programs, m=mode, b=block, w=warps: grid_stride[(p,)](
                    context, src, dst, n, bases, 1, CTX=front.device_context, RANK=0, MODE=m, BLOCK=b, CACHE="",
                    num_warps=w))
        for block, warps, grid in ((4096, 8, sms), (4096, 16, 2 * sms), (2048, 8, 4 * sms)):
            variants[f"{mode}_unroll2_b{block}_w{warps}_g{grid}"] = (
                lambda g=grid, s=store, b=block, w=warps: unrolled_kernel[(g,)](
                    src, dst, n, bases, 1, RANK=0, BLOCK=b, STORE=s, num_warps=w))
        for rows, cols, grid in ((32, 256, sms), (32, 256, 2 * sms), (16, 256, 3 * sms), (64, 128, 2 * sms),
                                 (8, 256, 4 * sms)):
            variants[f"{mode}_tma_r{rows}_c{cols}_g{grid}"] = (
                lambda g=grid, s=store, r=rows, c=cols: tma_kernel[(g,)](
                    src, dst, n // c, bases, 1, RANK=0, R=r, C=c, STORE=s, num_warps=4))
        for block, warps, programs in ((4096, 16, sms), (4096, 16, 2 * sms), (2048, 8, 4 * sms)):
            chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
            variants[f"{mode}_chunked_b{block}_w{warps}_g{programs}"] = (
                lambda p=programs, c=chunk, s=store, b=block, w=warps: chunked_kernel[(p,)](
                    src, dst, n, c, bases, 1, RANK=0, BLOCK=b, STORE=s, num_warps=w))
    for block, warps, grid in ((4096, 16, None), (4096, 16, 2 * sms), (2048, 8, 4 * sms)):
        programs = triton.cdiv(n, block) if grid is None else grid
        variants[f"generated_store_b{block}_w{warps}_g{grid}"] = (
            lambda p=programs, b=block, w=warps: generated_store_kernel[(p,)](
                dst, n, bases, 1, RANK=0, BLOCK=b, num_warps=w))
    peer_buffer = torch.empty(n, device="cuda:1")
    variants["peer_copy"] = lambda: peer_buffer.copy_(src, non_blocking=True)
    return variants


def _run(rank: int, size: int, repeats: int) -> dict:
    # Device-side tensor descriptors need scratch memory from the launching process.
    triton.set_allocator(lambda nbytes, alignment, stream: torch.empty(nbytes, dtype=torch.int8, device="cuda"))
    ctx = iris.create("triton", heap_size=2 * size + (64 << 20))
    n = size // 4
    src = ctx.randn(n, generator=torch.Generator(ctx.device).manual_seed(rank))
    dst = ctx.zeros(n)
    result = {}
    ctx.barrier()
    if rank == 0:
        variants = _variants(ctx, src, dst, n)
        peer_dst, peer_src = ctx.heap.peer_view(dst, 1), ctx.heap.peer_view(src, 1)
        correct = {}
        generated = (torch.arange(n, device=ctx.device) % 4096).float()
        for name, launch in variants.items():
            if name == "peer_copy":
                continue
            written, expected = {"store": (peer_dst, src), "load": (dst, peer_src),
                                 "generated": (peer_dst, generated)}[name.split("_")[0]]
            written.zero_()
            torch.cuda.synchronize()
            launch()
            torch.cuda.synchronize()
            correct[name] = bool(torch.equal(written, expected))
        samples = {name: [] for name in variants}
        for _ in range(repeats):
            for name, launch in variants.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end))
        result = {"bytes": size, "repeats": repeats, "correct": correct,
                  "GBps_median": {k: size / statistics.median(v) / 1e6 for k, v in samples.items()},
                  "GBps_best": {k: size / min(v) / 1e6 for k, v in samples.items()}}
    ctx.barrier()
    ctx.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1GiB")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("rma_variants needs 2 GPUs")
    from benchmarks.common import write_results

    result = iris.spawn(_run, 2, parse_size(args.size), args.repeats, device="cuda")[0]
    for name, median in result["GBps_median"].items():
        print(f"{name:36s} median {median:7.1f}  best {result['GBps_best'][name]:7.1f} GB/s  "
              f"correct {result['correct'].get(name, '-')}")
    print(f"wrote {write_results('rma_variants', result, args.out)}")


if __name__ == "__main__":
    main()
