"""Per-program call counts, kept on the device by the kernels themselves.

Kernels that synchronise with their peers program by program (program ``p`` of one rank with
program ``p`` of another) number their calls without host work, so they can be captured in CUDA
graphs: program ``p`` reads its count at the start of a call and advances it at the end. A grid
may be smaller than the ``capacity`` the counts are laid out for; program ``p`` then also
advances the counts of the indices it stands in for (``p + k * grid``), so every index counts
every call and all programs of a call, whatever the grid, agree on its number. It stores them as
vectors of ``LANES`` indices: a one-program call stands in for every index, and one store per
index in turn cost it microseconds on GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from iris_triton.device import functions as device

__all__ = ["LANES", "announce", "announce_kernel", "announcements_of", "call_number", "count_call", "headers_of",
           "header_value"]

#: Indices one vector store of :func:`count_call` advances (the length of its ``lanes``).
LANES = tl.constexpr(128)


@triton.jit
def call_number(calls):
    """How many calls this program's index has seen before this one (0 for the first)."""
    return tl.load(calls + tl.program_id(0))


@triton.jit
def count_call(calls, capacity, call, lanes):
    """End of call ``call``: this program's index, and those it stands in for, have seen ``call + 1``.
    ``lanes`` is ``[0, LANES)`` in the caller's layout (Triton's ``tl.arange``, or the device
    context's ``block_offsets`` in a kernel shared by both front ends)."""
    for first in range(0, capacity, LANES):  # the k-th index of this program is p + k * grid
        index = tl.program_id(0) + (first + lanes) * tl.num_programs(0)
        tl.store(calls + index, call + 1, mask=index < capacity)


# -- announcing a call ---------------------------------------------------------------------------------
# A call announces itself to its peers: its programs write ``header_value(call, SIGNATURE)`` into every
# peer's header ``[call & 1, RANK]``, one word per source rank that every program of the call and every
# algorithm writes alike (a program writes it before its first signal), and a receiver compares what a
# peer announced with its own before it takes that peer's data. The call's number tells this call from
# one two calls back (the same slot); the signature (:attr:`iris.collectives.CollectiveCall.signature`)
# tells a different call of the same number, whatever algorithm, grid or workspace the peer's call
# chose: every wait of these protocols reads the headers while it waits
# (:func:`iris_triton.protocol.waits.wait_for_call`), so ranks that made different calls meet there at once.
# The headers follow the flags in the collectives' sync words, then one *announcement* word per source
# rank: a rank about to wait on the host for its peers (a workspace growing) announces the call it is
# in there first (:func:`announce_kernel`), so that a peer already waiting on the device in another
# call finds the mismatch, and comes to the host exchange; once the exchange found every rank in the
# same call, it takes the announcement back (the call may not reach its kernel, or may have none
# here, as the fused GEMMs').


@triton.jit
def headers_of(sync, programs, call, WORLD: tl.constexpr):
    """The row of headers (one per source rank) for call ``call``, the same for every program."""
    return sync + programs * (2 + WORLD) + (call & 1) * WORLD


@triton.jit
def announcements_of(headers, announced, world):
    """The row of announcements (one per source rank), from the row of ``headers`` of the call that
    announces ``announced`` (:func:`header_value`): two rows of headers on from the first."""
    return headers + (2 - (((announced >> 16) - 1) & 1)) * world


@triton.jit
def header_value(call, signature):
    """What call ``call`` of signature ``signature`` (16 bits, never 0) announces: never 0."""
    return ((call + 1) << 16) | signature


@triton.jit
def announce(dctx, headers, value, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Write ``value`` into every peer's header ``RANK`` of ``headers``."""
    for q in tl.static_range(WORLD):
        if q != RANK:
            dctx.store(headers + RANK, value, q)


@triton.jit
def announce_kernel(sync, programs, heap_bases, signature, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Announce this rank's next call (the number program 0 reads from the sync words ``sync``, laid
    out for ``programs``) with ``signature`` in every peer's announcement word ``RANK``; a
    ``signature`` of 0 takes the announcement back. One program."""
    call = tl.load(sync)
    headers = headers_of(sync, programs, call, WORLD)
    value = header_value(call, signature)
    words = announcements_of(headers, value, WORLD)
    for q in tl.static_range(WORLD):
        if q != RANK:
            device.store(words + RANK, tl.where(signature != 0, value, 0), RANK, q, heap_bases)
