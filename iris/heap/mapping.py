"""What a heap provider is and what it hands back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs
import torch

if TYPE_CHECKING:
    from iris.context.bootstrap import Communicator

__all__ = ["HeapMapping", "HeapProvider"]


@attrs.frozen(kw_only=True)
class HeapMapping:
    """Every rank's heap, as mapped into this process."""

    size: int
    """Bytes per rank."""
    peers: tuple[torch.Tensor, ...]
    """One flat ``uint8`` tensor per rank over that rank's heap, in rank order; this rank's
    entry is its own heap. Host code can read and write peers' heaps through them. The memory
    lives as long as any tensor viewing it: dropping the mapping never invalidates a tensor. A
    rank on another node has an empty tensor (base 0): its heap is not mapped here."""

    @property
    def bases(self) -> tuple[int, ...]:
        """Address of each rank's heap in this process: what pointer translation adds."""
        return tuple(p.data_ptr() for p in self.peers)


@attrs.frozen(kw_only=True)
class HeapProvider:
    """A way to make a heap per rank and map it into every peer."""

    name: str
    """The name ``create(heap_provider=...)`` selects it by."""
    device_type: str
    """The device type whose memory it provides (``"cpu"``, ``"cuda"``)."""
    create: Callable[[int, "Communicator", torch.device], HeapMapping]
    """``create(size, comm, device)``: a collective call made by every rank."""
