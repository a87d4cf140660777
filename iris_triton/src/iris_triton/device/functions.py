"""Device functions of the Triton backend: remote memory access on the symmetric heap.

A pointer into this rank's heap becomes a pointer into any peer's heap by moving it by the
distance between the two heaps as mapped in this process (``heap_bases``). Data moves from
``from_rank`` to ``to_rank``; the argument order is upstream iris's, so its kernels run unchanged.

Translation keeps vector accesses: every heap base is at least 256-byte aligned, so the distance
between two heaps is a multiple of 256 bytes, and saying so (``tl.multiple_of``) lets the
compiler keep the 16-byte alignment it proved for the local pointer. A contiguous block then
compiles to ``ld.global.v4``/``st.global.v4`` just as a local access would.

Atomics default to ``sem="acq_rel"`` and ``scope="sys"`` (also when None is passed): a peer GPU only observes ordering
made at system scope (a release at ``"gpu"`` scope is invisible to it).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import constexpr_function

from iris.config import debug_from_environment
from iris.errors import IrisError
from iris.heap.symmetric import MAP_GRANULE, MAP_HEADER
from iris_triton.device.clock import INTERPRETING, now_ns, spin_pause

#: The device functions, each with its parameter that takes the caller's own rank: the one list
#: of the device API. Each is defined below as a ``@triton.jit`` function, exported as
#: ``iris_triton.<name>`` (``iris.<name>`` in kernels), and is a method of the device contexts
#: (Triton's ``DeviceContext``, Gluon's ``IrisDeviceCtx``), which :mod:`iris_triton.device.context`
#: generates from the function: the same parameters less ``heap_bases`` and the caller's rank,
#: for which it passes the context's ``heap_bases`` and ``rank``. E.g. ``load(ptr, to_rank,
#: from_rank, heap_bases, mask=None, ...)`` is the method ``load(self, ptr, from_rank, mask=None,
#: ...)``. Adding a device function is listing it here and defining it below; nothing else.
DEVICE_FUNCTIONS: dict[str, str] = {
    "translate": "from_rank",
    "load": "to_rank",
    "store": "from_rank",
    "get": "from_rank",
    "put": "from_rank",
    "copy": "cur_rank",
    "atomic_add": "from_rank",
    "atomic_sub": "from_rank",
    "atomic_xchg": "from_rank",
    "atomic_and": "from_rank",
    "atomic_or": "from_rank",
    "atomic_xor": "from_rank",
    "atomic_min": "from_rank",
    "atomic_max": "from_rank",
    "atomic_cas": "from_rank",
    "signal": "from_rank",
    "wait_until": "cur_rank",
}

__all__ = list(DEVICE_FUNCTIONS)

#: Parameters the device contexts' methods name differently from the free function (upstream
#: iris's names): the free ``get`` calls the rank it reads ``to_rank`` (its ``from_rank`` is the
#: caller), the method ``get`` calls it ``from_rank``, the rank the data comes from.
METHOD_PARAMETER_NAMES: dict[str, dict[str, str]] = {"get": {"to_rank": "from_rank"}}

#: Every heap base is a multiple of this many bytes (cudaMalloc and mmap both guarantee it).
HEAP_BASE_ALIGNMENT: tl.constexpr = tl.constexpr(256)
#: Whether kernels run in Triton's interpreter (a constant the device functions branch on).
INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETING)
#: Debug mode (``IRIS_DEBUG=1`` when iris is imported): translated pointers are checked against
#: the heap, and Triton compiles device assertions in (they are dropped otherwise).
CHECK_POINTERS: tl.constexpr = tl.constexpr(debug_from_environment())
if CHECK_POINTERS:
    triton.knobs.runtime.debug = True
if INTERPRETING:  # the checks' IrisErrors reach the launching code as raised, not wrapped per call level;
    # device-function calls do not patch triton.language again
    from iris_triton.device.interpreter_errors import unwrap_iris_errors
    from iris_triton.device.interpreter_patching import patch_language_once

    unwrap_iris_errors()
    patch_language_once()
#: log2 of the bytes of heap per byte of a rank's allocation map (debug mode's write checks).
MAP_SHIFT: tl.constexpr = tl.constexpr(MAP_GRANULE.bit_length() - 1)
#: Bytes from a heap's base to its allocation map (after the heap size, an int64 at the base).
MAP_START: tl.constexpr = tl.constexpr(MAP_HEADER)


@constexpr_function
def _sem(sem, default="acq_rel"):
    """``sem``, or the default ordering when None (also when None is passed explicitly)."""
    return default if sem is None else sem


@constexpr_function
def _scope(scope):
    """``scope``, or system scope when None: never Triton's own default ("gpu"), which a peer
    GPU does not observe."""
    return "sys" if scope is None else scope


@triton.jit
def _like(value, ptr):
    """``value`` converted to ``ptr``'s element type and, when ``ptr`` is a block and ``value``
    a scalar, spread over the block (Gluon's atomics and stores do not broadcast a scalar
    themselves; a select between equal values keeps every bit, -0.0 and NaNs included)."""
    value = tl.cast(value, ptr.dtype.element_ty)
    if ptr.type.is_block():
        if not value.type.is_block():
            address = ptr.to(tl.int64)
            value = tl.where(address == address, value, value)
    return value


def _outside_message(rank, peer, offset, lanes, heap_size) -> str:
    return (f"iris (IRIS_DEBUG): rank {rank} addressed rank {peer}'s heap at byte offset {offset}, outside the "
            f"heap of {heap_size} bytes ({lanes} address(es) outside, the lowest shown); pass pointers into "
            f"tensors on the symmetric heap (ctx.empty/zeros/...) and mask off the lanes past their end")


def _off_node_message(rank, peer) -> str:
    return (f"iris (IRIS_DEBUG): rank {rank} addressed rank {peer}'s heap, which is on another node and not mapped "
            f"here (heap base 0); a rank reaches only its node's heaps: use the node group's device context "
            f"(ctx.node_group) in kernels, and the world collectives or torch.distributed across nodes")


def _unallocated_message(rank, peer, offset, lanes) -> str:
    return (f"iris (IRIS_DEBUG): rank {rank} wrote to rank {peer}'s heap at byte offset {offset}, which rank "
            f"{peer} has not allocated ({lanes} address(es), the lowest shown); allocate on every rank and "
            f"call ctx.barrier() before peers write, free only after a barrier, and keep writes inside the tensor")


if INTERPRETING:

    def _stop_outside(rank, peer, offset, lanes, heap_size):
        """Raise before the access: the interpreter runs device code as Python and ignores
        device assertions, so the exception is what stops the kernel; the launching call raises
        it as this IrisError (:mod:`iris_triton.device.interpreter_errors`)."""
        raise IrisError(_outside_message(int(rank), int(peer), int(offset), int(lanes), int(heap_size)))

    def _stop_unallocated(rank, peer, offset, lanes):
        """As :func:`_stop_outside`, for a write into a block the target has not allocated."""
        raise IrisError(_unallocated_message(int(rank), int(peer), int(offset), int(lanes)))

    def _stop_off_node(rank, peer):
        """As :func:`_stop_outside`, for a peer whose heap is not mapped (another node's)."""
        raise IrisError(_off_node_message(int(rank), int(peer)))

else:

    @triton.jit
    def _stop_outside(rank, peer, offset, lanes, heap_size):
        """Print the finding; the device assertion that follows stops the kernel."""
        tl.device_print("iris (IRIS_DEBUG): address outside the heap; rank, peer, lowest byte offset, lanes, heap "
                        "size", rank, peer, offset, lanes, heap_size)

    @triton.jit
    def _stop_unallocated(rank, peer, offset, lanes):
        """Print the finding; the device assertion that follows stops the kernel."""
        tl.device_print("iris (IRIS_DEBUG): write into a block the peer has not allocated; rank, peer, lowest byte "
                        "offset, lanes", rank, peer, offset, lanes)

    @triton.jit
    def _stop_off_node(rank, peer):
        """Print the finding; the device assertion that follows stops the kernel."""
        tl.device_print("iris (IRIS_DEBUG): a peer on another node, whose heap is not mapped here; rank, peer", rank,
                        peer)


@triton.jit
def _lanes(bad, offset):
    """How many addresses ``bad`` selects, and the lowest of their ``offset``s."""
    if bad.type.is_block():
        count = tl.sum(bad.to(tl.int32))
        lowest = tl.min(tl.where(bad, offset, 9223372036854775807))
    else:
        count = bad.to(tl.int32)
        lowest = offset
    return count, lowest


@triton.jit
def _check_inside_heap(ptr, from_rank, to_rank, heap_bases, mask):
    """Debug mode: every (unmasked) address of ``ptr`` lies in ``from_rank``'s heap, from its base
    up to its last byte, and ``to_rank``'s heap is mapped (a base of 0: a rank on another node);
    otherwise report the rank, the peer and the offset, and stop the kernel before any access (an
    exception in the interpreter, a device assertion on GPUs)."""
    to_base = tl.load(heap_bases + to_rank)
    if to_base == 0:
        _stop_off_node(from_rank, to_rank)
    tl.device_assert(to_base != 0, "iris (IRIS_DEBUG): a peer on another node: its heap is not mapped here")
    from_base = tl.load(heap_bases + from_rank)
    offset = ptr.to(tl.int64) - from_base
    heap_size = tl.load(from_base.to(tl.pointer_type(tl.int64)))  # the debug header at the heap's start
    outside = (offset < 0) | (offset >= heap_size)
    if mask is not None:
        outside = outside & mask
    count, lowest = _lanes(outside, offset)
    if count > 0:
        _stop_outside(from_rank, to_rank, lowest, count, heap_size)
    tl.device_assert(outside == 0, "iris (IRIS_DEBUG): a pointer translated between ranks is outside the heap")


@triton.jit
def _check_allocated(ptr, from_rank, to_rank, heap_bases, mask):
    """Debug mode, before a write: every (unmasked) address of ``ptr``, already checked to lie in
    the heap, is in a block that ``to_rank`` has allocated, per ``to_rank``'s allocation map (one
    byte per granule after the header at the start of its heap, 1 where allocated:
    iris.heap.SymmetricHeap);
    otherwise report and stop the kernel as :func:`_check_inside_heap` does."""
    offset = ptr.to(tl.int64) - tl.load(heap_bases + from_rank)
    granule = tl.load(heap_bases + to_rank).to(tl.pointer_type(tl.uint8)) + MAP_START + (offset >> MAP_SHIFT)
    if mask is None:
        unallocated = tl.load(granule) == 0
    else:
        unallocated = tl.load(granule, mask=mask, other=1) == 0
    count, lowest = _lanes(unallocated, offset)
    if count > 0:
        _stop_unallocated(from_rank, to_rank, lowest, count)
    tl.device_assert(unallocated == 0, "iris (IRIS_DEBUG): a write into a block the peer has not allocated")


@triton.jit
def translate(ptr, from_rank, to_rank, heap_bases, mask=None, hint: tl.constexpr = None):
    """``ptr`` (an address in ``from_rank``'s heap) moved to the same offset of ``to_rank``'s
    heap, both as mapped in the calling process. With ``IRIS_DEBUG=1`` (set before iris is
    imported) the addresses, those selected by ``mask``, are checked to lie in the heap.

    ``hint`` (upstream iris's): what the caller knows of the block of addresses, as
    ``tl.multiple_of`` and ``tl.max_contiguous`` take it (an int, or one per dimension): runs of
    ``hint`` contiguous elements starting at multiples of ``hint``. It is applied to the
    translated pointer, so the compiler can vectorise the remote access as it would a local one
    it proved the same of."""
    if CHECK_POINTERS:
        _check_inside_heap(ptr, from_rank, to_rank, heap_bases, mask)
    from_base = tl.load(heap_bases + from_rank)
    to_base = tl.load(heap_bases + to_rank)
    elem_bytes: tl.constexpr = (ptr.dtype.element_ty.primitive_bitwidth + 7) // 8  # bool: 1 byte
    distance = to_base - from_base
    if elem_bytes > 1:  # a division by one would be folded away, and the hint with it
        distance = distance // elem_bytes
    remote = ptr + tl.multiple_of(distance, HEAP_BASE_ALIGNMENT // elem_bytes)
    if hint is not None:
        remote = tl.max_contiguous(tl.multiple_of(remote, hint), hint)
    return remote


@triton.jit
def _translate_write(ptr, from_rank, to_rank, heap_bases, mask=None, hint: tl.constexpr = None):
    """:func:`translate` for an access that writes: with ``IRIS_DEBUG=1`` the addresses must
    also lie in blocks that ``to_rank`` has allocated."""
    remote = translate(ptr, from_rank, to_rank, heap_bases, mask, hint)
    if CHECK_POINTERS:
        _check_allocated(ptr, from_rank, to_rank, heap_bases, mask)
    return remote


@triton.jit
def load(ptr, to_rank, from_rank, heap_bases, mask=None, other=None, cache_modifier: tl.constexpr = tl.constexpr(""),
         volatile: tl.constexpr = False, hint: tl.constexpr = None):
    """Load from ``from_rank``'s heap at ``ptr``'s offset into the caller (``to_rank``). ``hint``:
    see :func:`translate`, as for every device function."""
    return tl.load(translate(ptr, to_rank, from_rank, heap_bases, mask, hint), mask=mask, other=other,
                   cache_modifier=cache_modifier, volatile=volatile)


@triton.jit
def store(ptr, value, from_rank, to_rank, heap_bases, mask=None, cache_modifier: tl.constexpr = tl.constexpr(""),
          hint: tl.constexpr = None):
    """Store ``value`` from the caller (``from_rank``) into ``to_rank``'s heap at ``ptr``'s offset."""
    tl.store(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(value, ptr), mask=mask,
             cache_modifier=cache_modifier)


@triton.jit
def get(from_ptr, to_ptr, from_rank, to_rank, heap_bases, mask=None, other=None, hint: tl.constexpr = None):
    """Copy ``to_rank``'s data at ``from_ptr``'s offset into the caller's (``from_rank``) ``to_ptr``.

    Upstream iris's order: ``from_rank`` is the caller, where ``from_ptr`` points and the data
    lands, and ``to_rank`` the rank read. ``get(buf + offs, out + offs, RANK, peer, heap_bases)``
    reads ``peer``'s ``buf`` into this rank's ``out``."""
    data = tl.load(translate(from_ptr, from_rank, to_rank, heap_bases, mask, hint), mask=mask, other=other)
    tl.store(to_ptr, data, mask=mask)


@triton.jit
def put(from_ptr, to_ptr, from_rank, to_rank, heap_bases, mask=None, other=None, hint: tl.constexpr = None):
    """Copy the caller's (``from_rank``) data at ``from_ptr`` into ``to_rank``'s heap at ``to_ptr``'s offset."""
    data = tl.load(from_ptr, mask=mask, other=other)
    tl.store(_translate_write(to_ptr, from_rank, to_rank, heap_bases, mask, hint), data, mask=mask)


@triton.jit
def copy(src_ptr, dst_ptr, from_rank, to_rank, cur_rank, heap_bases, mask=None, other=None,
         hint: tl.constexpr = None):
    """Copy from ``from_rank``'s heap at ``src_ptr``'s offset to ``to_rank``'s heap at
    ``dst_ptr``'s offset; both pointers are given in the caller's (``cur_rank``) heap, and
    ``hint`` applies to both translated pointers."""
    data = tl.load(translate(src_ptr, cur_rank, from_rank, heap_bases, mask, hint), mask=mask, other=other)
    tl.store(_translate_write(dst_ptr, cur_rank, to_rank, heap_bases, mask, hint), data, mask=mask)


@triton.jit
def _atomic_add(remote, value, mask, sem: tl.constexpr, scope: tl.constexpr):
    """``tl.atomic_add``, and in Triton's interpreter, which has no 16-bit float atomics, the same
    addition through :func:`_interpreted_atomic_add_16`."""
    if INTERPRETED and remote.dtype.element_ty.is_floating() and remote.dtype.element_ty.primitive_bitwidth == 16:
        old = _interpreted_atomic_add_16(remote, value, mask)
    else:
        old = tl.atomic_add(remote, value, mask=mask, sem=sem, scope=scope)
    return old


@triton.jit
def _interpreted_atomic_add_16(remote, value, mask):
    """Add 16-bit floats ``value`` at ``remote`` atomically (the interpreter only): a compare-and-
    swap loop on the 32-bit word that holds each element, its other half kept as it is; each sum
    rounded once, as a GPU's 16-bit atomic add rounds it. Returns the old values. Lanes outside
    ``mask`` swap the words they did not load (0) for the same value, at an address inside the
    block, so they change nothing."""
    address = remote.to(tl.int64)
    valid = address == address if mask is None else mask
    if remote.type.is_block():
        inside = tl.min(tl.where(valid, address, 0x7FFFFFFFFFFFFFFF))
    else:
        inside = address
    words = (tl.where(valid, address, inside) // 4 * 4).to(tl.pointer_type(tl.int32))
    shift = (address % 4 * 8).to(tl.int32)
    old = value
    pending = valid
    while tl.max(pending.to(tl.int32)) > 0:
        word = tl.load(words, mask=pending, other=0, volatile=True)
        current = ((word >> shift) & 0xFFFF).to(tl.int16).to(value.dtype, bitcast=True)
        added = (current.to(tl.float32) + value.to(tl.float32)).to(value.dtype)
        bits = added.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        updated = tl.where(pending, (word & ~(0xFFFF << shift)) | (bits << shift), word)
        seen = tl.atomic_cas(words, word, updated)
        old = tl.where(pending & (seen == word), current, old)
        pending = pending & (seen != word)
    return old


@triton.jit
def atomic_add(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomically add ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return _atomic_add(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(val, ptr), mask,
                       _sem(sem), _scope(scope))


@triton.jit
def atomic_sub(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomically subtract ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return _atomic_add(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), -_like(val, ptr), mask,
                       _sem(sem), _scope(scope))


@triton.jit
def atomic_xchg(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
                scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomically exchange with ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values.
    Triton's interpreter exchanges integers only: there a float exchange goes through the integer
    of the same width, bit for bit (the same exchange)."""
    remote = _translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint)
    value = _like(val, ptr)
    if INTERPRETED and ptr.dtype.element_ty.is_floating():
        bits: tl.constexpr = ptr.dtype.element_ty.primitive_bitwidth
        as_int: tl.constexpr = tl.int16 if bits == 16 else (tl.int32 if bits == 32 else tl.int64)
        old = tl.atomic_xchg(remote.to(tl.pointer_type(as_int), bitcast=True), value.to(as_int, bitcast=True),
                             mask=mask, sem=_sem(sem), scope=_scope(scope))
        return old.to(ptr.dtype.element_ty, bitcast=True)
    return tl.atomic_xchg(remote, value, mask=mask, sem=_sem(sem), scope=_scope(scope))


@triton.jit
def atomic_and(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomic bitwise and with ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return tl.atomic_and(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(val, ptr), mask=mask,
                         sem=_sem(sem), scope=_scope(scope))


@triton.jit
def atomic_or(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
              scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomic bitwise or with ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return tl.atomic_or(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(val, ptr), mask=mask,
                        sem=_sem(sem), scope=_scope(scope))


@triton.jit
def atomic_xor(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomic bitwise xor with ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return tl.atomic_xor(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(val, ptr), mask=mask,
                         sem=_sem(sem), scope=_scope(scope))


@triton.jit
def atomic_min(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomic minimum with ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return tl.atomic_min(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(val, ptr), mask=mask,
                         sem=_sem(sem), scope=_scope(scope))


@triton.jit
def atomic_max(ptr, val, from_rank, to_rank, heap_bases, mask=None, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomic maximum with ``val`` at ``ptr``'s offset on ``to_rank``; returns the old values."""
    return tl.atomic_max(_translate_write(ptr, from_rank, to_rank, heap_bases, mask, hint), _like(val, ptr), mask=mask,
                         sem=_sem(sem), scope=_scope(scope))


@triton.jit
def atomic_cas(ptr, cmp, val, from_rank, to_rank, heap_bases, sem: tl.constexpr = None,
               scope: tl.constexpr = None, hint: tl.constexpr = None):
    """Atomic compare-and-swap at ``ptr``'s offset on ``to_rank``: where the value equals
    ``cmp`` it becomes ``val``; returns the old values. ``cmp`` and ``val`` are converted to
    the pointer's element type (Triton's own atomic_cas requires them to match it exactly)."""
    remote = _translate_write(ptr, from_rank, to_rank, heap_bases, None, hint)
    return tl.atomic_cas(remote, _like(cmp, ptr), _like(val, ptr), sem=_sem(sem), scope=_scope(scope))


@triton.jit
def signal(ptr, value, from_rank, to_rank, heap_bases, sem: tl.constexpr = None,
           scope: tl.constexpr = None):
    """Set the flag at ``ptr``'s offset on ``to_rank`` to ``value``, releasing the program's earlier
    writes to whoever acquires the flag. Returns the flag's old value. A scalar atomic is issued
    by one thread, and its release covers only what that thread has seen: the barrier first makes
    every thread's earlier writes part of it."""
    tl.debug_barrier()
    return tl.atomic_xchg(_translate_write(ptr, from_rank, to_rank, heap_bases), _like(value, ptr),
                          sem=_sem(sem, "release"), scope=_scope(scope))


@triton.jit
def _compare(flag, value, CMP: tl.constexpr):
    if CMP == "eq":
        result = flag == value
    elif CMP == "ne":
        result = flag != value
    elif CMP == "gt":
        result = flag > value
    elif CMP == "lt":
        result = flag < value
    elif CMP == "le":
        result = flag <= value
    else:
        tl.static_assert(CMP == "ge", "CMP must be one of 'eq', 'ne', 'gt', 'ge', 'lt', 'le'")
        result = flag >= value
    return result


@triton.jit
def wait_until(ptr, value, cur_rank, rank, heap_bases, timeout_ns, CMP: tl.constexpr = tl.constexpr("ge"),
               sem: tl.constexpr = None, scope: tl.constexpr = None):
    """Spin until the integer flag at ``ptr``'s offset on ``rank`` compares true against ``value``
    (``flag CMP value``), reading it with acquire semantics at system scope, so that what was
    written before the matching ``signal`` is visible after. Gives up once ``timeout_ns``
    nanoseconds of wall-clock time have passed (the GPU's global timer; the host's clock on CPU
    ranks) instead of hanging: returns True when the condition held, False on timeout. ``ptr`` is
    one flag (a scalar pointer) in the caller's (``cur_rank``) heap."""
    return spin_until(translate(ptr, cur_rank, rank, heap_bases), value, timeout_ns, CMP, sem, scope)


@triton.jit
def spin_until(flag_ptr, value, timeout_ns, CMP: tl.constexpr = tl.constexpr("ge"), sem: tl.constexpr = None,
               scope: tl.constexpr = None):
    """:func:`wait_until` for a flag at an address this program can read directly (``flag_ptr``:
    its own memory, or a peer's already translated): True when ``flag CMP value`` held within
    ``timeout_ns`` nanoseconds, else False."""
    flag = tl.atomic_add(flag_ptr, 0, sem=_sem(sem, "acquire"), scope=_scope(scope))
    if not _compare(flag, value, CMP):
        start = now_ns()
        waited = start - start
        while (not _compare(flag, value, CMP)) and waited < timeout_ns:
            spin_pause(waited)
            flag = tl.atomic_add(flag_ptr, 0, sem=_sem(sem, "acquire"), scope=_scope(scope))
            waited = now_ns() - start
    return _compare(flag, value, CMP)
