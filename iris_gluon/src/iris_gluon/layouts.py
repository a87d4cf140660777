"""Layouts for blocks and tiles of memory traffic in Gluon kernels."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["WARP_SIZE", "block_layout", "tile_layout", "warp_layout"]

#: Bytes one thread moves per memory instruction at most (``ld.global.v4.b32``).
VECTOR_BYTES = 16
#: Threads of a warp on NVIDIA GPUs (AMD's wavefronts have 64).
WARP_SIZE = 32


@gluon.constexpr_function
def warp_layout(num_warps=1, per_thread=1):
    """The 1-D blocked layout of ``per_thread`` contiguous elements per thread, over ``num_warps``
    warps of :data:`WARP_SIZE` threads: what a Gluon kernel written for AMD's 64-lane wavefronts
    spells ``gl.BlockedLayout([1], [64], [1], [0])``, which does not compile for NVIDIA GPUs.
    Called in a kernel as ``layout: gl.constexpr = warp_layout()``."""
    return gl.BlockedLayout([per_thread], [WARP_SIZE], [num_warps], [0])


@gluon.constexpr_function
def block_layout(block, element_bits, num_warps):
    """A blocked layout of ``block`` elements in which each thread owns 16 contiguous bytes
    (fewer when the block is too small to give every thread that much) and neighbouring threads
    own neighbouring vectors, so a warp's access is one coalesced run of memory."""
    per_thread = max(1, min(VECTOR_BYTES * 8 // element_bits, block // (WARP_SIZE * num_warps)))
    return gl.BlockedLayout([per_thread], [WARP_SIZE], [num_warps], [0])


@gluon.constexpr_function
def tile_layout(block_m, block_n, element_bits, num_warps):
    """A blocked layout of a ``block_m x block_n`` tile of a row-major matrix in which each thread
    owns up to 16 contiguous bytes of a row and neighbouring threads own neighbouring vectors
    along the row, then the next rows, so that a warp's accesses are coalesced runs."""
    per_thread = max(1, min(VECTOR_BYTES * 8 // element_bits, block_n))
    across = max(1, min(WARP_SIZE, block_n // per_thread))
    return gl.BlockedLayout([1, per_thread], [WARP_SIZE // across, across], [num_warps, 1], [1, 0])
