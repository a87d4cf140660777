"""A warp-specialized persistent GEMM in Gluon for Hopper: a candidate tile loop of
:mod:`benchmarks.gemm`, timed there against cuBLAS beside the Triton loops.

``c := a @ b`` (bfloat16 operands, float32 accumulation, bfloat16 result; ``a`` row-major
``[M, K]``, ``b`` row-major ``[K, N]``), every operand addressed by a TMA descriptor. Each program
(one per multiprocessor) walks its output tiles in the fused kernels' grouped order and splits its
warps between two partitions: one warp loads the blocks of A and B by TMA into a ring of shared
memory buffers, announcing each full buffer on a ``ready`` barrier and waiting on an ``empty``
barrier before refilling one; the default partition of 8 warps (two warp groups on one 128 x 256
tile) multiplies by ``wgmma``, one group in flight, releases each buffer once the ``wgmma`` that
read it has retired, and stores the tile by TMA in 64-column pieces through two shared buffers
(small enough that a fourth stage of the ring fits). Triton's own ``warp_specialize`` leaves the
schedule to the compiler; here it is written out.

With ``tail_split``, a last partial wave of tiles that fills at most half the programs is run as
128 x 128 halves of its tiles, on twice as many programs, so the wave ends sooner.

Gluon's Hopper operations run on a GPU only (not in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from iris_triton.operations.gemm import describable, tile_coordinates

#: The tile the kernel is written for: two warp groups on 128 x 256, 64 along K.
WS_TILE = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
#: Stages of the ring that fit beside the epilogue's buffers in a multiprocessor's shared memory.
WS_STAGES = range(2, 5)
#: Columns of each piece of a tile the epilogue stores.
EPILOGUE_COLUMNS = 64
#: Warps and registers per thread of the loading partition (the 8 multiplying warps get the rest).
PRODUCER_WARPS = gl.constexpr(1)
PRODUCER_REGISTERS = gl.constexpr(40)


def ws_supports(tile: dict) -> bool:
    """Whether :func:`ws_tile_loop` runs ``tile`` (:data:`WS_TILE`'s shape and warps, a stage
    count of :data:`WS_STAGES`)."""
    fixed = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps")
    return all(tile.get(key) == WS_TILE[key] for key in fixed) and tile.get("num_stages") in WS_STAGES


@gluon.constexpr_function
def _accumulator_layout(block_m, block_n, num_warps):
    """The ``wgmma`` accumulator layout of a ``block_m x block_n`` tile: warps stacked along M, 16
    rows each (a warp group per 64 rows), the whole width in one instruction."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, block_n, 16])


@gluon.constexpr_function
def _log2(power_of_two):
    """The exponent of ``power_of_two``."""
    return power_of_two.bit_length() - 1


@gluon.jit
def _unit_origin(a_desc, b_desc, unit, whole, row_tiles, col_tiles, GROUP_M: gl.constexpr,
                 TAIL_SPLIT: gl.constexpr):
    """``(first row, first column, half)`` of work unit ``unit`` in ``c``: units below ``whole``
    are whole tiles (of the descriptors' blocks), and with ``TAIL_SPLIT`` each later pair of units
    the two halves of a tile (``half``: the unit is half a tile's columns wide)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    past = max(unit - whole, 0) if TAIL_SPLIT else 0
    tile_row, tile_col = tile_coordinates(unit - past + past // 2, row_tiles, col_tiles, GROUP_M)
    return tile_row * BLOCK_M, tile_col * BLOCK_N + past % 2 * (BLOCK_N // 2), TAIL_SPLIT and unit >= whole


@gluon.jit
def _units(a_desc, b_desc, whole, TAIL_SPLIT: gl.constexpr):
    """``(row tiles, column tiles, units, K steps)`` of the product: the tiles, with
    ``TAIL_SPLIT`` those from ``whole`` on counted twice (halves)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    row_tiles = gl.cdiv(a_desc.shape[0], BLOCK_M)
    col_tiles = gl.cdiv(b_desc.shape[1], BLOCK_N)
    units = row_tiles * col_tiles
    if TAIL_SPLIT:
        units = 2 * units - whole
    return row_tiles, col_tiles, units, gl.cdiv(a_desc.shape[1], BLOCK_K)


@gluon.jit
def _load_block(a_desc, b_desc, a_ring, b_ring, ready, empty, first_row, first_col, steps, count):
    """Load the K steps of one block of rows and columns (by ``b_desc``: a whole tile's columns or
    half of them, into the start of each B buffer) into the ring from its ``count``-th buffer on;
    returns the count after them."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    COLUMNS: gl.constexpr = b_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_ring.shape[0]
    for step in range(steps):
        slot = count % STAGES
        # The n-th fill of a slot waits for its n-th release; on the first pass (n = 0) the wait on
        # the phase before the barrier's first passes at once.
        mbarrier.wait(empty.index(slot), (count // STAGES & 1) ^ 1)
        mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [first_row, step * BLOCK_K], ready.index(slot), a_ring.index(slot))
        tma.async_copy_global_to_shared(b_desc, [step * BLOCK_K, first_col], ready.index(slot),
                                        b_ring.index(slot).slice(0, COLUMNS, dim=1))
        count += 1
    return count


@gluon.jit
def _producer(a_desc, b_desc, b_half_desc, a_ring, b_ring, ready, empty, whole, GROUP_M: gl.constexpr,
              TAIL_SPLIT: gl.constexpr):
    """The loading partition: every K step of this program's units, in order, into the ring."""
    row_tiles, col_tiles, units, steps = _units(a_desc, b_desc, whole, TAIL_SPLIT)
    count = 0
    for unit in range(gl.program_id(0), units, gl.num_programs(0)):
        first_row, first_col, half = _unit_origin(a_desc, b_desc, unit, whole, row_tiles, col_tiles, GROUP_M,
                                                  TAIL_SPLIT)
        if half:
            count = _load_block(a_desc, b_half_desc, a_ring, b_ring, ready, empty, first_row, first_col, steps, count)
        else:
            count = _load_block(a_desc, b_desc, a_ring, b_ring, ready, empty, first_row, first_col, steps, count)


@gluon.jit
def _multiply_block(a_ring, b_ring, ready, empty, steps, count, COLUMNS: gl.constexpr, num_warps: gl.constexpr):
    """The product of one block (``COLUMNS`` wide: the start of each B buffer) over its K steps,
    read from the ring from its ``count``-th buffer on; returns the count after them and the
    float32 block."""
    BLOCK_M: gl.constexpr = a_ring.shape[1]
    STAGES: gl.constexpr = a_ring.shape[0]
    acc = gl.zeros((BLOCK_M, COLUMNS), dtype=gl.float32, layout=_accumulator_layout(BLOCK_M, COLUMNS, num_warps))
    for step in range(steps):
        slot = count % STAGES
        mbarrier.wait(ready.index(slot), count // STAGES & 1)
        acc = warpgroup_mma(a_ring.index(slot), b_ring.index(slot).slice(0, COLUMNS, dim=1), acc, use_acc=step > 0,
                            is_async=True)
        # One wgmma left in flight: the previous step's has retired, so its buffer goes back to the
        # producer (the first step's previous buffer was released at the end of the block before).
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=step > 0)
        count += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
    return count, acc


@gluon.jit
def _store_block(acc, c_desc, c_buffers, first_row, first_col):
    """``acc`` in ``c``'s dtype at ``(first_row, first_col)`` of ``c``, by TMA in pieces of
    ``c_desc``'s width through the two buffers of ``c_buffers`` in turn. A buffer is written once
    the store that last read it has finished; the last stores are left in flight."""
    COLUMNS: gl.constexpr = c_desc.block_type.shape[1]
    PIECES: gl.constexpr = acc.shape[1] // COLUMNS
    gl.static_assert(PIECES % 2 == 0, "an even number of pieces, so that each block starts on the first buffer")
    pieces = (acc.to(c_desc.dtype),)
    for _ in gl.static_range(_log2(PIECES)):  # halve every piece's columns
        halves = ()
        for i in gl.static_range(len(pieces)):
            piece = pieces[i]
            halves += piece.reshape(piece.shape[0], 2, piece.shape[1] // 2).permute(0, 2, 1).split()
        pieces = halves
    for i in gl.static_range(PIECES):
        buffer = c_buffers.index(i % 2)
        tma.store_wait(1)
        buffer.store(pieces[i])
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [first_row, first_col + i * COLUMNS], buffer)


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_ring, b_ring, ready, empty, c_buffers, whole, GROUP_M: gl.constexpr,
              TAIL_SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """The default partition: each of this program's units multiplied from the ring and stored."""
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    row_tiles, col_tiles, units, steps = _units(a_desc, b_desc, whole, TAIL_SPLIT)
    count = 0
    for unit in range(gl.program_id(0), units, gl.num_programs(0)):
        first_row, first_col, half = _unit_origin(a_desc, b_desc, unit, whole, row_tiles, col_tiles, GROUP_M,
                                                  TAIL_SPLIT)
        if half:
            count = _multiply_and_store(a_ring, b_ring, ready, empty, c_desc, c_buffers, steps, count, first_row,
                                        first_col, BLOCK_N // 2, num_warps)
        else:
            count = _multiply_and_store(a_ring, b_ring, ready, empty, c_desc, c_buffers, steps, count, first_row,
                                        first_col, BLOCK_N, num_warps)
    tma.store_wait(0)


@gluon.jit
def _multiply_and_store(a_ring, b_ring, ready, empty, c_desc, c_buffers, steps, count, first_row, first_col,
                        COLUMNS: gl.constexpr, num_warps: gl.constexpr):
    """One unit, ``COLUMNS`` wide from ``(first_row, first_col)`` of ``c``, multiplied from the
    ring from its ``count``-th buffer on and stored; returns the count after it."""
    count, acc = _multiply_block(a_ring, b_ring, ready, empty, steps, count, COLUMNS, num_warps)
    _store_block(acc, c_desc, c_buffers, first_row, first_col)
    return count


@gluon.jit
def ws_gemm_kernel(a_desc, b_desc, b_half_desc, c_desc, whole, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   TAIL_SPLIT: gl.constexpr, num_warps: gl.constexpr):
    """``c := a @ b`` by descriptors (``b_half_desc``: half a tile's columns of ``b``), program
    ``p`` taking units ``p, p + P, ...``: tiles, or with ``TAIL_SPLIT`` the tiles before ``whole``
    and the halves of the rest (:func:`_unit_origin`). The ring of ``STAGES`` buffers and its
    barriers are shared by :func:`_producer` and :func:`_consumer`."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_buffers = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_consumer, (a_desc, b_desc, c_desc, a_ring, b_ring, ready, empty, c_buffers, whole, GROUP_M, TAIL_SPLIT,
                     num_warps)),
        (_producer, (a_desc, b_desc, b_half_desc, a_ring, b_ring, ready, empty, whole, GROUP_M, TAIL_SPLIT)),
    ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])


def ws_tile_loop(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tile: dict, programs: int,
                 tail_split: bool = False) -> torch.Tensor:
    """``c := a @ b`` by :func:`ws_gemm_kernel` on at most ``programs`` programs, with ``tile``'s
    stages and ``GROUP_M`` (:func:`ws_supports`); ``tail_split``: a last wave that fills at most
    half the programs as halves of its tiles. Raises ``ValueError`` for what it cannot run
    (:func:`refusal`)."""
    reason = refusal(a, b, c, tile)
    if reason is None and (not isinstance(programs, int) or programs < 1):
        reason = f"programs must be a positive int (one per multiprocessor, say), not {programs!r}"
    if reason is None and not all(runs_on(t.device) for t in (a, b, c)):
        reason = ("Gluon's Hopper operations run on a Hopper GPU (sm_90) only, not in Triton's interpreter: pass "
                  "tensors on such a GPU, with TRITON_INTERPRET unset")
    if reason is not None:
        raise ValueError(reason)
    return _launch(a, b, c, tile, programs, tail_split)


def runs_on(device: torch.device) -> bool:
    """Whether :func:`ws_gemm_kernel` runs on ``device``: a Hopper GPU, Triton's interpreter off."""
    return (device.type == "cuda" and not triton.knobs.runtime.interpret
            and torch.cuda.get_device_capability(device)[0] == 9)


def refusal(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tile: dict) -> str | None:
    """Why :func:`ws_gemm_kernel` cannot compute ``c := a @ b`` with ``tile`` (and what to do
    instead), or None where it can (wherever the operands are)."""
    if not ws_supports(tile):
        return (f"the tile must be {WS_TILE['BLOCK_M']}x{WS_TILE['BLOCK_N']}x{WS_TILE['BLOCK_K']} on "
                f"{WS_TILE['num_warps']} warps with {WS_STAGES.start} to {WS_STAGES.stop - 1} stages, not {tile}")
    if a.dim() != 2 or b.dim() != 2 or c.shape != (a.shape[0], b.shape[1]) or a.shape[1] != b.shape[0]:
        return f"shapes {tuple(a.shape)} @ {tuple(b.shape)} -> {tuple(c.shape)} are not a matrix product"
    if 0 in (*a.shape, b.shape[1]):
        return (f"an empty product ({tuple(a.shape)} @ {tuple(b.shape)}): there is no tile to compute; "
                f"c is empty, or zero where K = 0 (c.zero_())")
    if any(t.dtype != torch.bfloat16 for t in (a, b, c)):
        return f"a, b and c must be bfloat16, not {a.dtype}, {b.dtype} and {c.dtype}: convert them first"
    if b.stride(1) != 1 and b.stride(0) == 1:
        return "b is column-major: pass it row-major (b.contiguous()), or time the loop 'tma b_t' instead"
    for name, t in (("a", a), ("b", b), ("c", c)):
        if not describable(t, t.stride()):
            return (f"TMA cannot address {name} (rows {t.stride(0)} elements apart, column stride {t.stride(1)}): "
                    f"its rows must be contiguous, 16-byte aligned and a multiple of 16 bytes apart "
                    f"(pass {name}.contiguous() with a multiple of 8 columns)")
    return None


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tile: dict, programs: int,
            tail_split: bool) -> torch.Tensor:
    """Launch :func:`ws_gemm_kernel` for operands :func:`refusal` accepts."""
    block_m, block_n, block_k = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    tiles = triton.cdiv(a.shape[0], block_m) * triton.cdiv(b.shape[1], block_n)
    last = tiles % programs
    whole = tiles - last if tail_split and 0 < 2 * last <= programs else tiles
    units = 2 * tiles - whole
    ws_gemm_kernel[(min(programs, units),)](
        _descriptor(a, [block_m, block_k]), _descriptor(b, [block_k, block_n]), _descriptor(b, [block_k, block_n // 2]),
        _descriptor(c, [block_m, EPILOGUE_COLUMNS]), whole, GROUP_M=tile["GROUP_M"], STAGES=tile["num_stages"],
        TAIL_SPLIT=whole < tiles, num_warps=tile["num_warps"])
    return c


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``t`` (bfloat16) in blocks of ``block``, in the default swizzled layout."""
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))
