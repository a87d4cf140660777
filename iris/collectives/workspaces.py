"""Workspaces: named heap buffers that a context's device protocols share, grown collectively.

Collectives, fused operations and a backend's own protocols need heap buffers that outlive one
call: data slots peers push into, flags and call counts that only grow. :class:`Workspaces`
(``ctx.workspaces``) keeps one buffer per name, the same on every rank, and grows it
collectively (a host barrier) the first time a call needs more than before; calls that fit
allocate nothing and never wait on the host, so they can be captured in CUDA graphs. A growth
starts with a host exchange of the call in progress: ranks that made different calls (which may
need different workspaces, or one rank none) raise CallMismatchError there, naming both calls,
rather than allocate apart (docs/faults.md).

Graphs hold addresses. Once a call was captured, a buffer that grows is not freed but kept, on
every rank alike, for the graphs that launch with its old address, until
:meth:`Workspaces.release_graph_buffers`. Local buffers outside the heap that grow the same way
are kept alike (:meth:`Workspaces.keep_for_graphs`). Growing during a capture is an error: it
needs a host barrier.

Repeats of earlier calls launch with workspace addresses: replacing a workspace forgets them
(:func:`iris.calls.repeats.invalidate`).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


import torch

from iris.calls.repeats import invalidate as invalidate_repeats
from iris.errors import IrisError

__all__ = ["REGION_ALIGNMENT", "Workspaces", "WorkspacesHost", "capturing"]

#: Byte alignment of the regions of :meth:`Workspaces.slot_regions`.
REGION_ALIGNMENT = 256


#: ``torch.cuda.is_current_stream_capturing`` without its Python layer (a repeated call asks it
#: every time); a CPU build of torch has neither.
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)


def capturing(device_type: str) -> bool:
    """Whether work enqueued now on a device of ``device_type`` (``"cuda"``, ``"cpu"``) is being
    captured into a CUDA graph (read from the current device's current stream: iris launches on
    the current device, the context's)."""
    return device_type == "cuda" and _stream_capturing()


class Workspaces:
    """The named heap workspaces of one context (``ctx.workspaces``). Every method that can grow a
    buffer is collective: all ranks ask for the same names and sizes in the same order."""

    def __init__(self, context):
        self._context = context
        self._device_type = context.device.type  # read on every call (torch makes the string anew)
        self._buffers: dict[str, torch.Tensor] = {}
        #: Whether a call was captured into a CUDA graph: graphs may then hold workspace addresses.
        self._graph_captured = False
        #: Buffers outgrown after a capture, kept for the graphs that use them: heap workspaces
        #: (freed by :meth:`release_graph_buffers`) and local buffers (dropped then).
        self._kept_for_graphs: list[tuple[bool, torch.Tensor]] = []
        #: How many times each workspace was allocated (:meth:`version`).
        self._versions: dict[str, int] = {}
        #: Changes whenever a workspace is replaced (launches made before hold old addresses).

    def version(self, name: str) -> int:
        """How many times the workspace ``name`` was allocated (0: never): results that are views
        of it hold the version they were made in, and are stale once it changes."""
        return self._versions.get(name, 0)

    def existing(self, name: str) -> torch.Tensor | None:
        """The workspace ``name`` as it is, or None where none was allocated yet."""
        return self._buffers.get(name)

    def get(self, name: str, nbytes: int, *, fill: int | None = None) -> torch.Tensor:
        """At least ``nbytes`` of heap (uint8), the same on every rank: the workspace ``name``
        (a protocol with its own state keeps its own name). ``fill``: the value of every byte
        when allocated (None: left as allocated). Grows collectively, with a host barrier, the
        first time a call needs more than before (an IrisError during a CUDA graph capture);
        otherwise allocates nothing. Before it grows, the ranks check that they are in the same
        call (:meth:`iris.context.failstop.FailStopMixin._agree_on_call`): ranks whose calls
        differ raise CallMismatchError, naming every rank's call, instead of allocating apart."""
        now_capturing = self.note_capture()  # e.g. fused operations, which ask for their buffers per call
        current = self._buffers.get(name)
        if current is not None and current.numel() >= nbytes:
            return current
        if now_capturing:
            raise IrisError(f"workspace {name!r} must grow to {nbytes} bytes, which takes a host barrier and an "
                            f"allocation on every rank and cannot happen inside a CUDA graph capture; before "
                            f"capturing, make one call of each size and dtype (which can change the algorithm)")
        ctx = self._context
        ctx._agree_on_call()  # the same call on every rank, so the same workspace and size
        ctx.barrier()  # no peer is still writing into the old workspace
        if current is not None:
            del self._buffers[name]
            invalidate_repeats()
            # Kept or freed alike on every rank, or the ranks' heaps would no longer match.
            self._graph_captured = any(ctx.comm.all_gather_object(self._graph_captured))
            if self._graph_captured:
                self._kept_for_graphs.append((True, current))
                ctx.info(f"workspace {name!r} grew after a CUDA graph capture; its old {current.numel()} bytes "
                         f"stay allocated for the graphs captured with them")
            else:
                ctx.free(current)
        buffer = self._buffers[name] = ctx.empty(nbytes, dtype=torch.uint8)
        self._versions[name] = self._versions.get(name, 0) + 1
        if fill is not None:
            buffer.fill_(fill)
        ctx.barrier()  # every rank's new workspace is there, filled, before anyone writes into it
        return buffer

    def slot_regions(self, name: str, nbytes: int, *, fill: int) -> tuple[torch.Tensor, int]:
        """The workspace ``name`` laid out as two slots (for alternate calls) of one region per
        rank, each region at least ``nbytes`` and a multiple of ``REGION_ALIGNMENT`` bytes (which
        keeps every region's vectors aligned): the workspace (uint8) and its regions' bytes. The
        layout follows the workspace's size, not the call's, so calls of any size and dtype use
        the same slots; it changes only when the workspace grows, collectively. ``fill`` as for
        :meth:`get`."""
        return self.regions(name, 2 * self._context.world_size, nbytes, fill=fill)

    def regions(self, name: str, count: int, nbytes: int, *, fill: int | None = None) -> tuple[torch.Tensor, int]:
        """The workspace ``name`` laid out as ``count`` regions of at least ``nbytes`` each, each a
        multiple of ``REGION_ALIGNMENT`` bytes: the workspace (uint8) and its regions' bytes. The
        layout follows the workspace's size, not the call's, as in :meth:`slot_regions`."""
        aligned = -(-nbytes // REGION_ALIGNMENT) * REGION_ALIGNMENT
        space = self.get(name, count * aligned, fill=fill)
        return space, space.numel() // count // REGION_ALIGNMENT * REGION_ALIGNMENT

    def note_capture(self) -> bool:
        """Whether a CUDA graph capture is in progress on the context's device, remembered: a
        caller that launches without asking for a workspace (a cached launch) calls it."""
        now = capturing(self._device_type)
        self._graph_captured |= now
        return now

    @property
    def graph_captured(self) -> bool:
        """Whether a call was captured into a CUDA graph, which may hold buffer addresses since:
        outgrown buffers are then kept, not freed."""
        return self._graph_captured

    def keep_for_graphs(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (a local one, outside the heap, outgrown after a capture) allocated for
        the graphs that use it, until :meth:`release_graph_buffers`."""
        self._kept_for_graphs.append((False, buffer))

    def release_graph_buffers(self) -> None:
        """Free the buffers kept for CUDA graphs captured before they were outgrown, and forget
        those captures: outgrown buffers are freed again until the next capture. Collective;
        call it once no graph captured so far will be replayed."""
        ctx = self._context
        ctx.barrier()  # no rank still replays into them
        for on_heap, buffer in self._kept_for_graphs:
            if on_heap:
                ctx.free(buffer)
        self._kept_for_graphs.clear()
        self._graph_captured = False


class WorkspacesHost(Protocol):
    """What :class:`Workspaces` needs from the context that owns it (checked when a context is made)."""

    barrier: Callable[[], None]
    comm: Any
    free: Callable
    info: Callable
    empty: Callable
    zeros: Callable
