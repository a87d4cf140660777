"""Four ways to combine a matrix product with communication, checked against torch.

1. GEMM + all-scatter (written here with iris's device API): ``B`` is split by columns across
   ranks; each rank computes its columns of ``C = A @ B`` tile by tile and stores every tile
   straight into every rank's ``C`` on the heap (remote stores), so all ranks end with the whole
   ``C`` without a separate collective.
2. Producer/consumer with a separate communication kernel: ``ctx.ops.all_gather_matmul`` with
   ``method="fused"``: a few programs push rows of ``A`` to the peers and set a flag per row
   tile, while the GEMM kernel consumes row tiles as their flags arrive.
3. Producer/consumer with the copy engines: ``method="copy_engine"``: this rank's rows of ``A``
   are copied into the peers' heaps by DMA while cuBLAS multiplies them; the peers' rows are
   multiplied once their flag arrives.
4. Bulk-synchronous baseline: ``method="sequential"``: an iris all_gather, then ``torch.matmul``.

    python examples/fused_patterns.py [--m 64] [--k 64] [--n 48]

Runs on 2 GPUs when there are (raise the sizes there, e.g. ``--m 4096 --k 8192 --n 5120``), else
on 2 CPU ranks (Triton's interpreter).
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

import iris
from iris_triton.operations.gemm import tile_coordinates, tile_product
from iris_triton.tuning import GEMM_SHAPES


@triton.jit
def gemm_all_scatter_kernel(a, b, c, heap_bases, M, N_local, K, RANK: tl.constexpr, WORLD: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    """``c[:, RANK * N_local:(RANK + 1) * N_local] = a @ b`` on every rank (``c`` on the heap)."""
    row_tiles, col_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N_local, BLOCK_N)
    for t in range(tl.program_id(0), row_tiles * col_tiles, tl.num_programs(0)):
        tile_row, tile_col = tile_coordinates(t, row_tiles, col_tiles, GROUP_M)
        acc, rows, cols = tile_product(a, b, M, N_local, K, K, 1, N_local, 1, tile_row, tile_col, BLOCK_M,
                                       BLOCK_N, BLOCK_K)
        target = c + rows[:, None] * (WORLD * N_local) + RANK * N_local + cols[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N_local)
        for q in tl.static_range(WORLD):
            iris.store(target, acc.to(c.dtype.element_ty), RANK, q, heap_bases, mask=mask)


def _timed(ctx, fn) -> tuple[object, float]:
    ctx.barrier()
    start = time.perf_counter()
    result = fn()
    ctx.barrier()
    return result, (time.perf_counter() - start) * 1e3


def run(rank: int, m: int, k: int, n: int) -> list[tuple[str, bool, float]]:
    ctx = iris.create()
    world, device = ctx.world_size, ctx.device
    g = torch.Generator().manual_seed(0)  # every rank makes every rank's inputs, to check against torch
    a_shards = [(torch.randn(m, k, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(world)]
    b_full = torch.randn(k, world * n, generator=g).to(torch.bfloat16)
    a_full = torch.cat(a_shards).float()
    results = []

    # 1. GEMM + all-scatter: every rank has all of A, B split by columns.
    config = GEMM_SHAPES[device.type]
    a = a_full.to(torch.bfloat16).to(device)
    b_mine = b_full[:, rank * n:(rank + 1) * n].contiguous().to(device)
    c = ctx.zeros(world * m, world * n, dtype=torch.bfloat16)
    tiles = triton.cdiv(world * m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    grid = (min(tiles, ctx.get_cu_count()),)
    _, ms = _timed(ctx, lambda: gemm_all_scatter_kernel[grid](a, b_mine, c, ctx.get_heap_bases(), world * m, n, k,
                                                              RANK=rank, WORLD=world, **config))
    expected = a_full @ b_full.float()
    results.append(("GEMM + all-scatter", torch.allclose(c.float().cpu(), expected, rtol=3e-2, atol=3e-2), ms))

    # 2. to 4.: A split by rows, this rank's columns of B.
    out = torch.empty(world * m, n, dtype=torch.bfloat16, device=device)
    expected = a_full @ b_full[:, rank * n:(rank + 1) * n].float()
    for name, method in (("producer/consumer (fused)", "fused"), ("producer/consumer (copy engines)", "copy_engine"),
                         ("bulk-synchronous", "sequential")):
        _, ms = _timed(ctx, lambda f=method: ctx.ops.all_gather_matmul(out, a_shards[rank].to(device), b_mine,
                                                                       method=f))
        results.append((name, torch.allclose(out.float().cpu(), expected, rtol=3e-2, atol=3e-2), ms))
    ctx.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=64, help="rows of A per rank")
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--n", type=int, default=48, help="columns of B per rank")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    results = iris.spawn(run, 2, args.m, args.k, args.n, device=device)
    print(f"2 {device} ranks, A {2 * args.m} x {args.k}, B {args.k} x {2 * args.n} (bf16); first calls, "
          f"compilation included")
    correct = [all(rank_results[i][1] for rank_results in results) for i in range(len(results[0]))]
    for (name, _, ms), ok in zip(results[0], correct):
        print(f"  {name:33s} {'correct' if ok else 'WRONG':8s} {ms:9.1f} ms (rank 0)")
    if not all(correct):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
