"""``ctx.tracing``: what iris's kernels and calls did on every rank, as one Chrome trace.

Kernels compiled with tracing on (iris's own, while ``ctx.tracing.enable()`` is in force, and a
user's that builds its device context with ``tracing=True``) append events to this rank's trace
buffer; every iris call on the host is a range too (an NVTX range on GPUs, a
``torch.profiler.record_function`` range whenever torch's profiler runs, and an event of the
trace). :meth:`Tracing.export` merges every rank's events into one JSON file in the Chrome trace
format, which Perfetto (ui.perfetto.dev) and chrome://tracing open: a process per rank, a track
for the host's calls and one per kernel program.

The trace buffer, one per rank, is int64: a header of :data:`TRACE_HEADER` words (word 0 counts
the events appended, also those dropped once it was full), then one row of
:data:`EVENT_FIELDS` per event. Kernels find it through the device-context tensor's trailer
(:mod:`iris.heap.device_context`): ``trace_distance`` is the buffer's distance from the tensor in
elements and ``trace_capacity`` its capacity in events (0: no buffer; events are dropped). Device
timestamps are the GPU's global timer (nanoseconds), put on the host's monotonic clock at export
with an offset measured when tracing was enabled; on CPU ranks both are the host's clock.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from torch.autograd import profiler as autograd_profiler

from iris.calls.repeats import invalidate as invalidate_repeats
from iris.heap.device_context import set_trailer

__all__ = ["EVENT_FIELDS", "EVENT_IDS", "OPERATION_EVENTS", "TRACE_HEADER", "Tracing", "TracingHost", "chrome_trace"]

#: Words of the trace buffer before the first event (word 0: events appended).
TRACE_HEADER = 8
#: The words of one event, in order: its kind (:data:`EVENT_IDS`), the program that recorded it,
#: its tile (two coordinates), the rank it concerns (-1: none), begin and end on the device's
#: clock in nanoseconds (end 0: not ended; -1: an instant event), its bytes and the call it
#: belongs to (iris's kernels: the call's sequence number on this rank).
EVENT_FIELDS = ("kind", "program", "tile", "tile_n", "target_rank", "start_ns", "end_ns", "bytes", "op")
#: Event kinds by name: upstream iris's numbering (one per device function, then phases of a
#: kernel), then iris's phases. Kinds from :data:`OPERATION_EVENTS` on are whole operations of a
#: backend, named by the backend (``DeviceOps._trace_event_names``).
EVENT_IDS = {
    "load": 0, "store": 1, "get": 2, "put": 3, "copy": 4, "atomic_add": 5, "atomic_sub": 6, "atomic_cas": 7,
    "atomic_xchg": 8, "atomic_xor": 9, "atomic_and": 10, "atomic_or": 11, "atomic_min": 12, "atomic_max": 13,
    "fetch": 1024, "push": 1025, "compute": 2048, "reduce": 2049, "wait": 3072, "barrier": 3073,
}
OPERATION_EVENTS = 4096
#: Events a buffer holds unless ``enable(max_events=...)`` says otherwise.
DEFAULT_MAX_EVENTS = 1 << 20


class Tracing:
    """The ``tracing`` service of a context (shared by its group views)."""

    def __init__(self, context):
        self._context = context
        self.enabled = False
        self.max_events = 0
        self._buffer: torch.Tensor | None = None
        self._device_contexts: weakref.WeakSet = weakref.WeakSet()
        self._host_events: list[tuple[str, int, int]] = []
        self._clock_offset_ns = 0
        self._nvtx = _nvtx_asked() and context.device.type == "cuda"

    # -- switching on and off --------------------------------------------------------------------

    def enable(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        """Record from now on: a buffer of ``max_events`` events on this rank (events past it
        are counted, not kept), iris's kernels compiled with tracing from their next launch, and
        every iris call a host range. Not collective; enable it on every rank to trace them all.
        CUDA graphs captured before keep the kernels they captured."""
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events <= 0:
            raise ValueError(f"ctx.tracing.enable: max_events must be a positive int, got {max_events!r}")
        context = self._context
        self._buffer = torch.zeros(TRACE_HEADER + max_events * len(EVENT_FIELDS), dtype=torch.int64,
                                   device=context.device)
        self.max_events = max_events
        self._host_events = []
        self._clock_offset_ns = self._measure_clock_offset()
        self._switch(True)
        context.info(f"tracing: enabled, up to {max_events} events per rank")

    def disable(self) -> None:
        """Stop recording and release the buffer (export first to keep its events)."""
        self._buffer = None
        self.max_events = 0
        self._host_events = []
        self._switch(False)

    def reset(self) -> None:
        """Forget the events recorded so far (the buffer stays); wait for kernels still recording
        first (``ctx.check()``)."""
        self._require_enabled("reset")
        self._buffer[:TRACE_HEADER].zero_()
        self._host_events = []

    @property
    def trace_counter(self) -> torch.Tensor | None:
        """Upstream iris's event counter: a one-element tensor on the device counting the
        events kernels appended (those past ``max_events`` too), a view of this rank's buffer;
        None while tracing is off."""
        return None if self._buffer is None else self._buffer[:1]

    def _switch(self, enabled: bool) -> None:
        self.enabled = enabled
        invalidate_repeats()  # they launch kernels compiled with tracing as it was
        self._nvtx = (enabled or _nvtx_asked()) and self._context.device.type == "cuda"
        for tensor in list(self._device_contexts):
            self._write_trailer(tensor)

    def attach(self, device_context: torch.Tensor) -> None:
        """Point ``device_context`` (a device-context tensor of this context or of one of its
        group views) at this rank's buffer, now and whenever tracing is switched."""
        self._device_contexts.add(device_context)
        self._write_trailer(device_context)

    def _write_trailer(self, device_context: torch.Tensor) -> None:
        if self._buffer is None:
            distance, capacity = 0, 0
        else:
            distance = (self._buffer.data_ptr() - device_context.data_ptr()) // device_context.element_size()
            capacity = self.max_events
        set_trailer(device_context, trace_distance=distance, trace_capacity=capacity)

    def _measure_clock_offset(self) -> int:
        """The device clock's lead over the host's monotonic clock, in nanoseconds (0 where the
        device's clock is the host's)."""
        before = time.monotonic_ns()
        device_now = self._context._device_clock_ns()
        after = time.monotonic_ns()
        return 0 if device_now is None else device_now - (before + after) // 2

    def _require_enabled(self, what: str) -> None:
        if not self.enabled:
            raise RuntimeError(f"ctx.tracing.{what}: tracing is not enabled; call ctx.tracing.enable() first")

    # -- host ranges ------------------------------------------------------------------------------

    def host_range(self, name: str):
        """The range of one iris call named ``name``, or None when nothing records it (the
        common case: a call then pays one check)."""
        if not self.records_host_ranges:
            return None
        return _HostRange(self, f"iris.{name}")

    @property
    def records_host_ranges(self) -> bool:
        """Whether iris calls are recorded as host ranges now (tracing, NVTX or torch's profiler)."""
        return self.enabled or self._nvtx or autograd_profiler._is_profiler_enabled  # read on every call

    # -- reading and export ------------------------------------------------------------------------

    def event_names(self) -> dict[int, str]:
        """Every event kind's name by id: :data:`EVENT_IDS`' and the backend's operations'."""
        return {**{v: k for k, v in EVENT_IDS.items()}, **self._context._trace_event_names()}

    def events(self) -> dict[str, Any]:
        """This rank's record: ``{"rank", "device": [event dicts], "host": [(name, start_ns,
        end_ns)], "appended", "dropped"}``, device times already on the host's clock. Waits for
        this rank's queued device work."""
        self._require_enabled("events")
        if self._buffer.is_cuda:
            torch.cuda.synchronize(self._buffer.device)
        buffer = self._buffer.cpu()
        appended = int(buffer[0])
        kept = min(appended, self.max_events)
        rows = buffer[TRACE_HEADER:TRACE_HEADER + kept * len(EVENT_FIELDS)].view(kept, len(EVENT_FIELDS)).tolist()
        device = []
        for row in rows:
            event = dict(zip(EVENT_FIELDS, row))
            event["start_ns"] -= self._clock_offset_ns
            if event["end_ns"] > 0:
                event["end_ns"] -= self._clock_offset_ns
            device.append(event)
        return {"rank": self._context.rank, "device": device, "host": list(self._host_events),
                "appended": appended, "dropped": appended - kept}

    def export(self, path: str | os.PathLike = "trace.json", merge: bool = True) -> dict | None:
        """Write the trace to ``path`` and return it. With ``merge`` (collective: every rank of
        the context calls it), rank 0 gathers every rank's events and writes one file; the other
        ranks write nothing and return None. Without, each rank writes its own events to
        ``path`` with ``_rank<r>`` before the suffix."""
        record = self.events()
        context = self._context
        names = self.event_names()
        if merge:
            records = context.comm.all_gather_object(record)
            if context.rank != 0:
                return None
            target = Path(path)
        else:
            records = [record]
            target = Path(path)
            target = target.with_name(f"{target.stem}_rank{context.rank}{target.suffix}")
        trace = chrome_trace(records, names, max_events=self.max_events, world_size=context.world_size)
        target.write_text(json.dumps(trace))
        context.info(f"tracing: wrote {len(trace['traceEvents'])} trace events to {target}")
        return trace


def _nvtx_asked() -> bool:
    """``IRIS_NVTX=1``: iris's calls are NVTX ranges also while tracing is off (for Nsight)."""
    return os.environ.get("IRIS_NVTX", "0") == "1"


class _HostRange:
    """One iris call as a host range: NVTX, torch's profiler, and the trace."""

    __slots__ = ("tracing", "name", "start", "profiled")

    def __init__(self, tracing: Tracing, name: str):
        self.tracing = tracing
        self.name = name
        self.profiled = None

    def __enter__(self) -> None:
        if self.tracing._nvtx:
            torch.cuda.nvtx.range_push(self.name)
        if autograd_profiler._is_profiler_enabled:
            self.profiled = torch.profiler.record_function(self.name)
            self.profiled.__enter__()
        self.start = time.monotonic_ns()

    def __exit__(self, *exc) -> None:
        if self.tracing.enabled:
            self.tracing._host_events.append((self.name, self.start, time.monotonic_ns()))
        if self.profiled is not None:
            self.profiled.__exit__(*exc)
        if self.tracing._nvtx:
            torch.cuda.nvtx.range_pop()


HOST_TRACK = 0


def chrome_trace(records: list[dict], names: dict[int, str], **metadata) -> dict:
    """The Chrome trace (``{"traceEvents": [...], ...}``) of every rank's :meth:`Tracing.events`:
    a process per rank, the host's calls on track 0, each program's events on a track of its own
    (a second track where events of two kernels running at once overlap without nesting), times
    in microseconds from the first event of any rank."""
    starts = [e["start_ns"] for r in records for e in r["device"]] + [s for r in records for _, s, _ in r["host"]]
    zero = min(starts, default=0)
    events: list[dict] = []
    for record in records:
        rank = record["rank"]
        events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": HOST_TRACK, "args": {"name": "host"}})
        for name, start, end in record["host"]:
            events.append({"name": name, "cat": "host", "ph": "X", "pid": rank, "tid": HOST_TRACK,
                           "ts": (start - zero) / 1e3, "dur": (end - start) / 1e3})
        tracks: dict[tuple[int, int], int] = {}
        for event, lane in _lanes(record["device"]):
            key = (event["program"], lane)
            if key not in tracks:
                tracks[key] = tid = HOST_TRACK + 1 + len(tracks)
                label = f"program {key[0]}" + (f" ({lane + 1})" if lane else "")
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
            events.append(_device_event(event, names, rank, tracks[key], zero))
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {**metadata, "dropped": {r["rank"]: r["dropped"] for r in records}}}


def _device_event(event: dict, names: dict[int, str], rank: int, tid: int, zero: int) -> dict:
    args = {k: event[k] for k in ("tile", "tile_n", "target_rank", "bytes", "op")}
    out = {"name": names.get(event["kind"], f"event {event['kind']}"), "cat": "device", "pid": rank, "tid": tid,
           "ts": (event["start_ns"] - zero) / 1e3, "args": args}
    if event["end_ns"] > 0:
        out.update(ph="X", dur=max(0, event["end_ns"] - event["start_ns"]) / 1e3)
    else:
        out.update(ph="i", s="t")
        if event["end_ns"] == 0:
            args["unfinished"] = True
    return out


def _lanes(device_events: list[dict]):
    """``(event, lane)`` for each event, lanes per program such that the events of one lane
    nest (an event starts and ends inside the open one, or after it ended)."""
    open_by_lane: dict[int, list[list[int]]] = {}
    ordered = sorted(device_events, key=lambda e: (e["program"], e["start_ns"], -_end(e)))
    for event in ordered:
        lanes = open_by_lane.setdefault(event["program"], [])
        start, end = event["start_ns"], _end(event)
        for stack in lanes:  # close what ended before this event starts
            while stack and stack[-1] <= start:
                stack.pop()
        lane = next((i for i, stack in enumerate(lanes) if not stack or end <= stack[-1]), len(lanes))
        if lane == len(lanes):
            lanes.append([])
        lanes[lane].append(end)
        yield event, lane


def _end(event: dict) -> int:
    return max(event["end_ns"], event["start_ns"])


class TracingHost(Protocol):
    """What :class:`Tracing` needs from the context that owns it (checked when a context is made)."""

    _device_context: Any
    comm: Any
    device: Any
    info: Callable
