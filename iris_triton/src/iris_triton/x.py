"""Tile-level communication inside kernels, importable as upstream iris's ``iris.x``: the tile and matrix views
of :mod:`iris_triton.tiles.views` and the tile collectives of :mod:`iris_triton.tiles.collectives`, for
``@triton.jit`` and ``@gluon.jit`` kernels alike. ``DeviceContext`` is the Triton backend's device
context (``iris.x.DeviceContext(rank, world_size, heap_bases)``, as upstream's tile kernels build
it). The backend declares this module as ``iris.x`` (``Backend.device_modules``)."""

from iris_triton.device.context import DeviceContext
from iris_triton.tiles.collectives import (all_gather, all_reduce, all_reduce_one_shot, all_reduce_two_shot,
                                          all_to_all, broadcast, gather, reduce_scatter)
from iris_triton.tiles.views import (Tile, TensorView, TileView, make_tensor_view, offset_ptr, tile_indices,
                                     tile_layout, tile_ptr)

__all__ = ["DeviceContext", "TensorView", "Tile", "TileView", "all_gather", "all_reduce", "all_reduce_one_shot",
           "all_reduce_two_shot", "all_to_all", "broadcast", "gather", "make_tensor_view", "offset_ptr",
           "reduce_scatter", "tile_indices", "tile_layout", "tile_ptr"]
