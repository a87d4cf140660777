"""Hardware clocks and ids inside kernels, under upstream iris's names (``iris.device_utils``).

Upstream programs time tiles and place work with four intrinsics: ``read_realtime()`` (a
wall-clock timestamp), ``get_cu_id()`` (the compute unit running the program), ``get_xcc_id()``
and ``get_se_id()`` (the die and shader engine of AMD chips). Here they are ``@triton.jit``
functions, so ``@triton.jit`` kernels call them, and so do ``@gluon.jit`` kernels, which call
Triton jit functions as their own.

Compiled for an NVIDIA GPU:

* ``read_realtime()`` reads the global timer, ``%globaltimer``: int64 nanoseconds, one clock for
  every multiprocessor of the GPU, so timestamps of different programs compare.
  ``iris.hip.get_wall_clock_rate()`` (1,000,000 kHz) is its rate;
* ``get_cu_id()`` reads ``%smid``, the multiprocessor (int32);
* ``get_xcc_id()`` and ``get_se_id()`` are 0 (int32): an NVIDIA GPU is one die and has no shader
  engines in AMD's sense.

In Triton's interpreter (CPU ranks, ``TRITON_INTERPRET=1``) ``read_realtime()`` reads the host's
monotonic clock (``time.monotonic_ns()``, nanoseconds as well, the same clock on every rank of the
host) and the three ids are 0: the interpreter runs a launch's programs one after another on one
core.
"""

from __future__ import annotations

import time

import triton
import triton.language as tl

from iris_triton.device.clock import INTERPRETING

__all__ = ["get_cu_id", "get_se_id", "get_xcc_id", "read_realtime"]


def _host_ns() -> int:
    """The host's monotonic clock, for the interpreter (kernels run as Python there)."""
    return time.monotonic_ns()


if INTERPRETING:

    @triton.jit
    def read_realtime():
        """Nanoseconds of the host's monotonic clock, as an int64 scalar."""
        return tl.full((), _host_ns(), tl.int64)

    @triton.jit
    def get_cu_id():
        """0 (int32): the interpreter runs every program on one core."""
        return tl.full((), 0, tl.int32)

    @triton.jit
    def get_xcc_id():
        """0 (int32): the host is one die (AMD's XCC)."""
        return tl.full((), 0, tl.int32)

    @triton.jit
    def get_se_id():
        """0 (int32): the host has no shader engines in AMD's sense."""
        return tl.full((), 0, tl.int32)

else:
    # Inline assembly for the constants too: it makes a scalar in Triton and Gluon alike (Gluon's
    # tl.full needs a layout).

    @triton.jit
    def read_realtime():
        """Nanoseconds of the GPU's global timer (``%globaltimer``), as an int64 scalar."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def get_cu_id():
        """The streaming multiprocessor running this program (``%smid``), as an int32 scalar."""
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def get_xcc_id():
        """0 (int32): an NVIDIA GPU is a single die (AMD's XCC)."""
        return tl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)

    @triton.jit
    def get_se_id():
        """0 (int32): NVIDIA GPUs have no shader engines in AMD's sense."""
        return tl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
