"""Kernels that run one tile collective over every tile of a matrix: what ``iris compile-check``
compiles the tile collectives in, at every world size, and what the tests run them in.

``tile_collective`` is an undecorated source taking the device-context class as ``CTX``,
compiled by a front end (:data:`iris_triton.device.frontend.TRITON` or the Gluon backend's). It runs one
collective over every ``BLOCK_M x BLOCK_N`` tile of an ``M x N`` matrix, program ``p`` taking tiles
``p, p + P, ...``; ``COLLECTIVE`` names it, one of :data:`COLLECTIVES`. ``upstream_tile_collective``
does the same with upstream iris's forms (:mod:`iris_triton.tiles.upstream`, ``iris.x``), one of
:data:`UPSTREAM_COLLECTIVES`, as upstream's kernels call them: a Triton kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import iris_triton.tiles as tiles
import iris_triton.tiles.upstream as upstream
from iris_triton.device.context import DeviceContext

__all__ = ["COLLECTIVES", "UPSTREAM_COLLECTIVES", "launch_tile_collective", "launch_upstream_tile_collective",
           "tile_collective", "upstream_tile_collective"]

#: What ``COLLECTIVE`` of :func:`tile_collective` names.
COLLECTIVES = ("all_reduce", "all_reduce_two_shot", "reduce_scatter", "all_gather_rows", "all_gather_columns",
               "all_to_all", "broadcast", "gather")
#: What ``COLLECTIVE`` of :func:`upstream_tile_collective` names.
UPSTREAM_COLLECTIVES = ("all_gather_rows", "all_gather_columns", "all_reduce_atomic", "all_reduce_one_shot",
                        "all_reduce_two_shot", "reduce_scatter", "all_to_all", "gather")


def tile_collective(context, src, dst, sync, M, N, DM, DN, stride_sm, stride_sn, stride_dm, stride_dn, chunk, root,
                    CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, COLLECTIVE: tl.constexpr,
                    OP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRACING: tl.constexpr):
    """``COLLECTIVE`` of ``src`` (``M x N``) into ``dst`` (``DM x DN``) tile by tile, synchronised
    by ``sync``; ``chunk`` is all_to_all's columns per rank, ``root`` broadcast's root; ``TRACING``
    records the collectives' events (iris.tracing)."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    src_view = tiles.make_tensor_view(src, M, N, stride_sm, stride_sn)
    dst_view = tiles.make_tensor_view(dst, DM, DN, stride_dm, stride_dn)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        tile = tiles.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        if COLLECTIVE == "all_reduce":
            tiles.all_reduce(tile, src_view, dst_view, dctx, sync, OP)
        elif COLLECTIVE == "all_reduce_two_shot":
            tiles.all_reduce_two_shot(tile, src_view, dst_view, dctx, sync, OP)
        elif COLLECTIVE == "reduce_scatter":
            tiles.reduce_scatter(tile, src_view, dst_view, dctx, sync, OP)
        elif COLLECTIVE == "all_gather_rows":
            tiles.all_gather(tile, src_view, dst_view, 0, dctx, sync)
        elif COLLECTIVE == "all_gather_columns":
            tiles.all_gather(tile, src_view, dst_view, 1, dctx, sync)
        elif COLLECTIVE == "all_to_all":
            tiles.all_to_all(tile, src_view, dst_view, chunk, dctx, sync)
        elif COLLECTIVE == "broadcast":
            tiles.broadcast(tile, src_view, dst_view, root, dctx, sync)
        else:
            tl.static_assert(COLLECTIVE == "gather", "unknown COLLECTIVE")
            data = tiles.gather(tile, src_view, root, dctx, sync)
            pointers, mask = dst_view.tile_ptr(tile, dctx)
            tl.store(pointers, data, mask=mask)


def launch_tile_collective(ctx, collective: str, src, dst, sync, *, op: str = "sum", chunk: int = 1, root: int = 0,
                           programs: int = 2, block: tuple[int, int] = (16, 16)) -> None:
    """Launch :func:`tile_collective` on ``ctx``'s front end: ``collective`` of the 2-D ``src`` into
    ``dst`` with the tile sync ``sync`` (``ctx.tile_sync``), on ``programs`` programs."""
    ctx.frontend.kernel(tile_collective)[(programs,)](
        ctx.get_device_context(), src, dst, sync, src.shape[0], src.shape[1], dst.shape[0], dst.shape[1],
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), chunk, root, CTX=ctx.frontend.device_context,
        RANK=ctx.rank, WORLD=ctx.world_size, COLLECTIVE=collective, OP=op, BLOCK_M=block[0], BLOCK_N=block[1],
        TRACING=ctx.tracing.enabled)


@triton.jit
def upstream_tile_collective(context, src, dst, partial, locks, M, N, DM, DN, stride_sm, stride_sn, stride_dm,
                             stride_dn, RANK: tl.constexpr, WORLD: tl.constexpr, COLLECTIVE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Upstream's ``COLLECTIVE`` of ``src`` (``M x N``) into ``dst`` (``DM x DN``) tile by tile, each
    tile's values loaded from ``src`` as upstream's kernels compute theirs. The reductions that
    pull first store the tile into ``partial`` (contiguous ``M x N`` on the heap) and set
    this rank's ``locks[tile]`` (int32, zeroed; one launch per locks buffer), as upstream's callers do.
    ``all_to_all`` moves column chunks of ``DN // WORLD``; ``gather`` stores the next rank's tile."""
    dctx = DeviceContext.initialize(context, RANK, WORLD)
    src_view = tiles.make_tensor_view(src, M, N, stride_sm, stride_sn)
    partial_view = tiles.make_tensor_view(partial, M, N, N, 1)
    dst_view = tiles.make_tensor_view(dst, DM, DN, stride_dm, stride_dn)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        view = tiles.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        pointers, mask = src_view.tile_ptr(view)
        tile = tiles.Tile(view.pid_m, view.pid_n, BLOCK_M, BLOCK_N, tl.load(pointers, mask=mask, other=0))
        if COLLECTIVE == "all_gather_rows":
            upstream.all_gather(tile, dst_view, 0, dctx)
        elif COLLECTIVE == "all_gather_columns":
            upstream.all_gather(tile, dst_view, 1, dctx)
        elif COLLECTIVE == "all_reduce_atomic":
            upstream.all_reduce_atomic(tile, dst_view, dctx)
        elif COLLECTIVE == "all_to_all":
            tiles.all_to_all(view, src_view, dst_view, DN // WORLD, dctx)
        elif COLLECTIVE == "gather":
            gathered, gathered_mask = dst_view.tile_ptr(view)
            tl.store(gathered, tiles.gather(view, src_view, (RANK + 1) % WORLD, dctx), mask=gathered_mask)
        else:
            staged, staged_mask = partial_view.tile_ptr(view)
            tl.store(staged, tile.data, mask=staged_mask)
            tl.atomic_xchg(locks + dst_view.tile_id(view), 1, sem="release", scope="sys")
            if COLLECTIVE == "all_reduce_one_shot":
                upstream.all_reduce_one_shot(tile, partial_view, dst_view, locks, dctx)
            elif COLLECTIVE == "all_reduce_two_shot":
                upstream.all_reduce_two_shot(tile, partial_view, dst_view, locks, dctx)
            else:
                tl.static_assert(COLLECTIVE == "reduce_scatter", "unknown COLLECTIVE")
                upstream.reduce_scatter(tile, partial_view, dst_view, locks, dctx)


def launch_upstream_tile_collective(ctx, collective: str, src, dst, *, programs: int = 2,
                                    block: tuple[int, int] = (16, 16)) -> None:
    """Run :func:`upstream_tile_collective`: ``collective`` of the 2-D ``src`` into ``dst`` (on the
    heap; zeroed for ``all_reduce_atomic``), with a partial buffer and locks of its own, which it
    frees once every rank's kernel is done (so it waits for the kernel, and raises as
    ``ctx.check()`` does). Collective."""
    tiles_m, tiles_n = -(-dst.shape[0] // block[0]), -(-dst.shape[1] // block[1])
    partial = ctx.zeros(src.shape, dtype=src.dtype)
    locks = ctx.zeros(tiles_m * tiles_n, dtype=torch.int32)
    ctx.barrier()  # every rank's locks zeroed before any peer reads them
    upstream_tile_collective[(programs,)](
        ctx.get_device_context(), src, dst, partial, locks, src.shape[0], src.shape[1], dst.shape[0], dst.shape[1],
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), RANK=ctx.rank, WORLD=ctx.world_size,
        COLLECTIVE=collective, BLOCK_M=block[0], BLOCK_N=block[1])
    ctx.check()
    ctx.barrier()  # no peer still reads this rank's partial tiles or locks
    ctx.free(locks)
    ctx.free(partial)
