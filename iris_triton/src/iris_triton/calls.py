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

__all__ = ["LANES", "announce", "call_number", "count_call", "headers_of", "header_value"]

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
# A call announces itself to its peers: program ``p`` writes ``header_value(call, SIGNATURE)`` into
# every peer's header ``[call & 1, p, RANK]``, and a receiver compares what a peer announced with its
# own before it takes that peer's data. The call's number tells this call from one two calls back
# (the same slot); the signature (:attr:`iris.collectives.CollectiveCall.signature`) tells a
# different call of the same number. The headers follow the flags in the collectives' sync words.


@triton.jit
def headers_of(sync, programs, call, WORLD: tl.constexpr):
    """This program's row of headers (one per source rank) for call ``call``."""
    return sync + programs * (2 + WORLD) + ((call & 1) * programs + tl.program_id(0)) * WORLD


@triton.jit
def header_value(call, signature):
    """What call ``call`` of signature ``signature`` (16 bits, never 0) announces: never 0."""
    return ((call + 1) << 16) | signature


@triton.jit
def announce(dctx, headers, value, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Write ``value`` into every peer's header ``RANK`` of ``headers`` (this program's row)."""
    for q in tl.static_range(WORLD):
        if q != RANK:
            dctx.store(headers + RANK, value, q)
