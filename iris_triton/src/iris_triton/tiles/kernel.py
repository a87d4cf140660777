"""A kernel that runs one tile collective (:mod:`iris_triton.tiles.collectives`, ``iris.x``) over
every tile of a matrix: what ``iris compile-check`` compiles the tile collectives in, at every
world size, and what the tests run them in.

``tile_collective`` is an undecorated source taking the device-context class as ``CTX``,
compiled by a front end (:data:`iris_triton.device.frontend.TRITON` or the Gluon backend's). It runs one
collective over every ``BLOCK_M x BLOCK_N`` tile of an ``M x N`` matrix, program ``p`` taking tiles
``p, p + P, ...``; ``COLLECTIVE`` names it, one of :data:`COLLECTIVES`.
"""

from __future__ import annotations

import triton.language as tl

import iris.x as x

__all__ = ["COLLECTIVES", "launch_tile_collective", "tile_collective"]

#: What ``COLLECTIVE`` of :func:`tile_collective` names.
COLLECTIVES = ("all_reduce", "all_reduce_two_shot", "reduce_scatter", "all_gather_rows", "all_gather_columns",
               "all_to_all", "broadcast", "gather")


def tile_collective(context, src, dst, sync, M, N, DM, DN, stride_sm, stride_sn, stride_dm, stride_dn, chunk, root,
                    CTX: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, COLLECTIVE: tl.constexpr,
                    OP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRACING: tl.constexpr):
    """``COLLECTIVE`` of ``src`` (``M x N``) into ``dst`` (``DM x DN``) tile by tile, synchronised
    by ``sync``; ``chunk`` is all_to_all's columns per rank, ``root`` broadcast's root; ``TRACING``
    records the collectives' events (iris.tracing)."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    src_view = x.make_tensor_view(src, M, N, stride_sm, stride_sn)
    dst_view = x.make_tensor_view(dst, DM, DN, stride_dm, stride_dn)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        tile = x.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        if COLLECTIVE == "all_reduce":
            x.all_reduce(tile, src_view, dst_view, dctx, sync, OP)
        elif COLLECTIVE == "all_reduce_two_shot":
            x.all_reduce_two_shot(tile, src_view, dst_view, dctx, sync, OP)
        elif COLLECTIVE == "reduce_scatter":
            x.reduce_scatter(tile, src_view, dst_view, dctx, sync, OP)
        elif COLLECTIVE == "all_gather_rows":
            x.all_gather(tile, src_view, dst_view, 0, dctx, sync)
        elif COLLECTIVE == "all_gather_columns":
            x.all_gather(tile, src_view, dst_view, 1, dctx, sync)
        elif COLLECTIVE == "all_to_all":
            x.all_to_all(tile, src_view, dst_view, chunk, dctx, sync)
        elif COLLECTIVE == "broadcast":
            x.broadcast(tile, src_view, dst_view, root, dctx, sync)
        else:
            tl.static_assert(COLLECTIVE == "gather", "unknown COLLECTIVE")
            data = x.gather(tile, src_view, root, dctx, sync)
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
