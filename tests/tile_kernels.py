"""Kernel sources that call the tile collectives (``iris_triton.tiles``; upstream's ``iris.x``),
shared by tests/test_tile_collectives.py (run by Triton's interpreter on CPU ranks, or compiled on
GPUs) and tests/ptx_kernels.py (compiled for sm_90 by both front ends). Each is an undecorated
source taking the device-context class as ``CTX``, compiled by a front end
(``iris_triton.device.frontend.TRITON`` or ``iris_gluon.frontend.GLUON``).

``tile_collective`` (the library's, :mod:`iris_triton.tiles.kernel`) runs one collective over every
``BLOCK_M x BLOCK_N`` tile of an ``M x N`` matrix; ``unsynchronised_all_gather`` is upstream's form.
"""

from __future__ import annotations

import triton.language as tl

import iris.x as x
from iris_triton.tiles.kernel import COLLECTIVES, tile_collective

__all__ = ["COLLECTIVES", "tile_collective", "unsynchronised_all_gather"]


def unsynchronised_all_gather(src, dst, heap_bases, M: tl.constexpr, N: tl.constexpr, stride_sm: tl.constexpr,
                              stride_sn: tl.constexpr, stride_dm: tl.constexpr, stride_dn: tl.constexpr,
                              RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Upstream iris's tile kernel form (``iris.x``): compile-time sizes and strides straight into
    ``x.TensorView``, ``x.DeviceContext(rank, world, heap_bases)``, and upstream's all_gather, which
    pushes the tile's values into every rank's output without a sync (the host orders the ranks
    around the launch)."""
    ctx = x.DeviceContext(RANK, WORLD, heap_bases)
    src_view = x.TensorView(src, M, N, stride_sm, stride_sn)
    dst_view = x.TensorView(dst, WORLD * M, N, stride_dm, stride_dn)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        view = x.TileView(t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        pointers, mask = src_view.tile_ptr(view)
        x.all_gather(x.Tile(view.pid_m, view.pid_n, BLOCK_M, BLOCK_N, tl.load(pointers, mask=mask)), dst_view, 0, ctx)
