"""Upstream iris's ``iris.x``: tile-level collectives as its kernels call them, with its tile and
matrix views and device context. The backend declares this module as ``iris.x``
(``Backend.device_modules``).

``all_gather``, ``all_reduce_atomic``, ``all_reduce_one_shot``, ``all_reduce_two_shot`` and
``reduce_scatter`` are upstream's forms (:mod:`iris_triton.tiles.upstream`: its arguments, its
locks, its results, with waits bounded by the timeout); ``all_to_all`` and ``gather`` take
upstream's arguments as iris's own do. iris's own tile collectives, sequence-numbered per tile
(``import iris_triton.tiles as tiles``), are :mod:`iris_triton.tiles`."""

from iris_triton.device.context import DeviceContext
from iris_triton.tiles.collectives import all_to_all, gather
from iris_triton.tiles.upstream import (all_gather, all_reduce_atomic, all_reduce_one_shot, all_reduce_two_shot,
                                       reduce_scatter)
from iris_triton.tiles.views import (Tile, TensorView, TileView, make_tensor_view, offset_ptr, tile_indices,
                                     tile_layout, tile_ptr)

__all__ = ["DeviceContext", "TensorView", "Tile", "TileView", "all_gather", "all_reduce_atomic", "all_reduce_one_shot",
           "all_reduce_two_shot", "all_to_all", "gather", "make_tensor_view", "offset_ptr", "reduce_scatter",
           "tile_indices", "tile_layout", "tile_ptr"]
