"""Kernel sources that call the tile collectives (``iris.x``), shared by tests/test_tile_collectives.py
(run by Triton's interpreter on CPU ranks, or compiled on GPUs) and tests/ptx_kernels.py (compiled
for sm_90 by both front ends). Each is an undecorated source taking the device-context class as
``CTX``, compiled by a front end (``iris_triton.frontend.TRITON`` or ``iris_gluon.frontend.GLUON``).

``tile_collective`` runs one collective over every ``BLOCK_M x BLOCK_N`` tile of an ``M x N``
matrix, program ``p`` taking tiles ``p, p + P, ...``; ``COLLECTIVE`` names it.
"""

from __future__ import annotations

import triton.language as tl

import iris.x as x

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



def unsynchronised_all_gather(src, dst, heap_bases, M: tl.constexpr, N: tl.constexpr, stride_sm: tl.constexpr,
                              stride_sn: tl.constexpr, stride_dm: tl.constexpr, stride_dn: tl.constexpr,
                              RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Upstream iris's tile kernel form: compile-time sizes and strides straight into
    ``x.TensorView``, ``x.DeviceContext(rank, world, heap_bases)``, and a collective without a
    sync (the host orders the ranks around the launch)."""
    ctx = x.DeviceContext(RANK, WORLD, heap_bases)
    src_view = x.TensorView(src, M, N, stride_sm, stride_sn)
    dst_view = x.TensorView(dst, WORLD * M, N, stride_dm, stride_dn)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        x.all_gather(x.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N), src_view, dst_view, 0, ctx)
