"""Per-program call counts, kept on the device by the kernels themselves.

Kernels that synchronise with their peers program by program (program ``p`` of one rank with
program ``p`` of another) number their calls without host work, so they can be captured in CUDA
graphs: program ``p`` reads its count at the start of a call and advances it at the end. A grid
may be smaller than the ``capacity`` the counts are laid out for; program ``p`` then also
advances the counts of the indices it stands in for (``p + k * grid``), so every index counts
every call and all programs of a call, whatever the grid, agree on its number.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["call_number", "count_call"]


@triton.jit
def call_number(calls):
    """How many calls this program's index has seen before this one (0 for the first)."""
    return tl.load(calls + tl.program_id(0))


@triton.jit
def count_call(calls, capacity, call):
    """End of call ``call``: this program's index, and those it stands in for, have seen ``call + 1``."""
    for index in range(tl.program_id(0), capacity, tl.num_programs(0)):
        tl.store(calls + index, call + 1)
