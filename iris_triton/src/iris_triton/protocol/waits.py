"""Device-side waits of iris's kernels: bounded in wall-clock time, recorded when they give up.

Every kernel of iris that waits on peers finds, in its device context's ``failstop`` member
(:class:`iris_triton.device.failstop.FailStop`, read from the device-context tensor), the context's
*fault words* (``ctx.faults``, int32 on the device: word 0 holds the code of the first failure on
this rank, word ``1 + q`` the code of a failure while waiting for peer ``q``, word ``1 + world``
asks for a trap; where peer ``q`` made a different call, word ``2 + world + q`` holds the header it
announced and word ``2 + 2 * world`` this rank's: :func:`record_mismatch`), a host-visible copy of
them (``ctx.host_faults``: pinned host memory on GPUs, which the host reads without a
synchronisation; the same words on CPU ranks) and the timeout in nanoseconds. The functions here
take that device context (``dctx``) for all three.

A wait that gives up writes its code (:func:`failure_code`: the operation and the kind of failure)
into both, and the kernel then fills the call's output with all-ones bits (NaN for floating-point
types, -1 for integers: :func:`poison`), so that nothing queued behind it can pass for a correct
result; the host raises :class:`iris.errors.IrisTimeoutError` at the next iris call. Once a failure
is recorded, every later wait of this rank gives up at once: the context is failed, and a dead peer
costs one timeout, not one per wait.

Protocols whose calls announce themselves (a *header* per source rank: the call's number and
signature, :mod:`iris_triton.protocol.calls`) wait with :func:`wait_for_call` and :func:`read_when_arrived`,
which also read the headers while they wait: a peer that announced another call of the same number
is recorded as a mismatch as soon as its header lands, with both headers (the host then names both
calls: :class:`iris.errors.CallMismatchError`), and a wait gives up as soon as another program of
this rank recorded a failure.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from iris_triton.protocol.calls import announcements_of
from iris_triton.device.clock import INTERPRETING, now_ns, spin_pause

__all__ = ["ARGUMENT_FAILURES", "KINDS", "LOCAL_FAILURES", "MISMATCHES", "WAIT_SITES", "describe_failure",
           "failure_code", "fault_words", "other_call", "peers_announced", "poison", "poison_blocks", "poisoned",
           "publish", "read_published", "read_when_arrived", "record_failure", "record_mismatch", "record_timeout",
           "site_code", "wait_for_call", "wait_all_or_record", "wait_for_peer_call", "wait_or_record"]

#: Operations whose kernels wait on peers; the code of one is its index + 1 (0: no failure).
WAIT_SITES = ("device_barrier", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
              "all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "send", "recv",
              "all_to_all_single", "all_to_all_vdev", "reduce", "gather", "scatter", "tile all_reduce",
              "tile all_gather", "tile reduce_scatter", "tile all_to_all", "tile broadcast", "all_reduce_rmsnorm",
              "moe_dispatch", "tile gather", "moe_combine")
#: Kinds of failure, by code: a peer did not deliver within the timeout, or it delivered a
#: different call (another collective, size, dtype, op or root).
KINDS = {1: "timeout", 2: "mismatch", 3: "overflow", 4: "capacity", 5: "bounds", 6: "splits", 7: "unmatched",
         8: "tiles", 9: "expert_ids", 10: "expert_capacity", 11: "stale_dispatch", 12: "cut_part"}
#: What the kinds of failure that a call's own arguments cause (found on the device, in the
#: split counts every rank published: iris_triton.collectives.all_to_all_v) say about the ranks recorded.
ARGUMENT_FAILURES = {
    "overflow": "would receive more rows than their output holds (the rows every rank sends there add up to more "
                "than output.shape[0]); size the output for the most rows a rank can receive",
    "capacity": "would receive more rows than the receive workspace holds (a call captured in a CUDA graph uses the "
                "workspace as earlier calls left it); make an eager call of the largest size before capturing",
    "bounds": "passed an output with another number of rows than this rank's; all_to_all_vdev needs the same "
              "output bound on every rank",
    "splits": "passed split counts that are negative or add up to more rows than their input has",
    "expert_ids": "passed topk_ids outside [-1, num_experts) (-1: a slot routed to no expert); check the router's "
                  "output (IRIS_DEBUG=1 checks it on the host at the call)",
    "expert_capacity": "would receive more rows for one of their experts than capacity holds; pass a larger "
                       "capacity to moe_dispatch (the default, world_size * num_tokens, always holds)",
    "stale_dispatch": "combined a dispatch whose receive buffers a later dispatch reused (a dispatch's results are "
                      "valid until the dispatch after next: combine before then, or clone what must live longer)",
    "tiles": "synchronised a tile whose number is outside the tile sync it was given (ctx.tile_sync(num_tiles) "
             "must cover every tile number of the views the kernel passes)",
    "unmatched": "passed output_split_sizes that differ from the rows their peers send them (output_split_sizes[s] "
                 "on rank d must equal input_split_sizes[d] on rank s)",
}
#: What the kinds of failure that no peer causes say (recorded in this rank's own word): waits of
#: one kernel's programs for each other on this rank.
LOCAL_FAILURES = {
    "cut_part": "waiting for another program of its own kernel on this rank (the parts of a tile cut along K add "
                "up in one program): the GPU did not run all of the kernel's programs within the timeout, because "
                "of another kernel holding its multiprocessors that long, or a fault of this GPU",
}
#: What a mismatch recorded for a peer means, where it is not "made a different call" (a pair
#: compares only its two messages: iris_triton.collectives.p2p).
MISMATCHES = {
    "recv": "sent a message of another size or dtype than this recv's (a send and the recv that matches it must "
            "have the same number of elements and dtype)",
    "send": "refused this rank's message: its recv has another size or dtype (a send and the recv that matches it "
            "must have the same number of elements and dtype)",
}
TIMEOUT: tl.constexpr = tl.constexpr(1)
MISMATCH: tl.constexpr = tl.constexpr(2)
OVERFLOW: tl.constexpr = tl.constexpr(3)
CAPACITY: tl.constexpr = tl.constexpr(4)
BOUNDS: tl.constexpr = tl.constexpr(5)
SPLITS: tl.constexpr = tl.constexpr(6)
UNMATCHED: tl.constexpr = tl.constexpr(7)
TILES: tl.constexpr = tl.constexpr(8)
EXPERT_IDS: tl.constexpr = tl.constexpr(9)
EXPERT_CAPACITY: tl.constexpr = tl.constexpr(10)
STALE_DISPATCH: tl.constexpr = tl.constexpr(11)
CUT_PART: tl.constexpr = tl.constexpr(12)


def fault_words(world: int) -> int:
    """How many fault words a context of ``world`` ranks has (the module's layout)."""
    return 3 + 2 * world


def site_code(name: str) -> int:
    return WAIT_SITES.index(name) + 1


def failure_code(site: str, kind: str = "timeout") -> int:
    """The int32 a kernel records: the operation in the low byte, the kind above it."""
    return site_code(site) | {v: k for k, v in KINDS.items()}[kind] << 8


def describe_failure(code: int) -> tuple[str, str]:
    """``(operation, kind)`` of a recorded code."""
    site, kind = code & 0xFF, code >> 8
    name = WAIT_SITES[site - 1] if 1 <= site <= len(WAIT_SITES) else f"operation #{site}"
    return name, KINDS.get(kind, f"failure #{kind}")


if INTERPRETING:

    def _trap():
        """Triton's interpreter has no trap instruction: end the process as a trapped kernel would."""
        print("iris: a device-side wait gave up and the context asks for a trap (on_timeout='trap')", flush=True)
        os.abort()

else:

    @triton.jit
    def _trap():
        tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fault_words(dctx):
    """``dctx``'s fault words and their host-visible copy; a context without them is refused."""
    tl.static_assert(dctx.failstop.present, "iris's waits need a device context built with initialize() from "
                                            "ctx.get_device_context(), which carries the fault words and timeout")
    return dctx.failstop.faults, dctx.failstop.host_faults


@triton.jit
def record_failure(dctx, peer, code):
    """Record ``code`` for ``peer`` in ``dctx``'s fault words and their host-visible copy, unless
    a failure is recorded for that peer already (the first says what happened: later waits give up
    because of it); trap if asked."""
    faults, host_faults = _fault_words(dctx)
    world = dctx.world_size
    if tl.load(faults + 1 + peer, volatile=True) == 0:
        tl.store(faults + 1 + peer, code)
        tl.store(host_faults + 1 + peer, code, cache_modifier=".wt")
    tl.store(faults, code)
    tl.store(host_faults, code, cache_modifier=".wt")
    if tl.load(faults + 1 + world, volatile=True) != 0:
        _trap()


@triton.jit
def record_timeout(dctx, peer, SITE: tl.constexpr):
    """Record that a wait of ``SITE`` gave up on ``peer`` (:func:`record_failure`)."""
    record_failure(dctx, peer, TIMEOUT * 256 + SITE)


@triton.jit
def record_mismatch(dctx, peer, seen, announced, SITE: tl.constexpr):
    """Record that ``peer`` announced ``seen`` where this rank's call announced ``announced`` (a
    different call of the same number): a mismatch of ``SITE``, with both headers, unless a failure
    is recorded for that peer already."""
    faults, host_faults = _fault_words(dctx)
    world = dctx.world_size
    if tl.load(faults + 1 + peer, volatile=True) == 0:
        tl.store(faults + 2 + world + peer, seen)
        tl.store(host_faults + 2 + world + peer, seen, cache_modifier=".wt")
        tl.store(faults + 2 + 2 * world, announced)
        tl.store(host_faults + 2 + 2 * world, announced, cache_modifier=".wt")
    record_failure(dctx, peer, MISMATCH * 256 + SITE)


@triton.jit
def failed(dctx):
    """Whether a failure is recorded on this rank (the context ``dctx`` is failed)."""
    faults, _ = _fault_words(dctx)
    return tl.load(faults, volatile=True) != 0


@triton.jit
def wait_or_record(dctx, flag, value, peer, SITE: tl.constexpr, ON_PEER: tl.constexpr = False):
    """Wait until this rank's ``flag`` (with ``ON_PEER``: ``peer``'s, at ``flag``'s offset in its
    heap) >= ``value`` (acquire, system scope) and return True; give up (False) after the
    context's timeout or at once when it has failed, recording a timeout of ``SITE`` for
    ``peer``."""
    if ON_PEER:
        holder = peer
        ok = dctx.atomic_add(flag, 0, peer, sem="acquire", scope="sys") >= value
    else:
        holder = dctx.rank
        ok = tl.atomic_add(flag, 0, sem="acquire", scope="sys") >= value
    if not ok:
        if not failed(dctx):  # else give up at once: the context failed, and said why already
            ok = dctx.wait_until(flag, value, holder, dctx.failstop.timeout_ns)
            if not ok:
                record_timeout(dctx, peer, SITE)
    return ok


@triton.jit
def _least_flag(flags, count, BLOCK: tl.constexpr):
    """The smallest of this rank's ``count`` (at most ``BLOCK``) flags at ``flags``, each read with
    acquire semantics at system scope."""
    lanes = tl.arange(0, BLOCK)
    live = lanes < count
    seen = tl.atomic_add(flags + lanes, tl.zeros([BLOCK], flags.dtype.element_ty), mask=live, sem="acquire",
                         scope="sys")
    return tl.min(tl.where(live, seen, 2147483647), axis=0)


@triton.jit
def wait_all_or_record(dctx, flags, count, value, peer, SITE: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`wait_or_record` for ``count`` flags of this rank at once (``flags[0:count]``, ``count
    <= BLOCK``; the flags one peer's programs set): until every one is >= ``value``, all read in
    each poll, so that waiting for a peer's programs costs one wait rather than one per program."""
    ok = _least_flag(flags, count, BLOCK) >= value
    if not ok:
        if not failed(dctx):  # else give up at once: the context failed, and said why already
            start = now_ns()
            waited = start - start
            while (not ok) & (waited < dctx.failstop.timeout_ns):
                spin_pause(waited)
                ok = _least_flag(flags, count, BLOCK) >= value
                waited = now_ns() - start
            if not ok:
                record_timeout(dctx, peer, SITE)
    return ok


@triton.jit
def _differs(seen, announced):
    """Whether header ``seen`` is of another call of the number ``announced`` is of."""
    return ((seen >> 16) == (announced >> 16)) & (seen != announced)


@triton.jit
def other_call(dctx, headers, announced, SITE: tl.constexpr):
    """Whether a peer announced another call of this call's number than ``announced``, in
    ``headers`` (one per source rank: :func:`iris_triton.protocol.calls.announce`) or in its announcement
    of a call that waits on the host (:func:`iris_triton.protocol.calls.announce_kernel`); the first such
    peer is recorded as a mismatch (:func:`record_mismatch`). A header of an earlier call is no
    verdict: the peer has not announced this call yet. A loop over the peers, not unrolled: it
    runs only while a wait spins."""
    rank = dctx.rank
    world = dctx.world_size
    announcements = announcements_of(headers, announced, world)
    found = tl.program_id(0) < 0
    for q in range(0, world):
        seen = tl.load(headers + q, volatile=True)
        pending = tl.load(announcements + q, volatile=True)
        seen = tl.where(_differs(seen, announced), seen, pending)
        other = _differs(seen, announced) & (q != rank)
        if other & (not found):
            record_mismatch(dctx, q, seen, announced, SITE)
        found = found | other
    return found


@triton.jit
def _give_up(dctx, start, headers, announced, SITE: tl.constexpr):
    """Whether a wait that began at ``start`` gives up now: a peer announced another call
    (:func:`other_call`), this rank recorded a failure (another program, say), or the context's
    timeout passed. Pauses first on CPU ranks (:func:`iris_triton.device.clock.spin_pause`)."""
    waited = now_ns() - start
    spin_pause(waited)
    return other_call(dctx, headers, announced, SITE) | failed(dctx) | (waited >= dctx.failstop.timeout_ns)


@triton.jit
def wait_for_call(dctx, flag, value, peer, headers, announced, SITE: tl.constexpr):
    """:func:`wait_or_record` for protocols whose calls announce themselves in ``headers``: wait
    until this rank's ``flag`` >= ``value`` (acquire, system scope) and return True; give up
    (False) after the context's timeout (recording a timeout of ``SITE`` for ``peer``), at once
    when the context has failed, and as soon as a peer announced another call
    (:func:`other_call`: a mismatch) or another program of this rank recorded a failure."""
    ok = tl.atomic_add(flag, 0, sem="acquire", scope="sys") >= value
    if not ok:
        if not failed(dctx):  # else give up at once: the context failed, and said why already
            start = now_ns()
            stop = other_call(dctx, headers, announced, SITE)
            while (not ok) & (not stop):
                ok = tl.atomic_add(flag, 0, sem="acquire", scope="sys") >= value
                stop = _give_up(dctx, start, headers, announced, SITE)
            if (not ok) & (not failed(dctx)):
                record_timeout(dctx, peer, SITE)
    return ok


@triton.jit
def wait_for_peer_call(dctx, flag, value, peer, headers, announced, SITE: tl.constexpr):
    """:func:`wait_for_call` for a flag that ``peer`` sets after it announced its call in
    ``headers`` (released before the flag): once the flag arrived, ``peer``'s header must be
    ``announced``; another header is a mismatch (the flag is of a different call of this number),
    recorded with both headers, and the wait fails. ``peer`` may be this rank (its own flag, set
    by another kernel of the call): no header to check."""
    ok = wait_for_call(dctx, flag, value, peer, headers, announced, SITE)
    if ok & (peer != dctx.rank):
        seen = tl.load(headers + peer, volatile=True)
        if seen != announced:
            record_mismatch(dctx, peer, seen, announced, SITE)
            ok = False
    return ok


@triton.jit
def _landed(word, expected, CMP: tl.constexpr):
    """Whether the 32-bit ``word`` (a pointer) compares ``CMP`` (``"eq"`` or ``"ne"``) against
    ``expected``, read with acquire semantics at system scope."""
    seen = tl.atomic_add(word, 0, sem="acquire", scope="sys")
    if CMP == "eq":
        landed = seen == expected
    else:
        tl.static_assert(CMP == "ne", "CMP must be 'eq' or 'ne'")
        landed = seen != expected
    return landed


if INTERPRETING:

    def _halfword(ptr):
        """The 32-bit words holding the 16-bit elements at ``ptr``, and each element's bit shift."""
        address = ptr.to(tl.int64)
        return (address & ~3).to(tl.pointer_type(tl.int32)), ((address & 2) * 8).to(tl.int32)

    def publish(dctx, ptr, value, to_rank, mask):
        """``value`` into ``to_rank``'s heap at ``ptr``, each element written whole: the
        interpreter copies an element byte by byte, so a reader could see half of a plain store.
        A 16-bit element is and-ed into its 32-bit word, whose half holds all-ones (the sentinel)
        until then; a wider one is exchanged."""
        if value.dtype.primitive_bitwidth == 16:
            words, shift = _halfword(ptr)
            keep = ~((~value.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << shift)
            dctx.atomic_and(words, keep, to_rank, mask=mask, sem="relaxed")
        else:
            dctx.atomic_xchg(ptr, value, to_rank, mask=mask, sem="relaxed")

    def read_published(ptr, mask):
        """This rank's elements at ``ptr`` (0 where not ``mask``), each read whole (atomically)."""
        if ptr.dtype.element_ty.primitive_bitwidth == 16:
            words, shift = _halfword(ptr)
            bits = (tl.atomic_add(words, shift * 0, mask=mask, sem="relaxed") >> shift) & 0xFFFF
            values = bits.to(tl.int16).to(ptr.dtype.element_ty, bitcast=True)
        else:
            values = tl.atomic_add(ptr, tl.zeros(ptr.shape, ptr.dtype.element_ty), mask=mask, sem="relaxed")
        return tl.where(mask, values, 0)

else:

    @triton.jit
    def publish(dctx, ptr, value, to_rank, mask):
        """``value`` into ``to_rank``'s heap at ``ptr``: plain (vector) stores, which a GPU makes
        whole per aligned element."""
        dctx.store(ptr, value, to_rank, mask=mask)

    @triton.jit
    def read_published(ptr, mask):
        """This rank's elements at ``ptr`` (0 where not ``mask``): volatile loads."""
        return tl.load(ptr, mask=mask, other=0, volatile=True)


@triton.jit
def read_when_arrived(dctx, buffer, offs, mask, expected, peer, headers, announced, MISSING: tl.constexpr,
                      FIRST_WORD: tl.constexpr, CMP: tl.constexpr, SITE: tl.constexpr):
    """``(buffer[offs], ok)``: reads of this rank's memory (:func:`read_published`), once no lane
    of ``mask`` is ``MISSING(values, expected)``, for protocols whose data announces itself,
    without a flag; the data must be written by :func:`publish`.

    While some lane is missing, it waits until ``FIRST_WORD(buffer, offs)`` (a pointer to an int32
    word of the block that changes when the block lands) compares ``CMP`` against ``expected``,
    then reads the block until no lane is missing, all within the context's timeout
    (a block's stores land one after another, and a peer's process may be descheduled between
    them). It gives up at once when the context has failed, and as soon as a peer announced
    another call in ``headers`` (this call's header: ``announced``; :func:`other_call`) or another
    program of this rank recorded a failure; a give-up after the timeout records a timeout of
    ``SITE`` for ``peer``."""
    values = read_published(buffer + offs, mask)
    missing = tl.sum(MISSING(values, expected) & mask, axis=0)
    ok = missing == 0
    if not ok:
        if not failed(dctx):
            start = now_ns()
            first = FIRST_WORD(buffer, offs)
            landed = _landed(first, expected, CMP)
            stop = other_call(dctx, headers, announced, SITE)
            while (not landed) & (not stop):
                landed = _landed(first, expected, CMP)
                stop = _give_up(dctx, start, headers, announced, SITE)
            while (missing > 0) & (not stop):
                values = read_published(buffer + offs, mask)
                missing = tl.sum(MISSING(values, expected) & mask, axis=0)
                stop = _give_up(dctx, start, headers, announced, SITE)
            ok = missing == 0
            if (not ok) & (not failed(dctx)):
                record_timeout(dctx, peer, SITE)
    return values, ok


@constexpr_function
def _signed_int(bitwidth):
    """The signed integer type of ``bitwidth`` bits."""
    return {8: tl.int8, 16: tl.int16, 32: tl.int32, 64: tl.int64}[bitwidth]


@triton.jit
def peers_announced(dctx, headers, value, RANK: tl.constexpr, WORLD: tl.constexpr, SITE: tl.constexpr,
                    WAIT: tl.constexpr):
    """Whether every peer announced ``value`` in ``headers`` (this program's row, one header per
    source rank: :func:`iris_triton.protocol.calls.announce`). A peer that announced another call of the
    same number made a different call: recorded as a mismatch. With ``WAIT`` (protocols without
    a fence, whose header may land after the data), a header of an earlier call is waited on
    within the context's timeout; without it the header was released before the flag already waited
    for, and any other value is a mismatch. A loop over the peers, not unrolled (as
    :func:`other_call`): each peer's header is read, and waited on, before the next one's."""
    ok = not failed(dctx)  # a failed context checks nothing more (and names no one else)
    for q in range(WORLD):
        if q != RANK:
            seen = tl.load(headers + q, volatile=True)
            if WAIT:
                if (seen != value) & ((seen >> 16) != (value >> 16)) & (not failed(dctx)):
                    start = now_ns()
                    waited = start - start
                    while ((seen >> 16) != (value >> 16)) & (waited < dctx.failstop.timeout_ns):
                        spin_pause(waited)
                        seen = tl.load(headers + q, volatile=True)
                        waited = now_ns() - start
            same = seen == value
            if ok & (not same):
                if WAIT:
                    if (seen >> 16) != (value >> 16):  # an earlier call's header: the peer never got to this call
                        record_timeout(dctx, q, SITE)
                    else:
                        record_mismatch(dctx, q, seen, value, SITE)
                else:
                    record_mismatch(dctx, q, seen, value, SITE)
            ok = ok & same
    return ok


@triton.jit
def poisoned(values, ok):
    """``values`` where ``ok``, else all-ones bits (NaN for floats, -1 for integers): what a call
    whose wait gave up writes instead of its result."""
    BITS: tl.constexpr = _signed_int(values.dtype.primitive_bitwidth)
    return tl.where(ok, values.to(BITS, bitcast=True), -1).to(values.dtype, bitcast=True)


@triton.jit
def poison(dctx, out, numel, BLOCK: tl.constexpr):
    """Fill ``out``'s ``numel`` elements with all-ones bits (NaN for floats, -1 for integers):
    the output of a call whose wait gave up, so that no result computed from it looks valid."""
    poison_blocks(dctx, out, numel, numel, 0, 1, BLOCK)


@triton.jit
def poison_blocks(dctx, out, numel, segment, first, step, BLOCK: tl.constexpr):
    """:func:`poison` for the blocks ``first, first + step, ...`` of ``BLOCK`` elements of every
    ``segment`` of ``out``'s ``numel`` elements: the blocks one program of a collective wrote,
    so that it never overwrites what another program still reads (an in-place input it sends)."""
    BITS: tl.constexpr = _signed_int(out.dtype.element_ty.primitive_bitwidth)
    bits = out.to(tl.pointer_type(BITS))
    for base in range(0, numel, segment):
        for start in range(first * BLOCK, segment, step * BLOCK):
            offs = dctx.block_offsets(bits, base + start, BLOCK)
            tl.store(bits + offs, (offs * 0 - 1).to(BITS), mask=(offs < base + segment) & (offs < numel))
