"""``IrisDeviceCtx``: the device API of one rank inside ``@gluon.jit`` kernels.

Built from ``ctx.get_device_context()`` as in upstream iris's Gluon kernels::

    dctx = IrisDeviceCtx.initialize(context_tensor)
    offs = dctx.block_offsets(buf, start, BLOCK)
    x = dctx.load(buf + offs, from_rank=peer, mask=offs < n)

Its methods are those of the Triton backend's ``DeviceContext``, one per device function
(``iris_triton.device.functions.DEVICE_FUNCTIONS``): the very functions of
:class:`iris_triton.device.context.DeviceMethods`, generated there, not written again. What differs:
rank and world size are read from the context tensor at run time, so one compiled kernel serves
every rank, and ``block_offsets`` lays a block out explicitly, as Gluon requires. Upstream
iris's field names ``cur_rank`` and ``num_ranks`` hold the same values as ``rank`` and
``world_size``.
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate

from iris_gluon.layouts import block_layout, tile_layout
from iris_triton.device.context import with_device_methods
from iris_triton.device.failstop import FailStop
from iris_triton.device.tracing import DeviceTracing

__all__ = ["IrisDeviceCtx"]


@with_device_methods
class IrisDeviceCtx:
    rank: tl.tensor
    world_size: tl.tensor
    cur_rank: tl.tensor
    num_ranks: tl.tensor
    heap_bases: tl.tensor
    tracing: DeviceTracing
    failstop: FailStop

    @gluon.constexpr_function
    def __init__(self, rank, world_size, heap_bases, tracing=None, failstop=None):
        self.rank = rank
        self.world_size = world_size
        # Upstream iris's names of the same two values.
        self.cur_rank = rank
        self.num_ranks = world_size
        self.heap_bases = heap_bases
        self.tracing = DeviceTracing(False, heap_bases, heap_bases) if tracing is None else tracing
        self.failstop = FailStop(False, heap_bases, heap_bases, heap_bases) if failstop is None else failstop

    @gluon.jit
    def initialize(context_tensor, RANK: gl.constexpr = None, WORLD_SIZE: gl.constexpr = None,
                   tracing: gl.constexpr = False):
        """The context of the calling rank from the tensor ``[rank, world_size, base_0, ...]``
        that ``ctx.get_device_context()`` returns. ``RANK`` and ``WORLD_SIZE``, when given, are
        used as constants instead (the Triton ``DeviceContext.initialize`` signature), so one
        kernel source can build either context; ``tracing`` as for that one."""
        if RANK is None:
            rank = gl.load(context_tensor)
        else:
            rank = gl.to_tensor(RANK)
        if WORLD_SIZE is None:
            world_size = gl.load(context_tensor + 1)
        else:
            world_size = gl.to_tensor(WORLD_SIZE)
        return IrisDeviceCtx(rank, world_size, context_tensor + 2,
                             DeviceTracing.of(context_tensor, world_size, tracing),
                             FailStop.of(context_tensor, world_size))

    @gluon.jit
    def block_offsets(self, ptr, start, BLOCK: gl.constexpr):
        """``start + [0, BLOCK)`` in the layout :func:`~iris_gluon.layouts.block_layout` gives
        ``ptr``'s element type: coalesced 16-byte vectors per thread."""
        layout: gl.constexpr = block_layout(BLOCK, ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps())
        return start + gl.arange(0, BLOCK, layout=layout)

    @gluon.jit
    def tile_indices(self, ptr, first_row, first_column, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """The row and column indices of one tile of ``ptr``'s matrix, in the two slices of the
        layout :func:`~iris_gluon.layouts.tile_layout` gives ``ptr``'s element type, so that
        ``rows[:, None]`` and ``columns[None, :]`` combine into that layout."""
        layout: gl.constexpr = tile_layout(BLOCK_M, BLOCK_N, ptr.dtype.element_ty.primitive_bitwidth, gl.num_warps())
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout)) + first_row
        return rows, gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout)) + first_column


IrisDeviceCtx = aggregate(IrisDeviceCtx)
