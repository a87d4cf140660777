"""Point-to-point transfers: ``ctx.ccl.send`` / ``ctx.ccl.recv`` (entry points ``iris.ccl.send`` and
``iris.ccl.recv``, algorithm ``direct``).

Only the two ranks of a pair take part, so nothing here may grow collectively: every rank
allocates at set-up, in the same order and sizes, a fixed region per peer (:class:`PeerRegions`),
and messages of any size stream through it in *chunks* of ``PROGRAMS`` parts of ``BLOCK``
elements (:data:`CHUNK_BYTES`; less in a small heap, :data:`HEAP_SHARE`), one part per program.
Program ``p`` of the sender and program ``p`` of the receiver form a lane, with its own words on
the heap:

- ``delivered[src, p]`` on the receiver (written by the sender): chunks the sender delivered;
- ``consumed[dst, p]`` on the sender (written by the receiver): chunks the receiver copied out,
  or :data:`REFUSED` once it refused a message;
- ``sent[dst, p]`` and ``taken[src, p]``: each side's own count, where its next message starts;
- ``headers[src, p, slot]`` on the receiver: what the chunk in a slot belongs to (its sequence
  number and the message's size and dtype).

Chunk ``k`` (counted per lane and direction since the context began: the counts only grow) goes
into slot ``k % SLOTS`` of the receiver's inbox for this sender, once the receiver acknowledged
chunk ``k - SLOTS``. The sender writes the part, then the header, then releases ``delivered`` :=
``k + 1``; the receiver acquires it, checks the header (a message of another size or dtype is a
mismatch, which it records, and refuses: the sender, waiting for a slot, then records it too),
copies the part out and releases ``consumed`` := ``k + 1``. So a message of at most ``SLOTS``
chunks is buffered when everything sent before was received (the send need not wait for its
recv), and order per pair and direction is the order of the calls. The counts live on the
heap and are advanced by the kernels: calls need no host work and can be captured in CUDA graphs.

Every wait is bounded in wall-clock time (:func:`iris_triton.protocol.waits.wait_or_record`); a give-up
is recorded in the context's fault words and the receiver's tensor is filled with all-ones bits
(NaN, integers -1). Data move as integers of the element's size, bit for bit.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from iris.collectives import SAME_SIZE_INTEGER, Algorithm, CollectiveCall
from iris.errors import IrisError
from iris_triton.device.frontend import SHARED_SOURCE_LANGUAGES
from iris_triton.device.tracing import OPERATION_EVENT
from iris_triton.protocol.waits import MISMATCH, failed, poison_blocks, record_failure, site_code, wait_or_record

__all__ = ["CHUNK_BYTES", "PROGRAMS", "RECV_DIRECT", "SEND_DIRECT", "SLOTS", "PeerRegions", "recv_kernel",
           "send_kernel"]

#: Slots per peer: chunks a sender may have in flight to one receiver.
SLOTS = 2
#: Bytes of one chunk, by device type (the interpreter moves small chunks faster).
CHUNK_BYTES = {"cuda": 64 << 10, "cpu": 4 << 10}
#: Programs (lanes) of one transfer, by device type: each moves ``1 / PROGRAMS`` of every chunk.
PROGRAMS = {"cuda": 16, "cpu": 1}
#: The regions take at most ``1 / HEAP_SHARE`` of a context's heap: a small heap gets small chunks.
HEAP_SHARE = 8
#: What a receiver writes into the sender's ``consumed`` word when it refuses a message: above any count.
REFUSED: tl.constexpr = tl.constexpr(1 << 62)
#: Offsets are 32-bit: a larger message needs to be split.
MAX_ELEMENTS = 2**31 - 1

_SEND_SITE: tl.constexpr = tl.constexpr(site_code("send"))
_RECV_SITE: tl.constexpr = tl.constexpr(site_code("recv"))
# The parts of the words, each [WORLD ranks, PROGRAMS lanes]; the headers follow them.
_DELIVERED: tl.constexpr = tl.constexpr(0)
_CONSUMED: tl.constexpr = tl.constexpr(1)
_SENT: tl.constexpr = tl.constexpr(2)
_TAKEN: tl.constexpr = tl.constexpr(3)
_PARTS: tl.constexpr = tl.constexpr(4)


@attrs.frozen(eq=False)
class PeerRegions:
    """The heap regions of point-to-point transfers on one rank, allocated at set-up on every
    rank alike (a pair cannot grow a symmetric heap by itself)."""

    inbox: torch.Tensor
    """uint8 ``[WORLD senders, SLOTS, chunk]``: where each peer's chunks land."""
    words: torch.Tensor
    """int64 counts and headers (the module's layout); zero at set-up, never reset."""
    chunk_bytes: int
    programs: int

    @classmethod
    def allocate(cls, ctx) -> PeerRegions:
        """The regions of ``ctx`` (collective: called at set-up, on every rank)."""
        world, programs = ctx.world_size, PROGRAMS[ctx.kernel_device_type]
        room = ctx.heap_size // (HEAP_SHARE * world * SLOTS)
        chunk = _chunk_bytes(CHUNK_BYTES[ctx.kernel_device_type], programs, room)
        words = ctx.zeros(world * programs * (_PARTS.value + 2 * SLOTS), dtype=torch.int64)
        inbox = ctx.zeros(world * SLOTS * chunk, dtype=torch.uint8)
        if ctx.device.type == "cuda":
            # Zeroed before set-up's last host exchange, after which a peer may send here.
            torch.cuda.synchronize(ctx.device)
        return cls(inbox=inbox, words=words, chunk_bytes=chunk, programs=programs)


def _chunk_bytes(largest: int, programs: int, room: int) -> int:
    """Bytes of one chunk: ``largest``, halved while it passes ``room`` (bytes per slot the heap
    spares), down to 16 bytes a program (a power of two either way, as the programs' blocks are)."""
    chunk = largest
    while chunk > room and chunk > 16 * programs:
        chunk //= 2
    return chunk


# -- device helpers --------------------------------------------------------------------------------------


@triton.jit
def _word(words, PART: tl.constexpr, rank, WORLD: tl.constexpr, PROGRAMS: tl.constexpr):
    """This program's word of ``rank`` in ``PART`` of the words."""
    return words + (PART * WORLD + rank) * PROGRAMS + tl.program_id(0)


@triton.jit
def _header(words, source, slot, WORLD: tl.constexpr, PROGRAMS: tl.constexpr, SLOTS: tl.constexpr):
    """This program's header (two words: sequence number + 1, what the message is) of the chunk
    in slot ``slot`` from ``source``."""
    return words + _PARTS * WORLD * PROGRAMS + ((source * PROGRAMS + tl.program_id(0)) * SLOTS + slot) * 2


@triton.jit
def _accepted(dctx, consumed, peer):
    """Whether ``peer`` has not refused this rank's messages (its ``consumed`` word here); a
    refusal is recorded as a mismatch of the send."""
    refused = tl.load(consumed, volatile=True) >= REFUSED
    if refused:
        record_failure(dctx, peer, MISMATCH * 256 + _SEND_SITE)
    return not refused


@triton.jit
def _part(dctx, data, k, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """(offsets into the message, the same offsets within a slot) of this program's part of chunk ``k``."""
    offs = dctx.block_offsets(data, k * CHUNK + tl.program_id(0) * BLOCK, BLOCK)
    return offs, offs - k * CHUNK


# -- the kernel sources ------------------------------------------------------------------------------------


def send_kernel(context, data, inbox, words, n, peer, what, CTX: tl.constexpr, TRACING: tl.constexpr,
                RANK: tl.constexpr, WORLD: tl.constexpr, SLOTS: tl.constexpr, PROGRAMS: tl.constexpr,
                BLOCK: tl.constexpr):
    """Send ``data`` (``n`` elements, as integers of their size) to ``peer``, announcing ``what``
    (the message's size and dtype) with every chunk, by the module's protocol."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    CHUNK: tl.constexpr = PROGRAMS * BLOCK
    chunks = tl.cdiv(n, CHUNK)
    sent = _word(words, _SENT, peer, WORLD, PROGRAMS)
    consumed = _word(words, _CONSUMED, peer, WORLD, PROGRAMS)  # here, written by the peer
    delivered = _word(words, _DELIVERED, RANK, WORLD, PROGRAMS)  # on the peer, written here
    first = tl.load(sent)
    span = dctx.tracing.begin(OPERATION_EVENT + _SEND_SITE, peer, n * (data.dtype.element_ty.primitive_bitwidth // 8),
                              op=first)
    ok = (not failed(dctx)) & _accepted(dctx, consumed, peer)
    for k in range(chunks):
        seq = first + k
        if ok & (seq >= SLOTS):  # the slot is free once the receiver took chunk seq - SLOTS
            ok = wait_or_record(dctx, consumed, seq - SLOTS + 1, peer, _SEND_SITE)
            if ok:
                ok = _accepted(dctx, consumed, peer)
        if ok:
            slot = seq % SLOTS
            offs, within = _part(dctx, data, k, CHUNK, BLOCK)
            mask = offs < n
            box = inbox + (RANK * SLOTS + slot) * CHUNK
            dctx.store(box + within, tl.load(data + offs, mask=mask), peer, mask=mask)
            header = _header(words, RANK, slot, WORLD, PROGRAMS, SLOTS)
            dctx.store(header, seq + 1, peer)
            dctx.store(header + 1, what, peer)
            dctx.signal(delivered, seq + 1, peer)
    tl.store(sent, first + chunks)
    dctx.tracing.end(span)


def recv_kernel(context, data, inbox, words, n, peer, what, CTX: tl.constexpr, TRACING: tl.constexpr,
                RANK: tl.constexpr, WORLD: tl.constexpr, SLOTS: tl.constexpr, PROGRAMS: tl.constexpr,
                BLOCK: tl.constexpr):
    """Receive ``n`` elements from ``peer`` into ``data``, which must be a message announced as
    ``what``; after a give-up or a mismatch (refused to the sender), this program's elements of
    ``data`` hold all-ones bits."""
    dctx = CTX.initialize(context, RANK, WORLD, TRACING)
    CHUNK: tl.constexpr = PROGRAMS * BLOCK
    chunks = tl.cdiv(n, CHUNK)
    taken = _word(words, _TAKEN, peer, WORLD, PROGRAMS)
    delivered = _word(words, _DELIVERED, peer, WORLD, PROGRAMS)  # here, written by the peer
    consumed = _word(words, _CONSUMED, RANK, WORLD, PROGRAMS)  # on the peer, written here
    first = tl.load(taken)
    span = dctx.tracing.begin(OPERATION_EVENT + _RECV_SITE, peer, n * (data.dtype.element_ty.primitive_bitwidth // 8),
                              op=first)
    ok = not failed(dctx)
    for k in range(chunks):
        seq = first + k
        slot = seq % SLOTS
        if ok:
            ok = wait_or_record(dctx, delivered, seq + 1, peer, _RECV_SITE)
        if ok:
            header = _header(words, peer, slot, WORLD, PROGRAMS, SLOTS)
            same = (tl.load(header, volatile=True) == seq + 1) & (tl.load(header + 1, volatile=True) == what)
            if not same:
                record_failure(dctx, peer, MISMATCH * 256 + _RECV_SITE)
                dctx.signal(consumed, REFUSED, peer)
            ok = same
        if ok:
            offs, within = _part(dctx, data, k, CHUNK, BLOCK)
            mask = offs < n
            box = inbox + (peer * SLOTS + slot) * CHUNK
            tl.store(data + offs, tl.load(box + within, mask=mask, volatile=True), mask=mask)
            dctx.signal(consumed, seq + 1, peer)  # after the loads: the slot may be written again
    tl.store(taken, first + chunks)
    if not ok:
        poison_blocks(dctx, data, n, n, tl.program_id(0), PROGRAMS, BLOCK)
    dctx.tracing.end(span)


# -- launching ---------------------------------------------------------------------------------------------

#: Codes of the dtypes a message announces (any dtype torch has; a code never changes meaning).
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(
    (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8, torch.int16,
     torch.float64, torch.bool, *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2")
                                  if hasattr(torch, name))), start=1)}


def announcement(tensor: torch.Tensor) -> int:
    """What a message of ``tensor`` announces with every chunk: its element count and dtype, which
    the receiver compares with its own (exactly: both are in the word)."""
    code = _DTYPE_CODES.get(tensor.dtype)
    if code is None:
        raise IrisError(f"send/recv: dtype {tensor.dtype} has no code in iris_triton.collectives.p2p; add it to "
                        f"_DTYPE_CODES")
    return tensor.numel() << 8 | code


def _launch(call: CollectiveCall, kernel, tensor: torch.Tensor):
    ctx = call.context
    if tensor.numel() > MAX_ELEMENTS:
        raise IrisError(f"{call.collective}: {tensor.numel()} elements is too many for one message (offsets are "
                        f"32-bit); split it into messages of at most {MAX_ELEMENTS} elements")
    regions: PeerRegions = ctx.p2p_regions
    bits = SAME_SIZE_INTEGER[tensor.element_size()]  # data move as bits
    front = ctx.frontend
    return front.launch(
        kernel, (regions.programs,), context=ctx.get_device_context(), data=tensor.view(bits),
        inbox=regions.inbox.view(bits), words=regions.words, n=tensor.numel(), peer=call.src,
        what=announcement(tensor), CTX=front.device_context, TRACING=ctx.tracing.enabled, RANK=ctx.rank,
        WORLD=ctx.world_size, SLOTS=SLOTS, PROGRAMS=regions.programs,
        BLOCK=regions.chunk_bytes // regions.programs // tensor.element_size())


def _send(call: CollectiveCall):
    return _launch(call, send_kernel, call.input)


def _recv(call: CollectiveCall):
    return _launch(call, recv_kernel, call.output)


SEND_DIRECT = Algorithm(
    name="direct", collective="send", run=_send, languages=SHARED_SOURCE_LANGUAGES,
    description="pushes chunks into the receiver's slots for this sender, as the receiver frees them")
RECV_DIRECT = Algorithm(
    name="direct", collective="recv", run=_recv, languages=SHARED_SOURCE_LANGUAGES,
    description="copies each chunk out of this rank's slots for the sender, then frees the slot")
