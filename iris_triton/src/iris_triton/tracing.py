"""Device-side tracing as kernels spell it: ``TraceEvent`` ids and the ``tracing`` member of the
device contexts (upstream iris's names).

A context built with ``initialize(..., tracing=False)`` (the default) carries a disabled
:class:`DeviceTracing`: ``record_event_start`` returns 0 and ``record_event_end`` does nothing,
decided at compile time, so a kernel that records events costs nothing when tracing is off.
Recording (``tracing=True``) is not available yet: such a kernel fails to compile with a message
that says so, rather than running without recording.
"""
# No `from __future__ import annotations`: Triton aggregates read the field annotations as types.

import linecache

import triton.language as tl

from iris_triton.compiled import device_class, device_constructor, device_method

__all__ = ["DeviceTracing", "TRACE_EVENT_IDS", "TraceEvent"]

#: Event ids by name, upstream iris's numbering (one per device function, then phases of a kernel).
TRACE_EVENT_IDS = {
    "load": 0, "store": 1, "get": 2, "put": 3, "copy": 4, "atomic_add": 5, "atomic_sub": 6, "atomic_cas": 7,
    "atomic_xchg": 8, "atomic_xor": 9, "atomic_and": 10, "atomic_or": 11, "atomic_min": 12, "atomic_max": 13,
    "fetch": 1024, "compute": 2048, "reduce": 2049, "wait": 3072, "barrier": 3073,
}

TRACING_UNAVAILABLE = ("iris: initialize(..., tracing=True): device-side tracing is not available in this version "
                       "of iris; build the context with tracing=False (the default)")


def _trace_event_class():
    """``TraceEvent``: ``TraceEvent().put`` and so on inside a kernel, each a compile-time constant.
    Its constructor is generated with one assignment per id: Triton's JIT follows what a
    constexpr function calls, and a loop over a dict is not something it can follow."""
    source = "def __init__(self):\n" + "".join(f"    self.{name} = tl.constexpr({value})\n"
                                                for name, value in TRACE_EVENT_IDS.items())
    filename = "<iris_triton.tracing: TraceEvent.__init__>"
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


class DeviceTracing:
    """The ``tracing`` member of a device context: records events when tracing is enabled."""

    enabled: tl.constexpr

    @device_constructor
    def __init__(self, enabled):
        self.enabled = tl.constexpr(enabled)

    @device_method
    def record_event_start(self, event_id: tl.constexpr, target_rank, address, pid_m, pid_n, mask=None):
        """The handle of a new event (0 when tracing is disabled)."""
        tl.static_assert(not self.enabled, TRACING_UNAVAILABLE)
        return 0

    @device_method
    def record_event_end(self, handle):
        """Ends the event ``handle`` (nothing when tracing is disabled)."""
        tl.static_assert(not self.enabled, TRACING_UNAVAILABLE)


DeviceTracing = device_class(DeviceTracing)
