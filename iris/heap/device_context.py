"""The device-context tensor: the one argument from which device code builds a rank's context.

It is int64: the rank, the world size and every rank's heap base (upstream iris's layout, so
``heap_bases`` is ``context + 2``), then iris's own *trailer*, one word per name of
:data:`TRAILER`:

- ``heap_size``: bytes of symmetric heap per rank;
- ``trace_distance``, ``trace_capacity``: where this rank's trace buffer is (its distance from
  the tensor, in int64 elements) and how many events it holds; 0 and 0 without a buffer
  (:mod:`iris.tracing`);
- ``timeout_ns``: how long a device-side wait of iris's kernels may last, in nanoseconds;
- ``faults``, ``host_faults``: the addresses of the int32 fault words in which those waits record
  a give-up, and of their host-visible copy (the backend's: for Triton,
  :mod:`iris_triton.protocol.waits`); 0 until the backend sets them.

Every context and group view has its own tensor; the heap fills in the upstream part and the
heap size, tracing and the backend the rest of the trailer (:func:`set_trailer`). Kernels read the
trailer at :func:`trailer_index`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["TRAILER", "make_device_context", "set_trailer", "trailer_index"]

#: The trailer's words, in order, after the heap bases.
TRAILER = ("heap_size", "trace_distance", "trace_capacity", "timeout_ns", "faults", "host_faults")


def trailer_index(name: str, world_size: int) -> int:
    """The index of the trailer word ``name`` in a device context of ``world_size`` ranks."""
    return 2 + world_size + TRAILER.index(name)


def make_device_context(rank: int, world_size: int, bases: Sequence[int], heap_size: int,
                        device: torch.device) -> torch.Tensor:
    """A device-context tensor on ``device`` for ``rank`` of ``world_size`` with the heap ``bases``
    (one per rank) of ``heap_size`` bytes each; the rest of the trailer 0."""
    if len(bases) != world_size:
        raise ValueError(f"a device context of {world_size} ranks needs {world_size} heap bases, got {len(bases)}")
    words = [rank, world_size, *bases, heap_size] + [0] * (len(TRAILER) - 1)
    return torch.tensor(words, dtype=torch.int64, device=device)


def set_trailer(device_context: torch.Tensor, **words: int) -> None:
    """Write the trailer ``words`` (by name) of ``device_context``, in the stream's order."""
    world_size = len(device_context) - 2 - len(TRAILER)
    for name in words:
        if name not in TRAILER:
            raise ValueError(f"the device context's trailer has no word {name!r}; it has {', '.join(TRAILER)}")
    indices = [trailer_index(name, world_size) for name in words]
    device_context[indices] = torch.tensor(list(words.values()), dtype=torch.int64, device=device_context.device)
