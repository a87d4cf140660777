"""One context's symmetric heap: a provider's mapping plus the allocator over it."""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Callable

import attrs
import torch

from iris.compat.heap import UpstreamHeapMethods
from iris.context.bootstrap import Communicator
from iris.errors import AsymmetricHeapError, IrisError, NotOnHeapError, format_bytes
from iris.heap.allocator import HeapAllocator
from iris.heap.mapping import HeapMapping, Shareable, element_address, span_bytes

if TYPE_CHECKING:
    from iris.collectives.hierarchical import NodeLayout

__all__ = ["MAP_GRANULE", "MAP_HEADER", "HeapCall", "MappedInPlace", "SymmetricHeap"]

#: Bytes of heap per byte of the debug allocation map (one byte per granule, 1 = allocated).
#: The Triton backend's write checks read the map with the same granule.
MAP_GRANULE = 256
#: Bytes before the debug allocation map at the start of the heap: the heap size (int64) and
#: padding, so that device code checking a pointer finds the size beside the map it reads.
MAP_HEADER = 256

_FIX = "allocate and free the same sizes in the same order on every rank"


@attrs.frozen
class HeapCall:
    """One allocation or free: compared across ranks per call in debug mode, kept in the
    history that the symmetry check at each barrier names the first difference from. ``offset``
    is None until the allocator placed the block."""

    index: int
    op: str
    nbytes: int
    detail: str
    offset: int | None = None

    @property
    def key(self) -> tuple:
        """What the digest covers: the layout, not the shape and dtype detail."""
        return self.op, self.offset, self.nbytes

    def __str__(self) -> str:
        where = "" if self.offset is None else f" at offset {self.offset}"
        return f"call #{self.index}: {self.op}({self.nbytes} bytes{where}{', ' + self.detail if self.detail else ''})"


@attrs.frozen
class MappedInPlace:
    """A tensor's memory mapped over a heap block by :meth:`SymmetricHeap.map_in_place`."""

    block: int
    """The block's offset."""
    restore: Callable[[], None]
    """Maps the heap's own memory back over the block in this process."""
    storage: torch.UntypedStorage
    """The tensor's storage, kept so that its memory is never handed to another tensor while mapped."""
    signature: tuple
    """(shape, strides, dtype) of the tensor made over it: what ``ctx.free`` accepts."""


class SymmetricHeap(UpstreamHeapMethods):
    """Allocates and frees blocks at offsets identical on every rank (and upstream iris's heap
    calls, :class:`iris.compat.heap.UpstreamHeapMethods`).

    Allocation and free are collective in the sense that every rank must make the same calls in
    the same order. Each rank keeps a running digest of its calls (op, offset, bytes) and the
    calls since the last check; :meth:`check_symmetric` (run by every host barrier) compares the
    digests with one small collective and raises :class:`AsymmetricHeapError` on every rank when
    they differ. In debug mode each call is also compared across ranks as it is made, and the
    heap starts with the heap size (an int64, :data:`MAP_HEADER` bytes in all) and an allocation
    map (one byte per :data:`MAP_GRANULE` bytes, 1 where a block is allocated, up to the bytes
    asked for) that device code reads to refuse accesses outside the heap and writes into blocks
    the target rank has not allocated.
    """

    def __init__(self, mapping: HeapMapping, comm: Communicator, *, debug: bool = False,
                 allocation_map: bool | None = None, node_layout: NodeLayout | None = None):
        self.mapping = mapping
        self.comm = comm
        #: The nodes of a world that spans several (None: one node), to name a peer's node when
        #: host code asks for a heap that is not mapped here.
        self.node_layout = node_layout
        self.debug = debug
        self.allocator = HeapAllocator(mapping.size, base_address=self.local.data_ptr(),
                                       device=self.local.device)
        #: The context whose heap this is (a weak proxy; set by the context): what upstream iris's
        #: heap calls that need one reach (``as_symmetric``, ``get_heap_bases``, the constructors
        #: of ``iris.tensor_creation``).
        self.owner = None
        self._calls = 0
        #: Running digest of every call so far, chained: equal on two ranks iff their histories are.
        self._digest = bytes(8)
        #: The calls since the last check that found every rank's digest equal.
        self._unchecked: list[HeapCall] = []
        #: (shape, stride, dtype) of the tensor each live block was allocated as, by offset:
        #: ``free`` accepts that tensor only, never a view of it.
        self.allocated_as: dict[int, tuple] = {}
        #: Memory mapped in place by :meth:`map_in_place`, by the offset of the tensor made over it.
        self.imports: dict[int, MappedInPlace] = {}
        #: The allocation map (by default in debug mode): in the heap's first block, offset 0 on every
        #: rank, after the header holding the heap size.
        self.allocation_map: torch.Tensor | None = None
        if debug if allocation_map is None else allocation_map:
            map_bytes = -(-mapping.size // MAP_GRANULE)
            offset = self.allocator.allocate(MAP_HEADER + map_bytes)  # offset 0, where device code looks
            self.view(offset, 8).view(torch.int64).fill_(mapping.size)
            self.allocation_map = self.view(offset + MAP_HEADER, map_bytes).zero_()

    @property
    def size(self) -> int:
        return self.mapping.size

    @property
    def local(self) -> torch.Tensor:
        """This rank's heap as a flat uint8 tensor."""
        return self.mapping.peers[self.comm.rank]

    # -- symmetry -------------------------------------------------------------------------------

    def _begin(self, op: str, nbytes: int, detail: str) -> HeapCall:
        """The next call; in debug mode first compared with every rank's, before it changes anything."""
        call = HeapCall(self._calls, op, nbytes, detail)
        if self.debug:
            calls = self.comm.all_gather_object(call)
            if any(c != call for c in calls):
                listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
                raise AsymmetricHeapError(
                    f"ranks made different heap calls at call #{call.index} ({listing}); every rank "
                    f"must allocate and free the same sizes in the same order"
                )
        return call

    def _log(self, call: HeapCall, offset: int) -> None:
        """Add the call, made at ``offset``, to the history and to the running digest."""
        self._calls += 1
        self._unchecked.append(attrs.evolve(call, offset=offset))
        entry = struct.pack("<cqq", call.op[0].encode(), offset, call.nbytes)
        self._digest = hashlib.blake2b(self._digest + entry, digest_size=8).digest()

    def check_symmetric(self, where: str = "ctx.barrier()") -> None:
        """Raise :class:`AsymmetricHeapError` on every rank unless every rank made the same
        allocations and frees. Collective: one all-reduce of four int64 when the ranks agree;
        the histories since the last check are exchanged only when they do not."""
        digest = int.from_bytes(self._digest, "little", signed=True)
        extremes = self.comm.host_max([self._calls, -self._calls, digest, -digest])
        if extremes[0] == -extremes[1] and extremes[2] == -extremes[3]:  # maximum == minimum
            self._unchecked.clear()
            return
        histories = self.comm.all_gather_object(self._unchecked)
        raise AsymmetricHeapError(_first_difference(histories, where))

    # -- blocks ---------------------------------------------------------------------------------

    def _mark(self, offset: int, nbytes: int, value: int) -> None:
        """Debug mode: set the allocation map over the granules of ``nbytes`` from ``offset``."""
        if self.allocation_map is not None:
            self.allocation_map[offset // MAP_GRANULE : -(-(offset + nbytes) // MAP_GRANULE)] = value

    def allocate_bytes(self, nbytes: int, detail: str = "", alignment: int | None = None) -> int:
        """Offset of a new block of ``nbytes`` (a multiple of ``alignment`` bytes when given);
        identical on every rank."""
        call = self._begin("allocate", nbytes, detail)
        offset = self.allocator.allocate(nbytes, alignment)
        self._log(call, offset)
        self._mark(offset, nbytes, 1)
        return offset

    def allocate_strided(self, shape: tuple, stride: tuple, dtype: torch.dtype, alignment: int | None = None,
                         ) -> torch.Tensor:
        """A new tensor of exactly ``shape``, ``stride`` and ``dtype`` on the heap (not zeroed),
        which ``ctx.free`` takes back. Collective, as every allocation."""
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
        nbytes = span * itemsize
        offset = self.allocate_bytes(nbytes, f"{tuple(shape)} {dtype}", alignment)
        self.allocated_as[offset] = (tuple(shape), tuple(stride), dtype)
        return self.view(offset, nbytes).view(dtype).as_strided(shape, stride)

    def free_offset(self, offset: int, detail: str = "") -> None:
        call = self._begin("free", self.allocator.block_size(offset) or 0, detail)
        self._mark(offset, self.allocator.free(offset), 0)
        self._log(call, offset)
        self.allocated_as.pop(offset, None)

    # -- memory mapped in place -------------------------------------------------------------------

    def map_in_place(self, tensor: torch.Tensor) -> torch.Tensor | str:
        """``tensor``'s own memory mapped over a new block of every rank's heap: a tensor of
        the same shape, strides and dtype over it, which shares writes with ``tensor`` and which
        peers reach as any heap tensor; or, where any rank cannot map its tensor so, why not
        (nothing is allocated then). Collective: every rank passes its tensor."""
        importer = self.mapping.importer
        if importer is None:
            found: Shareable | str = ("this heap's provider cannot map other memory into it (on GPUs, create("
                                      "heap_provider='cuda-vmm') can; upstream's spelling: allocator_type='vmem')")
        elif self.node_layout is not None:
            found = "the ranks span several nodes, and memory is mapped in place only within one"
        elif tensor.numel() == 0:
            found = "it has no elements"
        else:
            found = importer.shareable(tensor)
        verdicts = self.comm.all_gather_object(found if isinstance(found, str) else (found.lead, found.length))
        refusals = [f"rank {rank}: {verdict}" for rank, verdict in enumerate(verdicts) if isinstance(verdict, str)]
        if refusals:
            return "; ".join(refusals)
        if len({lead for lead, _ in verdicts}) > 1:
            return (f"the tensor lies at different offsets within its memory's {format_bytes(importer.granule)} "
                    f"pages on the ranks ({', '.join(str(lead) for lead, _ in verdicts)} bytes), so it cannot "
                    f"have the same heap offset on every rank")
        granule = importer.granule
        nbytes = -(-max(length for _, length in verdicts) // granule) * granule
        detail = f"as_symmetric {tuple(tensor.shape)} {tensor.dtype}"
        offset = self.allocate_bytes(nbytes, detail, alignment=granule)
        try:
            restore = importer.attach(found, offset, self.comm)
        except BaseException:
            self.free_offset(offset, detail)
            raise
        start = offset + found.lead
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        self.imports[start] = MappedInPlace(offset, restore, tensor.untyped_storage(), (shape, stride, tensor.dtype))
        return self.view(start, span_bytes(tensor)).view(tensor.dtype).as_strided(shape, stride)

    def unmap_in_place(self, offset: int) -> None:
        """Map the heap's own memory back over what :meth:`map_in_place` mapped for the tensor
        at ``offset``, and free its block. Collective, as every free."""
        mapped = self.imports.pop(offset)
        mapped.restore()
        self.free_offset(mapped.block, "as_symmetric")

    def view(self, offset: int, nbytes: int, rank: int | None = None) -> torch.Tensor:
        """``nbytes`` of the heap of ``rank`` (default: this rank) from ``offset``, as uint8."""
        heap = self.local if rank is None else self._mapped_peer(rank, "SymmetricHeap.view")
        return heap[offset : offset + nbytes]

    def _mapped_peer(self, rank: int, what: str) -> torch.Tensor:
        """``rank``'s heap as mapped here; raises where it is not one: a rank out of range, or a
        rank on another node, whose heap is an empty tensor (slicing it would make an empty view,
        and viewing that as a tensor fails with torch's storage-size error)."""
        peers = self.mapping.peers
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(peers):
            raise IrisError(f"{what}: rank {rank!r} is not a rank of this context (0..{len(peers) - 1})")
        if peers[rank].numel() == self.size:
            return peers[rank]
        layout = self.node_layout
        where = "" if layout is None else (
            f" runs on node {layout.node_of(rank)}, and this rank ({self.comm.rank}) on node "
            f"{layout.node_of(self.comm.rank)}; only the heaps of this node's ranks "
            f"{list(layout.node_ranks(layout.node_of(self.comm.rank)))} are mapped into this process, so rank {rank}")
        raise IrisError(f"{what}: rank {rank}{where} has no heap mapped here; reach another node's data "
                        f"with a world collective (ctx.ccl.all_gather, all_reduce, broadcast, all_to_all), "
                        f"which runs across nodes")

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor``'s first element in this rank's heap, or None if not on it."""
        local = self.local
        if tensor.device != local.device:
            return None
        offset = element_address(tensor) - local.data_ptr()
        return offset if 0 <= offset < self.size else None

    def is_symmetric(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a tensor lying entirely on this rank's heap."""
        return isinstance(tensor, torch.Tensor) and self.contains(tensor)

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether every element of ``tensor`` lies on this rank's heap: from its base up to and
        including a last element that ends exactly at the heap's end."""
        offset = self.offset_of(tensor)
        if offset is None:
            return False
        if tensor.numel() == 0:
            return True
        return offset + span_bytes(tensor) <= self.size

    def peer_view(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """The tensor at the same offset, shape and strides on ``rank``'s heap (host access).
        Raises :class:`NotOnHeapError` for a tensor not on this rank's heap, and
        :class:`IrisError` for a rank whose heap is not mapped here (one on another node)."""
        offset = self.offset_of(tensor)
        if offset is None:
            raise NotOnHeapError(
                f"peer_view: the tensor (shape {tuple(tensor.shape)}, {tensor.dtype}, on {tensor.device}) is not "
                f"on this rank's symmetric heap, so it has no counterpart on rank {rank}'s; allocate it with "
                f"ctx.empty/zeros/... or copy it there with ctx.as_symmetric(t)")
        heap = self._mapped_peer(rank, "peer_view")
        usable = (self.size - offset) // tensor.element_size() * tensor.element_size()
        raw = heap[offset : offset + usable]
        return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())


def _first_difference(histories: list[list[HeapCall]], where: str) -> str:
    """The message naming the first call that differs between ranks, given each rank's calls
    since the last check that found them equal (the same index on every rank)."""
    length = max(len(h) for h in histories)
    for i in range(length):
        calls = [h[i] if i < len(h) else None for h in histories]
        if len({c.key if c else None for c in calls}) > 1:
            break
    first = next(c for c in calls if c is not None)
    listing = "; ".join(f"rank {r}: {c if c else 'no call #' + str(first.index)}" for r, c in enumerate(calls))
    return (f"the ranks' symmetric heaps differ (found at {where}): the first call that differs is {listing}. "
            f"From there on a tensor's offset differs between ranks, so remote accesses land in other "
            f"tensors; {_FIX} (IRIS_DEBUG=1 compares every call as it is made)")
