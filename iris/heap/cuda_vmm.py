"""``cuda-vmm`` heap provider: each rank's heap is CUDA virtual memory, into which other memory can
be mapped in place (``ctx.as_symmetric(t, in_place=True)``).

Each heap is a range of virtual addresses reserved for it, in which up to :data:`MAX_PIECES` equal
pieces of device memory (``cuMemCreate``, each exportable as a POSIX file descriptor) are mapped
one after another. Every rank hands its pieces' descriptors to its peers (:mod:`iris.heap.descriptors`),
which import them and map them the same way in a range of their own, so that a peer's heap is
one contiguous range here too. The pieces let a block of whole pieces be unmapped in every rank's
view and a tensor's own memory be mapped there instead, then the pieces mapped back when it is
freed: CUDA maps an allocation only as a whole, from its start.

Memory that can be mapped so is memory torch's caching allocator takes from expandable segments
(``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, torch 2.5 or later): chunks of 2 or 20 MiB,
each its own allocation with a POSIX descriptor. ``cudaMalloc`` memory (torch's default) cannot.
A range, its mappings and its handles are released when the last tensor viewing it is gone.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from iris.context.bootstrap import Communicator
from iris.errors import IrisError, format_bytes
from iris.heap.cuda_bindings import checked, module
from iris.heap.descriptors import exchange
from iris.heap.mapping import HeapMapping, HeapProvider, Shareable, element_address, span_bytes

__all__ = ["MAX_PIECES", "provider"]

#: Pieces per heap at most: each is a descriptor handed to every peer at set-up.
MAX_PIECES = 64
_NOT_VIRTUAL = ("its memory is not CUDA virtual memory: torch's caching allocator gives such memory only with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the process's first CUDA allocation")


def _driver():
    return module("driver", "cuda-vmm")


def _check(result, what: str):
    driver = _driver()
    return checked(result, what, driver.CUresult.CUDA_SUCCESS, driver.cuGetErrorString)


def _posix_fd():
    return _driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _properties(device: torch.device):
    driver = _driver()
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device.index
    prop.requestedHandleTypes = _posix_fd()
    return prop


class _Range:
    """A reserved range of virtual addresses of ``device`` and what is mapped in it. Exposes
    ``__cuda_array_interface__`` so torch can view it; each tensor keeps it alive, and it unmaps
    its mappings, releases the handles it owns and frees the range when collected."""

    def __init__(self, size: int, alignment: int, device: torch.device):
        self._driver = _driver()  # kept: at interpreter exit the module can no longer be imported
        self.size = size
        self.device = device
        self.pointer = int(_check(self._driver.cuMemAddressReserve(size, alignment, 0, 0), "cuMemAddressReserve"))
        #: Bytes mapped at each offset.
        self.mapped: dict[int, int] = {}
        #: Handles this range releases when collected (those of what it maps).
        self.owned: list = []

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.pointer, False), "version": 3}

    def map(self, offset: int, handle, nbytes: int) -> None:
        """Map ``handle``'s allocation (``nbytes``) at ``offset``, readable and writable by the device."""
        driver = self._driver
        _check(driver.cuMemMap(self.pointer + offset, nbytes, 0, handle, 0), "cuMemMap")
        self.mapped[offset] = nbytes
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device.index
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(driver.cuMemSetAccess(self.pointer + offset, nbytes, [access], 1), "cuMemSetAccess")

    def unmap(self, offset: int) -> None:
        _check(self._driver.cuMemUnmap(self.pointer + offset, self.mapped.pop(offset)), "cuMemUnmap")

    def release(self, handle) -> None:
        self.owned.remove(handle)
        self._driver.cuMemRelease(handle)

    def __del__(self):
        for offset, nbytes in self.mapped.items():
            self._driver.cuMemUnmap(self.pointer + offset, nbytes)
        for handle in self.owned:
            self._driver.cuMemRelease(handle)
        self._driver.cuMemAddressFree(self.pointer, self.size)


def _retain(pointer: int):
    return _check(_driver().cuMemRetainAllocationHandle(pointer), "cuMemRetainAllocationHandle")


def _export(handle) -> int:
    return int(_check(_driver().cuMemExportToShareableHandle(handle, _posix_fd(), 0), "cuMemExportToShareableHandle"))


def _import(fd: int):
    try:
        return _check(_driver().cuMemImportFromShareableHandle(fd, _posix_fd()), "cuMemImportFromShareableHandle")
    finally:
        os.close(fd)


def _exported(handles: list, comm: Communicator, what: str) -> list[list]:
    """Every rank's ``handles``, as handles of this process (this rank's are ``handles`` itself),
    through their POSIX descriptors."""
    fds = [_export(handle) for handle in handles]
    try:
        counts = comm.all_gather_object(len(fds))
        received = exchange(fds, counts, comm, what)
    finally:
        for fd in fds:
            os.close(fd)
    imported = []
    for rank, theirs in enumerate(received):
        if rank == comm.rank:
            imported.append(handles)
        else:
            imported.append([_import(fd) for fd in theirs])
    return imported


def _allocation_at(address: int) -> int | None:
    """The handle value of the allocation mapped at ``address`` (CUDA gives the same value for
    every address of one allocation), or None where no ``cuMemCreate`` memory is mapped."""
    driver = _driver()
    err, handle = driver.cuMemRetainAllocationHandle(address)
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    driver.cuMemRelease(handle)
    return int(handle)


def _chunks(pointer: int, nbytes: int, granularity: int) -> list[tuple[int, int]] | str:
    """(address, bytes) of each allocation mapped over ``[pointer, pointer + nbytes)``, or why
    that memory cannot be mapped into the heap. Allocations are mapped at multiples of
    ``granularity``: each one's extent is found granule by granule, by its handle's value."""
    driver = _driver()
    address = pointer - pointer % granularity
    allocation = _allocation_at(address)
    if allocation is None:
        return _NOT_VIRTUAL
    while address >= granularity and _allocation_at(address - granularity) == allocation:
        address -= granularity
    chunks = []
    while address < pointer + nbytes:
        allocation = _allocation_at(address)
        err, types = driver.cuPointerGetAttribute(
            driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES, address)
        if allocation is None or err != driver.CUresult.CUDA_SUCCESS:
            return _NOT_VIRTUAL
        if not int(types) & int(_posix_fd()):
            return ("torch made its memory without a POSIX descriptor to share it by (torch older than 2.5, or "
                    "TORCH_CUDA_EXPANDABLE_SEGMENTS_IPC=0)")
        end = address + granularity
        while _allocation_at(end) == allocation:
            end += granularity
        chunks.append((address, end - address))
        address = end
    return chunks


class _VirtualMemoryImporter:
    """Maps a tensor's allocations over whole pieces of every rank's heap, and the pieces back."""

    def __init__(self, ranges: list[_Range], pieces: list[list], piece: int, granularity: int):
        self._ranges = ranges
        self._pieces = pieces  # each rank's pieces' handles, kept to map them back
        self._granularity = granularity
        self.granule = piece

    def shareable(self, tensor: torch.Tensor) -> Shareable | str:
        device = self._ranges[0].device
        if tensor.device != device:
            return f"it is on {tensor.device}, and this heap on {device}"
        pointer = element_address(tensor)
        span = span_bytes(tensor)
        chunks = _chunks(pointer, span, self._granularity)
        if isinstance(chunks, str):
            return chunks
        return Shareable(lead=pointer - chunks[0][0], length=sum(size for _, size in chunks), source=chunks)

    def attach(self, mine: Shareable, offset: int, comm: Communicator) -> Callable[[], None]:
        handles = _exported([_retain(address) for address, _ in mine.source], comm, "as_symmetric")
        sizes = comm.all_gather_object([size for _, size in mine.source])
        pieces = range(offset // self.granule, -(-(offset + max(sum(s) for s in sizes)) // self.granule))
        torch.cuda.synchronize(self._ranges[0].device)  # nothing may still use the block's pieces
        for view, theirs, their_sizes in zip(self._ranges, handles, sizes):
            view.owned.extend(theirs)
            for index in pieces:
                view.unmap(index * self.granule)
            at = offset
            for handle, size in zip(theirs, their_sizes):
                view.map(at, handle, size)
                at += size
        return lambda: self._restore(offset, pieces, handles, sizes)

    def _restore(self, offset: int, pieces: range, handles: list[list], sizes: list[list[int]]) -> None:
        torch.cuda.synchronize(self._ranges[0].device)  # nothing may still use the tensor mapped there
        for view, own_pieces, theirs, their_sizes in zip(self._ranges, self._pieces, handles, sizes):
            at = offset
            for handle, size in zip(theirs, their_sizes):
                view.unmap(at)
                view.release(handle)
                at += size
            for index in pieces:
                view.map(index * self.granule, own_pieces[index], self.granule)


def _pieces(size: int, granularity: int) -> tuple[int, int]:
    """Bytes per piece (a multiple of ``granularity``) and pieces of a heap of ``size`` bytes:
    at most :data:`MAX_PIECES`, each as small as that allows."""
    piece = -(-max(-(-size // MAX_PIECES), 1) // granularity) * granularity
    return piece, -(-size // piece)


def _views(own: list, piece: int, comm: Communicator, device: torch.device) -> tuple[list[_Range], list[list]]:
    """Every rank's heap mapped here, its pieces one after another in a range of its own, and
    each rank's pieces' handles here (``own``: this rank's). Collective."""
    pieces = _exported(own, comm, "heap set-up")
    ranges = []
    for handles in pieces:
        view = _Range(len(handles) * piece, piece, device)
        view.owned.extend(handles)
        for index, handle in enumerate(handles):
            view.map(index * piece, handle, piece)
        ranges.append(view)
    return ranges, pieces


def create(size: int, comm: Communicator, device: torch.device) -> HeapMapping:
    driver = _driver()
    torch.cuda.set_device(device)
    torch.cuda.synchronize(device)  # the device's primary context made and current: what the driver calls use
    free, total = torch.cuda.mem_get_info(device)
    if size > free:
        raise IrisError(
            f"GPU {device} has {format_bytes(free)} free of {format_bytes(total)}, too little for "
            f"a heap of {format_bytes(size)}; pass a smaller heap_size=... (or IRIS_HEAP_SIZE)"
        )
    granularity = int(_check(driver.cuMemGetAllocationGranularity(
        _properties(device), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity"))
    piece, count = _pieces(size, granularity)
    sizes = comm.all_gather_object(size)
    if len(set(sizes)) > 1:
        raise IrisError(f"heap set-up: the ranks asked for heaps of {', '.join(map(format_bytes, sizes))}; all ranks "
                        f"must pass the same heap_size")
    own = []
    try:
        for _ in range(count):
            own.append(_check(driver.cuMemCreate(piece, _properties(device), 0), f"cuMemCreate({piece})"))
    except BaseException:
        for handle in own:
            driver.cuMemRelease(handle)
        raise
    ranges, pieces = _views(own, piece, comm, device)
    own_range = ranges[comm.rank]
    # Zeroed like a fresh shared-memory segment, so every provider starts from the same state.
    _check(driver.cuMemsetD8(own_range.pointer, 0, own_range.size), "cuMemsetD8")
    torch.cuda.synchronize(device)
    comm.barrier()
    peers = tuple(torch.as_tensor(view, device=device)[:size] for view in ranges)
    return HeapMapping(size=size, peers=peers, importer=_VirtualMemoryImporter(ranges, pieces, piece, granularity))


provider = HeapProvider(name="cuda-vmm", device_type="cuda", create=create)
