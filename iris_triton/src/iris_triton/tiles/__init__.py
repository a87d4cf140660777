"""iris's tile collectives, called from inside kernels (:mod:`~iris_triton.tiles.collectives`:
sequence-numbered per tile with a tile sync, bounded by the timeout), the tile and matrix views
they take (:mod:`~iris_triton.tiles.views`), and the kernel that runs one over every tile of a
matrix (:mod:`~iris_triton.tiles.kernel`). Upstream iris's forms, as its kernels call them
through ``iris.x``, are :mod:`~iris_triton.tiles.upstream`.

In a kernel: ``import iris_triton.tiles as tiles``, then ``tiles.all_reduce(tile, src_view,
dst_view, dctx, sync)``."""

from iris_triton.tiles.collectives import (all_gather, all_reduce, all_reduce_one_shot, all_reduce_two_shot, all_to_all,
                                          broadcast, gather, reduce_scatter)
from iris_triton.tiles.views import (Tile, TensorView, TileView, make_tensor_view, offset_ptr, tile_indices,
                                     tile_layout, tile_ptr)

__all__ = ["Tile", "TensorView", "TileView", "all_gather", "all_reduce", "all_reduce_one_shot", "all_reduce_two_shot",
           "all_to_all", "broadcast", "gather", "make_tensor_view", "offset_ptr", "reduce_scatter", "tile_indices",
           "tile_layout", "tile_ptr"]
