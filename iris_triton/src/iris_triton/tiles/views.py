"""Tiles of a matrix as kernels name them: which tile (:class:`TileView`, :class:`Tile` with its
data), which matrix (:class:`TensorView`), and the pointers and bounds mask of one tile of it.

A kernel that works tile by tile on an ``M x N`` matrix names a tile by its coordinates in the
grid of ``BLOCK_M x BLOCK_N`` tiles and the matrix by its pointer, shape and strides; the tile
collectives of :mod:`iris_triton.tiles.collectives` take both. The names and argument orders are
upstream iris's ``iris.x`` (``TileView(pid_m, pid_n, BLOCK_M, BLOCK_N)``, ``TensorView(ptr, M, N,
stride_m, stride_n)``, ``view.tile_ptr(tile)``), so its tile kernels run unchanged.

Row and column indices carry the compiler hints that keep a tile's rows 16-byte vector accesses.
In a Gluon kernel, indices need a layout: pass the device context (``view.tile_ptr(tile, dctx)``)
and it lays the tile out (``IrisDeviceCtx.tile_indices``); a Triton kernel may leave it out.
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import triton
import triton.language as tl

from iris_triton.device.compiled import device_class, device_constructor, device_method

__all__ = ["Tile", "TensorView", "TileView", "make_tensor_view", "offset_ptr", "tile_indices", "tile_layout",
           "tile_ptr"]


@triton.jit
def tile_indices(pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, dctx=None, ptr=None):
    """Row and column indices of tile ``(pid_m, pid_n)``: ``pid_m * BLOCK_M + [0, BLOCK_M)`` and
    ``pid_n * BLOCK_N + [0, BLOCK_N)``, hinted as runs of contiguous indices. With a device context,
    in the layout it gives ``ptr``'s element type (required in Gluon kernels)."""
    if dctx is None:
        rm = tl.arange(0, BLOCK_M) + pid_m * BLOCK_M  # the tensor first: constants stay out of the sum's type
        rn = tl.arange(0, BLOCK_N) + pid_n * BLOCK_N
    else:
        rm, rn = dctx.tile_indices(ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, BLOCK_M, BLOCK_N)
    return tl.max_contiguous(tl.multiple_of(rm, BLOCK_M), BLOCK_M), tl.max_contiguous(tl.multiple_of(rn, BLOCK_N),
                                                                                      BLOCK_N)


@triton.jit
def tile_layout(pid_m, pid_n, M, N, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """``(rm, rn, mask)``: the row and column indices of tile ``(pid_m, pid_n)`` and the mask of its
    elements inside the ``M x N`` matrix."""
    rm, rn = tile_indices(pid_m, pid_n, BLOCK_SIZE_M, BLOCK_SIZE_N)
    return rm, rn, (rm[:, None] < M) & (rn[None, :] < N)


@triton.jit
def _pointers(ptr, rm, rn, M, N, stride_m, stride_n):
    """Pointers to the elements ``(rm, rn)`` of the matrix at ``ptr`` (64-bit offsets) and the mask
    of those inside it."""
    offsets = rm.to(tl.int64)[:, None] * stride_m + rn.to(tl.int64)[None, :] * stride_n
    return ptr + offsets, (rm[:, None] < M) & (rn[None, :] < N)


@triton.jit
def tile_ptr(ptr, M, N, stride_m, stride_n, pid_m, pid_n, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    """``(pointers, mask)`` of tile ``(pid_m, pid_n)`` of the ``M x N`` matrix at ``ptr`` with strides
    ``(stride_m, stride_n)`` in elements: what ``tl.load``/``tl.store`` and iris's remote accesses take."""
    rm, rn = tile_indices(pid_m, pid_n, BLOCK_SIZE_M, BLOCK_SIZE_N)
    return _pointers(ptr, rm, rn, M, N, stride_m, stride_n)


@triton.jit
def offset_ptr(ptr, stride_m, stride_n, offset_m, offset_n):
    """``ptr`` moved by ``offset_m`` rows and ``offset_n`` columns (64-bit arithmetic)."""
    return ptr + offset_m.to(tl.int64) * stride_m + offset_n.to(tl.int64) * stride_n


@device_method
def _tile_indices_method(self, dctx=None, ptr=None):
    """The tile's row and column indices (no bounds applied): :func:`tile_indices`."""
    return tile_indices(self.pid_m, self.pid_n, self.block_m, self.block_n, dctx, ptr)


@device_method
def _tile_layout_method(self, M, N):
    """``(rm, rn, mask)`` of the tile in an ``M x N`` matrix: :func:`tile_layout`."""
    return tile_layout(self.pid_m, self.pid_n, M, N, self.block_m, self.block_n)


class TileView:
    """Tile ``(pid_m, pid_n)`` of ``block_m x block_n`` elements (coordinates in the grid of tiles)."""

    pid_m: tl.tensor
    pid_n: tl.tensor
    block_m: tl.constexpr
    block_n: tl.constexpr

    @device_constructor
    def __init__(self, pid_m, pid_n, block_m, block_n):
        self.pid_m = pid_m
        self.pid_n = pid_n
        self.block_m = tl.constexpr(block_m)
        self.block_n = tl.constexpr(block_n)

    indices = _tile_indices_method
    layout = _tile_layout_method


TileView = device_class(TileView)


class Tile:
    """A :class:`TileView` with the tile's values (``data``: e.g. a product tile in registers)."""

    pid_m: tl.tensor
    pid_n: tl.tensor
    block_m: tl.constexpr
    block_n: tl.constexpr
    data: tl.tensor

    @device_constructor
    def __init__(self, pid_m, pid_n, block_m, block_n, data):
        self.pid_m = pid_m
        self.pid_n = pid_n
        self.block_m = tl.constexpr(block_m)
        self.block_n = tl.constexpr(block_n)
        self.data = data

    indices = _tile_indices_method
    layout = _tile_layout_method


Tile = device_class(Tile)


class TensorView:
    """The ``M x N`` matrix at ``ptr`` with strides ``(stride_m, stride_n)`` in elements, each a
    run-time value (a kernel argument) or a compile-time constant (which reaches the constructor as
    a plain int, kept as a constant)."""

    ptr: tl.tensor
    M: tl.core.base_value  # a run-time value or a compile-time constant: both are base values
    N: tl.core.base_value
    stride_m: tl.core.base_value
    stride_n: tl.core.base_value

    @device_constructor
    def __init__(self, ptr, M, N, stride_m, stride_n):
        self.ptr = ptr
        self.M = tl.constexpr(M) if isinstance(M, int) else M
        self.N = tl.constexpr(N) if isinstance(N, int) else N
        self.stride_m = tl.constexpr(stride_m) if isinstance(stride_m, int) else stride_m
        self.stride_n = tl.constexpr(stride_n) if isinstance(stride_n, int) else stride_n

    @device_method
    def tile_ptr(self, tile, dctx=None):
        """``(pointers, mask)`` of ``tile`` in this matrix; ``dctx`` lays them out (Gluon)."""
        rm, rn = tile_indices(tile.pid_m, tile.pid_n, tile.block_m, tile.block_n, dctx, self.ptr)
        return _pointers(self.ptr, rm, rn, self.M, self.N, self.stride_m, self.stride_n)

    @device_method
    def tile_ptr_from_indices(self, rm, rn, block_m: tl.constexpr, block_n: tl.constexpr):
        """``(pointers, mask)`` of the elements ``(rm, rn)`` (``block_m`` rows and ``block_n``
        columns of contiguous indices, e.g. a tile's indices moved by an offset)."""
        rm = tl.max_contiguous(tl.multiple_of(rm, block_m), block_m)
        rn = tl.max_contiguous(tl.multiple_of(rn, block_n), block_n)
        return _pointers(self.ptr, rm, rn, self.M, self.N, self.stride_m, self.stride_n)

    @device_method
    def offset_tile_ptr(self, tile, offset_m=0, offset_n=0, src_mask=None, dctx=None):
        """``(pointers, mask)`` of ``tile`` moved by ``offset_m`` rows and ``offset_n`` columns in
        this matrix, the mask and-ed with ``src_mask`` when given (a source tile's bounds)."""
        rm, rn = tile_indices(tile.pid_m, tile.pid_n, tile.block_m, tile.block_n, dctx, self.ptr)
        pointers, mask = _pointers(self.ptr, rm + offset_m, rn + offset_n, self.M, self.N, self.stride_m,
                                   self.stride_n)
        if src_mask is not None:
            mask = mask & src_mask
        return pointers, mask

    @device_method
    def offset(self, offset_m=0, offset_n=0):
        """The view that starts ``offset_m`` rows and ``offset_n`` columns into this one (same sizes
        and strides)."""
        return TensorView(offset_ptr(self.ptr, self.stride_m, self.stride_n, offset_m + 0 * self.M,
                                     offset_n + 0 * self.N), self.M, self.N, self.stride_m, self.stride_n)

    @device_method
    def number_of_tiles(self, block_m, block_n):
        """How many ``block_m x block_n`` tiles cover the matrix."""
        return tl.cdiv(self.M, block_m) * tl.cdiv(self.N, block_n)

    @device_method
    def tile_id(self, tile):
        """``tile``'s number in row-major order of the tiles covering the matrix."""
        return tile.pid_m * tl.cdiv(self.N, tile.block_n) + tile.pid_n


TensorView = device_class(TensorView)


@triton.jit
def make_tensor_view(ptr, M, N, stride_m, stride_n):
    """A :class:`TensorView` whose sizes and strides are run-time values even where constants are
    given (one compiled kernel for every size)."""
    zero = tl.program_id(0) * 0  # a run-time 0: what a constant added to it becomes
    return TensorView(ptr, M + zero, N + zero, stride_m + zero, stride_n + zero)
