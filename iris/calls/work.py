"""Handles of collectives called with ``async_op=True``, like torch.distributed's ``Work``.

On GPUs an asynchronous call runs on a side stream of its context's device: the side stream
first waits for everything queued so far on the caller's current stream (the inputs are ready),
the call is enqueued there, and :meth:`Work.wait` makes the caller's current stream wait for it
(the host does not block, as with NCCL). The tensors of the call are recorded on the side stream
(``Tensor.record_stream``), so the caching allocator does not hand their memory to another
tensor while the call may still use it, even if the caller drops them before waiting.

CPU ranks run every call synchronously: the handle is complete when it is returned. Calls made
inside ``torch.compile`` are ordered on the current stream (the graph is one stream of work), and
return a complete handle too.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

__all__ = ["CompletedWork", "Work", "run_async"]

#: The side stream of each device, per thread (streams are cheap; one per device keeps
#: successive asynchronous calls ordered among themselves, as one process group's are).
_SIDE_STREAMS = threading.local()


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values`` (and inside lists and tuples of them)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors(value))
    return found


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The side stream asynchronous calls on ``device`` run on (made on first use)."""
    streams = _SIDE_STREAMS.__dict__.setdefault("by_device", {})
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in streams:
        streams[index] = torch.cuda.Stream(torch.device("cuda", index))
    return streams[index]


class CompletedWork:
    """The handle of a call whose work is already ordered on the caller's stream (CPU ranks, or
    inside ``torch.compile``): :meth:`wait` returns at once and :meth:`is_completed` is True."""

    def __init__(self, result: Any = None):
        self._result = result

    def wait(self, timeout=None) -> bool:
        """Nothing to wait for; True, as torch's ``Work.wait``."""
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors (as torch's ``Work.result()``)."""
        return _tensors([self._result])

    def get_future(self) -> torch.futures.Future:
        """A completed future holding :meth:`result`."""
        future = torch.futures.Future()
        future.set_result(self.result())
        return future


class Work(CompletedWork):
    """The handle of a call enqueued on a side stream (GPUs). :meth:`wait` orders the caller's
    current stream after the call; :meth:`is_completed` asks whether the device finished it."""

    def __init__(self, result: Any, event: "torch.cuda.Event", device: torch.device):
        super().__init__(result)
        self._event = event
        self._device = device

    def wait(self, timeout=None) -> bool:
        """Make the current stream wait for the call (the host does not block); the outputs may
        then be used on the current stream. ``timeout`` is accepted for torch's signature: a call
        that cannot finish gives up after the context's timeout on the device and raises at the
        next iris call."""
        current = torch.cuda.current_stream(self._device)
        current.wait_event(self._event)
        for tensor in self.result():
            if tensor.device.type == "cuda":
                tensor.record_stream(current)  # outputs made on the side stream, used on this one
        return True

    def is_completed(self) -> bool:
        return self._event.query()

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        """:meth:`wait`, then a completed future holding :meth:`result`: work chained on it with
        ``then`` is ordered after the call on the current stream."""
        self.wait()
        return super().get_future()


def run_async(device: torch.device, call: Callable[[], Any], arguments) -> CompletedWork:
    """Run ``call()`` as an asynchronous collective on ``device``: on a side stream after the
    current stream's work (GPUs), or at once (CPU ranks). ``arguments`` are the call's arguments,
    whose tensors are recorded on the side stream."""
    if device.type != "cuda":
        return CompletedWork(call())
    current = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        result = call()
        event = torch.cuda.Event()
        event.record(side)
    for tensor in _tensors(arguments) + _tensors([result]):
        if tensor.device.type == "cuda":
            tensor.record_stream(side)
    return Work(result, event, device)
