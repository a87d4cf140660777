"""What a heap provider is and what it hands back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import attrs
import torch

if TYPE_CHECKING:
    from iris.context.bootstrap import Communicator

__all__ = ["HeapMapping", "HeapProvider", "MemoryImporter", "Shareable", "element_address", "span_bytes"]


def element_address(tensor: torch.Tensor) -> int:
    """The address of ``tensor``'s first element. Not ``tensor.data_ptr()``, which torch reports as
    0 for a tensor with no elements (a zero-size heap tensor would then lie off the heap, and could
    not be freed): the storage's address plus the storage offset holds for every tensor."""
    return tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()


def span_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a non-empty tensor's first element to the end of its last, by its strides."""
    return (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))) * tensor.element_size()


@attrs.frozen(kw_only=True)
class Shareable:
    """The memory under a tensor, as a provider can map it into the heap: ``length`` bytes
    from a place ``lead`` bytes before the tensor's first byte."""

    lead: int
    length: int
    source: Any
    """What the provider exports to the peers and maps (descriptors, allocation handles)."""


class MemoryImporter(Protocol):
    """A provider's way to map memory that is not the heap's into the heap of every rank, at
    the same offset in each (``ctx.as_symmetric`` in place)."""

    granule: int
    """Bytes that offsets and lengths of mapped memory are multiples of."""

    def shareable(self, tensor: torch.Tensor) -> Shareable | str:
        """The memory under ``tensor``, or why it cannot be mapped. Local to this rank."""

    def attach(self, mine: Shareable, offset: int, comm: "Communicator") -> Callable[[], None]:
        """Map every rank's ``Shareable`` over its heap from ``offset`` (a free block of whole
        granules, as long as the longest) in this process, and return what maps the heap's own
        memory back. Collective over ``comm``, the communicator the heap was made over."""


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
    importer: MemoryImporter | None = None
    """How other memory is mapped into these heaps in place, where the provider can."""

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
