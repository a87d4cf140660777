"""Device-side tracing as kernels spell it: ``TraceEvent`` ids and the ``tracing`` member of the
device contexts.

A kernel records an event with one call at each end::

    span = dctx.tracing.begin(TraceEvent().put, target_rank=peer, nbytes=n * 2, tile=t)
    ...                                           # the work the event covers
    dctx.tracing.end(span)

(``record(...)`` is an instant event; upstream iris's ``record_event_start`` /
``record_event_end`` are the same with its arguments). A context built with
``initialize(..., tracing=False)`` (the default) carries a disabled :class:`DeviceTracing`: the calls
return 0 and do nothing, decided at compile time, so the compiled kernel is the one it would be
without them. Built with ``tracing=True``, a context appends events to this rank's trace buffer,
the one ``ctx.tracing.enable()`` made (:mod:`iris.tracing`: its layout, and the export); before
``enable()``, or once the buffer is full, an event is dropped, never written elsewhere.
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import linecache

import triton
import triton.language as tl

from iris.heap.device_context import TRAILER
from iris.tracing import EVENT_FIELDS, EVENT_IDS, OPERATION_EVENTS, TRACE_HEADER
from iris_triton.device.clock import now_ns
from iris_triton.device.compiled import device_class, device_constructor, device_method

__all__ = ["COMPUTE_EVENT", "DeviceTracing", "OPERATION_EVENT", "PUSH_EVENT", "TRACE_EVENT_IDS", "TraceEvent",
           "WAIT_EVENT"]

#: Event ids by name (upstream iris's numbering, then iris's own): ``TraceEvent().<name>``.
TRACE_EVENT_IDS = EVENT_IDS

#: The kinds iris's own kernels record: a whole operation (``OPERATION_EVENT + SITE``, its wait
#: site's code, :mod:`iris_triton.protocol.waits`), and its phases.
OPERATION_EVENT: tl.constexpr = tl.constexpr(OPERATION_EVENTS)
WAIT_EVENT: tl.constexpr = tl.constexpr(EVENT_IDS["wait"])
PUSH_EVENT: tl.constexpr = tl.constexpr(EVENT_IDS["push"])
COMPUTE_EVENT: tl.constexpr = tl.constexpr(EVENT_IDS["compute"])

# The trailer words' distances from the context tensor, less the world size.
_TRACE_DISTANCE: tl.constexpr = tl.constexpr(2 + TRAILER.index("trace_distance"))
_TRACE_CAPACITY: tl.constexpr = tl.constexpr(2 + TRAILER.index("trace_capacity"))
_HEADER: tl.constexpr = tl.constexpr(TRACE_HEADER)
_FIELDS: tl.constexpr = tl.constexpr(len(EVENT_FIELDS))
_KIND, _PROGRAM, _TILE, _TILE_N, _TARGET, _START, _END, _BYTES, _OP = (
    tl.constexpr(EVENT_FIELDS.index(name)) for name in
    ("kind", "program", "tile", "tile_n", "target_rank", "start_ns", "end_ns", "bytes", "op"))


def _trace_event_class():
    """``TraceEvent``: ``TraceEvent().put`` and so on inside a kernel, each a compile-time constant.
    Its constructor is generated with one assignment per id: Triton's JIT follows what a
    constexpr function calls, and a loop over a dict is not something it can follow."""
    source = "def __init__(self):\n" + "".join(f"    self.{name} = tl.constexpr({value})\n"
                                                for name, value in TRACE_EVENT_IDS.items())
    filename = "<iris_triton.device.tracing: TraceEvent.__init__>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace = {"tl": tl}
    exec(compile(source, filename, "exec", dont_inherit=True), namespace)
    return device_class(type("TraceEvent", (), {
        "__annotations__": {name: tl.constexpr for name in TRACE_EVENT_IDS},
        "__doc__": "Ids of the events a traced kernel records (``TraceEvent().put``).",
        "__module__": __name__,
        "__init__": device_constructor(namespace["__init__"]),
    }))


TraceEvent = _trace_event_class()


@triton.jit
def _append(buffer, capacity, kind, target_rank, nbytes, tile, tile_n, op, start, end):
    """A new event in ``buffer`` (room for ``capacity``; none when 0) and its handle (slot + 1),
    or 0 when it was dropped. The slot comes from the buffer's counter, so concurrent programs
    never share one; the counter keeps counting past the capacity (the export reports the
    dropped events)."""
    room = capacity > 0
    slot = tl.atomic_add(buffer, 1, mask=room, sem="relaxed", scope="gpu")
    kept = room & (slot < capacity)
    event = buffer + _HEADER + slot * _FIELDS
    tl.store(event + _KIND, kind, mask=kept)
    tl.store(event + _PROGRAM, tl.program_id(0), mask=kept)
    tl.store(event + _TILE, tile, mask=kept)
    tl.store(event + _TILE_N, tile_n, mask=kept)
    tl.store(event + _TARGET, target_rank, mask=kept)
    tl.store(event + _BYTES, nbytes, mask=kept)
    tl.store(event + _OP, op, mask=kept)
    tl.store(event + _START, start, mask=kept)
    tl.store(event + _END, end, mask=kept)
    return tl.where(kept, slot + 1, 0)


class DeviceTracing:
    """The ``tracing`` member of a device context: records events when built enabled."""

    enabled: tl.constexpr
    buffer: tl.tensor
    capacity: tl.tensor

    @device_constructor
    def __init__(self, enabled, buffer, capacity):
        self.enabled = tl.constexpr(enabled)
        self.buffer = buffer
        self.capacity = capacity

    @device_method
    def of(context_tensor, world_size, enabled: tl.constexpr):
        """The member of a context built from ``context_tensor`` (``world_size`` ranks); enabled,
        it reads where this rank's trace buffer is from the tensor's trailer
        (:mod:`iris.heap.device_context`)."""
        buffer = context_tensor
        capacity = context_tensor
        if enabled:
            buffer = context_tensor + tl.load(context_tensor + world_size + _TRACE_DISTANCE)
            capacity = tl.load(context_tensor + world_size + _TRACE_CAPACITY)
        return DeviceTracing(enabled, buffer, capacity)

    @device_method
    def begin(self, kind, target_rank=-1, nbytes=0, tile=0, op=0, tile_n=0):
        """Starts an event of ``kind`` (a ``TraceEvent`` id) by this program, on ``target_rank``
        (-1: none), of ``nbytes`` bytes, for ``tile`` (``tile_n``: a second tile coordinate)
        of call ``op``; returns its handle for :meth:`end` (0: not recorded)."""
        handle = 0
        if self.enabled:
            handle = _append(self.buffer, self.capacity, kind, target_rank, nbytes, tile, tile_n, op, now_ns(), 0)
        return handle

    @device_method
    def end(self, handle):
        """Ends the event ``handle`` (:meth:`begin`) now; nothing for handle 0."""
        if self.enabled:
            tl.store(self.buffer + _HEADER + (handle - 1) * _FIELDS + _END, now_ns(), mask=handle > 0)

    @device_method
    def record(self, kind, target_rank=-1, nbytes=0, tile=0, op=0, tile_n=0):
        """An instant event (:meth:`begin`'s arguments), begun and ended at once."""
        if self.enabled:
            _append(self.buffer, self.capacity, kind, target_rank, nbytes, tile, tile_n, op, now_ns(), -1)

    @device_method
    def record_event_start(self, event_id: tl.constexpr, target_rank, address, pid_m, pid_n, mask=None):
        """Upstream iris's spelling of :meth:`begin`: an event of ``event_id`` on ``target_rank``
        for tile ``(pid_m, pid_n)``; its bytes are those of ``address``'s elements that ``mask``
        selects (all of them without a mask). Returns the handle (0 when tracing is disabled)."""
        handle = 0
        if self.enabled:
            elements = address.numel
            if mask is not None:
                elements = tl.sum(mask.to(tl.int32))
            nbytes = elements * ((address.dtype.element_ty.primitive_bitwidth + 7) // 8)
            handle = self.begin(event_id, target_rank, nbytes, pid_m, 0, pid_n)
        return handle

    @device_method
    def record_event_end(self, handle):
        """Upstream iris's spelling of :meth:`end`."""
        self.end(handle)


DeviceTracing = device_class(DeviceTracing)
