"""Device-side waits of iris's kernels: bounded, recorded, and named when they give up.

A wait that gives up on a peer stores the code of its operation into the context's
``wait_failures`` word for that peer; ``ctx.barrier()`` turns the codes back into names. Until
then, later waits of this rank for that peer give up at once, so a dead peer costs one timeout,
not one per wait (programs of the interpreter and rounds of a kernel wait one after another).
"""

from __future__ import annotations

import triton
import triton.language as tl

from iris_triton import device

__all__ = ["WAIT_SITES", "read_when_arrived", "site_code", "site_name", "spin_probe_kernel", "wait_or_record"]

#: Operations whose kernels wait on peers; the code of one is its index + 1 (0: no failure).
WAIT_SITES = ("device_barrier", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
              "all_gather_matmul", "matmul_reduce_scatter")


def site_code(name: str) -> int:
    return WAIT_SITES.index(name) + 1


def site_name(code: int) -> str:
    return WAIT_SITES[code - 1] if 1 <= code <= len(WAIT_SITES) else f"operation #{code}"


@triton.jit
def wait_or_record(flag, value, rank, heap_bases, max_spins, failures, peer, SITE: tl.constexpr):
    """Wait until this rank's ``flag`` >= ``value`` (acquire, system scope), unless a wait of this
    rank already gave up on ``peer``; on a timeout record ``SITE`` for ``peer`` in ``failures``."""
    if tl.load(failures + peer, volatile=True) == 0:
        if not device.wait_until(flag, value, rank, rank, heap_bases, max_spins):
            tl.store(failures + peer, SITE)


@triton.jit
def read_when_arrived(dctx, buffer, offs, mask, expected, failures, peer, max_spins, MISSING: tl.constexpr,
                      FIRST_WORD: tl.constexpr, CMP: tl.constexpr, SITE: tl.constexpr):
    """``buffer[offs]`` (volatile reads of this rank's memory) once no lane of ``mask`` is
    ``MISSING(values, expected)``: for protocols whose data announces itself, without a flag.

    While some lane is missing, it waits until ``FIRST_WORD(buffer, offs)`` (a pointer to an
    int32 word of the block that changes when the block lands) compares ``CMP`` against
    ``expected``, as every bounded wait of iris does (one acquire read per spin, the rate the
    context's spin bound was measured at, so the timeout holds), then reads the block until no
    lane is missing (the block's stores land within moments of each other), at most an eighth
    of ``max_spins`` times (whole-block reads are slower than the single reads the bound was
    measured with). On a timeout it records
    ``SITE`` for ``peer`` in ``failures``; a peer already recorded is not waited for."""
    values = tl.load(buffer + offs, mask=mask, other=0, volatile=True)
    missing = tl.sum(MISSING(values, expected) & mask, axis=0)
    if missing > 0:
        rereads = max_spins // 8 + 1
        spins = 0
        if tl.load(failures + peer, volatile=True) != 0:
            spins = rereads
        elif dctx.wait_until(FIRST_WORD(buffer, offs), expected, dctx.rank, max_spins, CMP=CMP) == 0:
            spins = rereads
        while (missing > 0) & (spins < rereads):
            values = tl.load(buffer + offs, mask=mask, other=0, volatile=True)
            missing = tl.sum(MISSING(values, expected) & mask, axis=0)
            spins += 1
        if missing > 0:
            tl.store(failures + peer, SITE)
    return values


@triton.jit(do_not_specialize=["spins"])
def spin_probe_kernel(flag, heap_bases, rank, spins):
    """Read this rank's ``flag`` (never 1) ``spins`` times as a wait does: timing it tells how
    many reads a wait makes per second here, which turns the context's timeout into a bound.
    ``spins`` is not specialised, so the warm-up launch compiles the very kernel that is timed
    (otherwise a count divisible by 16 selects a second kernel, compiled inside the timing; with
    an empty compile cache that made the measured rate, hence every wait's bound, many times too
    small)."""
    device.wait_until(flag, 1, rank, rank, heap_bases, spins)
