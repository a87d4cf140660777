"""Wall-clock time inside kernels, for waits bounded in seconds rather than in spins.

Compiled for a GPU, :func:`now_ns` reads the global timer (``%globaltimer``, nanoseconds, the same
clock on every multiprocessor of a GPU); in Triton's interpreter (CPU ranks) it reads the host's
monotonic clock. A bound in spins depends on how fast a wait spins, which load changes many
times over; a bound in nanoseconds does not.
"""

from __future__ import annotations

import time

import triton
import triton.language as tl

from iris_triton.device.compiled import INTERPRETING

__all__ = ["INTERPRETING", "now_ns", "read_device_clock", "spin_pause"]

#: The longest pause between two polls of a wait on CPU ranks (seconds).
LONGEST_PAUSE_S = 20e-3

if INTERPRETING:

    def now_ns():
        """Nanoseconds of the host's monotonic clock (the interpreter runs kernels as Python)."""
        return time.monotonic_ns()

    def spin_pause(waited_ns):
        """Between two polls of a wait that has lasted ``waited_ns``: sleep a tenth of that, at
        most :data:`LONGEST_PAUSE_S`. CPU ranks share few cores, and a rank that polls without
        pause takes a core from the rank it waits for; the pause adds at most a tenth to a wait."""
        waited = waited_ns.handle.data.item() if hasattr(waited_ns, "handle") else int(waited_ns)
        time.sleep(min(LONGEST_PAUSE_S, waited * 1e-10))

else:

    @triton.jit
    def now_ns():
        """Nanoseconds of the GPU's global timer."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def spin_pause(waited_ns):
        """Nothing on a GPU: a poll takes no core from the peer it waits for."""
        pass


@triton.jit
def _store_now(out):
    tl.store(out, now_ns())


def read_device_clock(out) -> int:
    """:func:`now_ns` as a kernel on ``out``'s device reads it (``out``: one int64 element), after
    the work queued before; waits for the kernel."""
    _store_now[(1,)](out)
    return int(out.item())
