"""Matrix products fused with their communication: persistent kernels with tile-level signals.

- :func:`push_rows_kernel` + :func:`all_gather_matmul_kernel` (``out = all_gather(A) @ B``): a
  few programs copy this rank's rows of ``A`` into every rank's gathered copy of ``A`` (heap),
  ``BLOCK_M`` rows at a time, and after each such row tile set a flag on every rank; the GEMM,
  a persistent kernel on the remaining multiprocessors, computes the tiles of this rank's own
  rows first and waits for a row tile's flag before it computes the tiles that need it. The two
  kernels run at the same time, on two streams. Where the GEMM's last wave would leave programs
  idle, its tiles are cut along K among them (:func:`iris_triton.operations.gemm.split_parts`).
- :func:`matmul_reduce_scatter_kernel` (``out = reduce_scatter(A @ B)``): one persistent
  kernel. It first computes the tiles of the rows other ranks own and stores each into its
  owner's receive buffer (remote stores) followed by a flag; then it computes the tiles of its
  own rows and adds what the peers sent, waiting for each tile's flag.

Every call announces itself to its peers the way the collectives' calls do
(:mod:`iris_triton.protocol.calls`): before its first signal, each program that signals writes the call's
header (its number and signature, the signature of the call's description: operation, shapes,
dtypes, method and tile) into every peer's header row of the call (one row per call parity, in
the kernel's state words), and every wait reads the peers' headers while it spins and checks the
header of the peer whose flag arrived (:func:`iris_triton.protocol.waits.wait_for_peer_call`): a peer in a
different call of the same number is recorded as a mismatch, with both headers, and the output is
NaN (the host raises :class:`iris.errors.CallMismatchError`, naming both calls).

Data lands in one of two slots by call parity, placed by the buffer's size (not the call's
shape, so calls of different shapes never overlap slots); flags and call counts are per program
(:mod:`iris_triton.protocol.calls`) and only grow, so calls need no host work and no resetting. A rank's
call ``k + 2`` reuses the slot of call ``k`` only after it exchanged call ``k + 1``'s data with
every peer, which the peers sent after finishing call ``k``. Every wait is bounded in wall-clock
time; one that gives up records the failure and the kernel fills its output with NaN
(:mod:`iris_triton.protocol.waits`) instead of hanging.
"""

from __future__ import annotations

import triton
import triton.language as tl

from iris_triton.protocol.calls import LANES, announce, call_number, count_call, header_value
from iris_triton.device.context import DeviceContext
from iris_triton.operations.gemm import loop_unit, loop_units, row_block_tile, tile_coordinates, tile_sum
from iris_triton.device.tracing import COMPUTE_EVENT, OPERATION_EVENT, PUSH_EVENT, WAIT_EVENT
from iris_triton.protocol.waits import CUT_PART, failed, poison, record_failure, site_code, wait_for_peer_call

__all__ = ["all_gather_matmul_kernel", "matmul_reduce_scatter_kernel", "push_rows_kernel"]

#: What a wait of each GEMM records when it gives up on a peer.
ALL_GATHER_MATMUL_SITE: tl.constexpr = tl.constexpr(site_code("all_gather_matmul"))
MATMUL_REDUCE_SCATTER_SITE: tl.constexpr = tl.constexpr(site_code("matmul_reduce_scatter"))


@triton.jit
def push_rows_kernel(context, shard, gathered, flags, calls, headers, signature, capacity, m, K,
                     stride_sm, stride_sk, flag_stride, slot_stride, RANK: tl.constexpr, WORLD: tl.constexpr,
                     TRACING: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Copy this rank's ``m x K`` ``shard`` into rows ``[RANK * m, (RANK + 1) * m)`` of the call's
    slot of every rank's ``gathered`` (heap; two slots ``slot_stride`` elements apart, each
    ``WORLD * m x K``), one tile of ``BLOCK_M`` rows at a time; after each tile set flag
    ``[RANK, tile]`` (``flags`` rows ``flag_stride`` apart) on every rank to the call's number,
    having first announced the call (``signature``) in header ``RANK`` of the call's row of
    ``headers`` on every peer. On a failed context it sends nothing."""
    dctx = DeviceContext.initialize(context, RANK, WORLD, TRACING)
    call = call_number(calls)
    slot = gathered + (call & 1) * slot_stride
    offs_k = tl.arange(0, BLOCK_K)
    alive = not failed(dctx)
    if alive:
        announce(dctx, headers + (call & 1) * WORLD, header_value(call, signature), RANK, WORLD)
    tiles = tl.where(alive, tl.cdiv(m, BLOCK_M), 0)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        pushing = dctx.tracing.begin(PUSH_EVENT, nbytes=BLOCK_M * K * (shard.dtype.element_ty.primitive_bitwidth // 8),
                                tile=tile, op=call)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            cols = k * BLOCK_K + offs_k
            mask = (rows[:, None] < m) & (cols[None, :] < K)
            x = tl.load(shard + rows[:, None] * stride_sm + cols[None, :] * stride_sk, mask=mask)
            target = slot + (RANK * m + rows[:, None]) * K + cols[None, :]
            for q in tl.static_range(WORLD):
                dctx.store(target, x, q, mask=mask)
        for q in tl.static_range(WORLD):
            dctx.signal(flags + RANK * flag_stride + tile, call + 1, q)
        dctx.tracing.end(pushing)
    count_call(calls, capacity, call, tl.arange(0, LANES))


@triton.jit
def all_gather_matmul_kernel(context, gathered, b, out, a_desc, b_desc, flags, calls, headers, signature, capacity,
                             partials, arrived, parts, m, N, K, stride_bk, stride_bn, stride_om, stride_on,
                             flag_stride, slot_stride, RANK: tl.constexpr, WORLD: tl.constexpr, TRACING: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                             B_COLUMN_MAJOR: tl.constexpr):
    """``out`` (``WORLD * m x N``) := the call's slot of ``gathered`` times ``b`` (``K x N``),
    source rank by source rank from this one on; a tile waits for the flag of its row tile, and
    for the header its source announced (:func:`push_rows_kernel`) to be this call's (``signature``).
    A wait that gives up fills ``out`` (contiguous) with NaN (:mod:`iris_triton.protocol.waits`).
    ``TMA``: the tiles are read through ``a_desc`` (``gathered`` as ``[2, WORLD, m, K]``) and
    ``b_desc`` (:func:`iris_triton.operations.gemm.row_block_tile`), else by plain loads. The
    tiles of a last, partial wave are cut into ``parts`` along K
    (:func:`iris_triton.operations.gemm.split_parts`), their sums meeting in ``partials`` (float32
    tiles, this rank's) as ``arrived`` (a word each, 0 between calls) says."""
    dctx = DeviceContext.initialize(context, RANK, WORLD, TRACING)
    call = call_number(calls)
    row = headers + (call & 1) * WORLD  # the call's headers, one per source rank
    announced = header_value(call, signature)
    span = dctx.tracing.begin(OPERATION_EVENT + ALL_GATHER_MATMUL_SITE, op=call)
    ok = not failed(dctx)  # every wait so far succeeded, on a context that had not failed before
    slot = gathered + (call & 1) * slot_stride
    row_tiles = tl.cdiv(m, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    per_source = row_tiles * col_tiles
    tiles = WORLD * per_source
    steps = tl.cdiv(K, BLOCK_K)
    for unit in range(tl.program_id(0), loop_units(tiles, parts), tl.num_programs(0)):
        t, part, first, end = loop_unit(unit, tiles, parts, steps)
        if t < tiles:
            source = (RANK + t // per_source) % WORLD
            tile_row, tile_col = tile_coordinates(t % per_source, row_tiles, col_tiles, GROUP_M)
            waiting = dctx.tracing.begin(WAIT_EVENT, source, tile=tile_row, op=call)
            ok = ok & wait_for_peer_call(dctx, flags + source * flag_stride + tile_row, call + 1, source, row,
                                         announced, ALL_GATHER_MATMUL_SITE)
            dctx.tracing.end(waiting)
            computing = dctx.tracing.begin(COMPUTE_EVENT, source, tile=tile_row, tile_n=tile_col, op=call)
            acc, offs_m, offs_n = row_block_tile(slot, b, a_desc, b_desc, call & 1, source, m, N, K, K, 1, stride_bk,
                                                 stride_bn, tile_row, tile_col, first, end, BLOCK_M, BLOCK_N, BLOCK_K,
                                                 EVEN_K, TMA, B_COLUMN_MAJOR)
            acc, summed, whole = tile_sum(acc, t, part, tiles, parts, partials, arrived, dctx.failstop.timeout_ns,
                                          BLOCK_M, BLOCK_N)
            if not summed:
                record_failure(dctx, RANK, CUT_PART * 256 + ALL_GATHER_MATMUL_SITE)
                ok = False
            if whole:
                rows = source * m + offs_m
                tl.store(out + rows[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out.dtype.element_ty),
                         mask=(offs_m[:, None] < m) & (offs_n[None, :] < N))
            dctx.tracing.end(computing)
    count_call(calls, capacity, call, tl.arange(0, LANES))
    if not ok:
        poison(dctx, out, WORLD * m * N, BLOCK_M * BLOCK_N)
    dctx.tracing.end(span)


@triton.jit
def matmul_reduce_scatter_kernel(context, a, b, out, recv, a_desc, b_desc, flags, calls, headers, signature,
                                 capacity, m, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_om, stride_on,
                                 flag_stride, slot_stride, RANK: tl.constexpr, WORLD: tl.constexpr,
                                 TRACING: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                                 EVEN_K: tl.constexpr, TMA: tl.constexpr, B_COLUMN_MAJOR: tl.constexpr):
    """``out`` (``m x N``) := row block ``RANK`` (rows ``[RANK * m, (RANK + 1) * m)``) of
    ``a @ b`` summed over ranks. Row block q's tiles go to rank q's ``recv`` (heap; two slots
    ``slot_stride`` elements apart, each ``[WORLD, m, N]``), slot of the call, part ``RANK``, each
    followed by flag ``[RANK, tile]`` there; before its first signal a program announces the call
    (``signature``) in header ``RANK`` of the call's row of ``headers`` on every peer, and a wait
    checks the header of the peer whose flag it waited for. A wait that gives up fills ``out``
    (contiguous) with NaN (:mod:`iris_triton.protocol.waits`). ``TMA``: the tiles are read
    through ``a_desc`` (``a`` as ``[1, WORLD, m, K]``) and ``b_desc``
    (:func:`iris_triton.operations.gemm.row_block_tile`), else by plain loads."""
    dctx = DeviceContext.initialize(context, RANK, WORLD, TRACING)
    call = call_number(calls)
    span = dctx.tracing.begin(OPERATION_EVENT + MATMUL_REDUCE_SCATTER_SITE, op=call)
    alive = not failed(dctx)  # a failed context sends peers nothing, and its output is NaN
    ok = alive  # and every wait so far succeeded
    row = headers + (call & 1) * WORLD  # the call's headers, one per source rank
    announced = header_value(call, signature)
    if alive:
        announce(dctx, row, announced, RANK, WORLD)
    slot = recv + (call & 1) * slot_stride
    row_tiles = tl.cdiv(m, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    per_block = row_tiles * col_tiles
    for step in tl.static_range(1, WORLD):
        owner = (RANK + step) % WORLD  # a new value each step: not an annotated constexpr, which cannot be reassigned
        for t in range(tl.program_id(0), per_block, tl.num_programs(0)):
            tile_row, tile_col = tile_coordinates(t, row_tiles, col_tiles, GROUP_M)
            computing = dctx.tracing.begin(COMPUTE_EVENT, owner, tile=tile_row, tile_n=tile_col, op=call)
            acc, offs_m, offs_n = row_block_tile(a, b, a_desc, b_desc, 0, owner, m, N, K, stride_am, stride_ak,
                                                  stride_bk, stride_bn, tile_row, tile_col, 0, tl.cdiv(K, BLOCK_K),
                                                  BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, B_COLUMN_MAJOR)
            mask = (offs_m[:, None] < m) & (offs_n[None, :] < N)
            part = slot + RANK * m * N + offs_m[:, None] * N + offs_n[None, :]
            if alive:
                dctx.store(part, acc.to(out.dtype.element_ty), owner, mask=mask)
                dctx.signal(flags + RANK * flag_stride + t, call + 1, owner)
            dctx.tracing.end(computing)
    for t in range(tl.program_id(0), per_block, tl.num_programs(0)):
        tile_row, tile_col = tile_coordinates(t, row_tiles, col_tiles, GROUP_M)
        computing = dctx.tracing.begin(COMPUTE_EVENT, tile=tile_row, tile_n=tile_col, op=call)
        acc, offs_m, offs_n = row_block_tile(a, b, a_desc, b_desc, 0, RANK, m, N, K, stride_am, stride_ak, stride_bk,
                                              stride_bn, tile_row, tile_col, 0, tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N,
                                              BLOCK_K, EVEN_K, TMA, B_COLUMN_MAJOR)
        mask = (offs_m[:, None] < m) & (offs_n[None, :] < N)
        for source in tl.static_range(WORLD):
            if source != RANK:
                waiting = dctx.tracing.begin(WAIT_EVENT, source, tile=tile_row, tile_n=tile_col, op=call)
                ok = ok & wait_for_peer_call(dctx, flags + source * flag_stride + t, call + 1, source, row, announced,
                                             MATMUL_REDUCE_SCATTER_SITE)
                dctx.tracing.end(waiting)
                part = slot + source * m * N + offs_m[:, None] * N + offs_n[None, :]
                acc += tl.load(part, mask=mask).to(tl.float32)
        tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(out.dtype.element_ty),
                 mask=mask)
        dctx.tracing.end(computing)
    count_call(calls, capacity, call, tl.arange(0, LANES))
    if not ok:
        poison(dctx, out, m * N, BLOCK_M * BLOCK_N)
    dctx.tracing.end(span)
