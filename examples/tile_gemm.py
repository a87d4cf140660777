"""Communication inside your own GEMM kernels with iris's tile collectives (``iris_triton.tiles``), checked
against torch.

- ``matmul_all_reduce``: a row-parallel layer. Each rank holds a block of ``A``'s columns and
  the matching rows of ``B``; every program computes a tile of its rank's partial product, writes
  it to the heap and, in the epilogue, all-reduces that tile across ranks: the tile of the full
  product lands in ``out`` while other programs are still multiplying.
- ``all_gather_matmul``: a column-parallel layer. Each rank holds a block of ``A``'s rows; a
  program all-gathers one row tile of every rank's block, then multiplies those gathered rows.

Every collective call is synchronised per tile by a sync from ``ctx.tile_sync(tiles)``: sequence
numbered, bounded by the context's timeout, and on a failure the tile is NaN and the next iris call
raises (``ctx.check()`` here).

    python examples/tile_gemm.py [--m 64] [--n 48] [--k 32]

Runs on 2 GPUs when there are, else on 2 CPU ranks (Triton's interpreter).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import iris
import iris_triton.tiles as tiles

BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 16


def matmul_all_reduce_kernel(context, a, b, partial, out, sync, M, N, K, CTX: tl.constexpr, RANK: tl.constexpr,
                             WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """``out`` := the sum over ranks of ``a @ b`` (row-major ``M x K`` and ``K x N``; ``partial``
    and ``out`` ``M x N``, ``partial`` on the heap)."""
    dctx = CTX.initialize(context, RANK, WORLD)
    partial_view = tiles.make_tensor_view(partial, M, N, N, 1)
    out_view = tiles.make_tensor_view(out, M, N, N, 1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        tile = tiles.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        rm, rn = tile.indices()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            rk = k * BLOCK_K + tl.arange(0, BLOCK_K)
            a_tile = tl.load(a + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b_tile = tl.load(b + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a_tile, b_tile, acc)
        pointers, mask = partial_view.tile_ptr(tile)
        tl.store(pointers, acc.to(partial.dtype.element_ty), mask=mask)
        tiles.all_reduce(tile, partial_view, out_view, dctx, sync)  # the epilogue: this tile, summed over ranks


def all_gather_matmul_kernel(context, a_shard, b, gathered, out, sync, m, N, K, CTX: tl.constexpr,
                             RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """``out`` (``WORLD * m x N``) := ``all_gather(a_shard) @ b``: program ``p`` gathers row tile
    ``p`` of every rank's ``m x K`` shard into ``gathered`` (``WORLD * m x K``), then computes the
    rows of ``out`` it gathered."""
    dctx = CTX.initialize(context, RANK, WORLD)
    shard_view = tiles.make_tensor_view(a_shard, m, K, K, 1)
    gathered_view = tiles.make_tensor_view(gathered, WORLD * m, K, K, 1)
    for t in range(tl.program_id(0), tl.cdiv(m, BLOCK_M), tl.num_programs(0)):
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            tiles.all_gather(tiles.TileView(t, k, BLOCK_M, BLOCK_K), shard_view, gathered_view, 0, dctx, sync)
        for q in range(WORLD):
            rows = q * m + t * BLOCK_M + tl.arange(0, BLOCK_M)
            inside = rows < (q + 1) * m
            for n in range(0, tl.cdiv(N, BLOCK_N)):
                rn = n * BLOCK_N + tl.arange(0, BLOCK_N)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k in range(0, tl.cdiv(K, BLOCK_K)):
                    rk = k * BLOCK_K + tl.arange(0, BLOCK_K)
                    a_tile = tl.load(gathered + rows[:, None] * K + rk[None, :],
                                     mask=inside[:, None] & (rk[None, :] < K), other=0.0)
                    b_tile = tl.load(b + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N),
                                     other=0.0)
                    acc = tl.dot(a_tile, b_tile, acc)
                tl.store(out + rows[:, None] * N + rn[None, :], acc.to(out.dtype.element_ty),
                         mask=inside[:, None] & (rn[None, :] < N))


def _matrices(world: int, m: int, n: int, k: int):
    """The full ``A`` (``world * m x world * k``) and ``B`` (``world * k x n``), the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(world * m, world * k, generator=g), torch.randn(world * k, n, generator=g)


def _run(rank: int, m: int, n: int, k: int) -> dict:
    with iris.create(heap_size="64MiB") as ctx:
        world, front = ctx.world_size, ctx.frontend
        a, b = (t.to(ctx.device) for t in _matrices(world, m, n, k))
        common = dict(CTX=front.device_context, RANK=rank, WORLD=world, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                      BLOCK_K=BLOCK_K)
        programs = 4

        # Row-parallel: A's columns and B's rows split over ranks; all of A's rows.
        M = world * m
        a_cols = a[:, rank * k:(rank + 1) * k].contiguous()
        b_rows = b[rank * k:(rank + 1) * k].contiguous()
        partial, out = ctx.zeros(M, n), ctx.zeros(M, n)
        sync = ctx.tile_sync(triton.cdiv(M, BLOCK_M) * triton.cdiv(n, BLOCK_N))
        front.kernel(matmul_all_reduce_kernel)[(programs,)](ctx.get_device_context(), a_cols, b_rows, partial, out,
                                                            sync, M, n, k, **common)
        ctx.check()
        reduced_error = (out - a @ b).abs().max().item()

        # Column-parallel: A's rows split over ranks; all of A's columns.
        K = world * k
        a_rows = ctx.as_symmetric(a[rank * m:(rank + 1) * m].contiguous())
        gathered, product = ctx.zeros(M, K), torch.zeros(M, n, device=ctx.device)
        sync = ctx.tile_sync(triton.cdiv(m, BLOCK_M) * triton.cdiv(K, BLOCK_K))
        front.kernel(all_gather_matmul_kernel)[(programs,)](ctx.get_device_context(), a_rows, b, gathered, product,
                                                            sync, m, n, K, **common)
        ctx.check()
        gathered_error = (product - a @ b).abs().max().item()
        return {"matmul_all_reduce": reduced_error, "all_gather_matmul": gathered_error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=24, help="rows of A per rank")
    parser.add_argument("--n", type=int, default=40, help="columns of B")
    parser.add_argument("--k", type=int, default=20, help="columns of A (rows of B) per rank")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    errors = iris.spawn(_run, 2, args.m, args.n, args.k, device=device)
    worst = {name: max(e[name] for e in errors) for name in errors[0]}
    tolerance = 5e-2 if device == "cuda" else 1e-4  # float32 products; on GPUs tl.dot uses TF32
    ok = all(error <= tolerance for error in worst.values())
    for name, error in worst.items():
        print(f"{name}: largest difference from torch {error:.2e} on 2 {device} ranks")
    print("all match" if ok else "MISMATCH")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
