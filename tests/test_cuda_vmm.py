"""The ``cuda-vmm`` heap's bookkeeping, on a machine without a GPU: its driver calls go to a model
of CUDA's virtual-memory rules (what may be mapped where, reference counts of allocations, what
must be unmapped before a range is freed), which refuses every call CUDA would refuse. The heap's
views, a tensor's chunks mapped over a block of pieces and mapped back, and every handle and
range released in the end: the order of calls the GPU will see, checked before it sees them.
The GPU runs of ``tests/test_as_symmetric.py`` check the memory itself.
"""

from __future__ import annotations

import enum
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from iris.errors import IrisError
from iris.heap import cuda_ipc, cuda_vmm
from iris.heap.mapping import Shareable

MiB = 1 << 20
GRANULE = 2 * MiB
POSIX_FD = 1


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class FakeDriver:
    """CUDA's virtual-memory calls, as a model: every refusal CUDA documents is an AssertionError."""

    CUresult = CUresult
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=POSIX_FD)
    CUpointer_attribute = SimpleNamespace(CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES="allowed")
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="device")
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="rw")

    def __init__(self):
        self.allocations: dict[int, dict] = {}  # id -> size, handle types, references (handles and mappings)
        self.handles: dict[int, int] = {}  # handle value -> allocation
        self.reserved: dict[int, int] = {}  # base -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (size, allocation)
        self.mapped_by: dict[int, int] = {}  # address -> the handle value that mapped it
        self.exported: dict[int, int] = {}  # inode of an exported descriptor -> allocation
        self._next = 1
        self._next_address = 1 << 40

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(location=SimpleNamespace(type=None, id=None), flags=None)

    def cuGetErrorString(self, err):
        return CUresult.CUDA_SUCCESS, err.name.encode()

    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def _handle(self, allocation: int) -> int:
        handle = self._new_id()
        self.handles[handle] = allocation
        self.allocations[allocation]["refs"] += 1
        return handle

    def create(self, size: int, types: int = POSIX_FD) -> int:
        """What ``cuMemCreate`` makes: an allocation and a handle to it."""
        allocation = self._new_id()
        self.allocations[allocation] = {"size": size, "types": types, "refs": 0}
        return self._handle(allocation)

    def cuMemRelease(self, handle):
        allocation = self.allocations[self.handles[handle]]
        assert allocation["refs"] > 0, f"release of a handle not held: {handle}"
        allocation["refs"] -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuMemRetainAllocationHandle(self, address):
        """The handle value the allocation at ``address`` was mapped with, one more reference held."""
        found = self._mapping_at(address)
        if found is None:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        self.allocations[found[2]]["refs"] += 1
        return CUresult.CUDA_SUCCESS, self.mapped_by[found[0]]

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        allocation = self.handles[handle]
        assert kind == POSIX_FD and self.allocations[allocation]["types"] & POSIX_FD, "not exportable so"
        fd = os.memfd_create("fake-cuda-export")
        self.exported[os.fstat(fd).st_ino] = allocation
        return CUresult.CUDA_SUCCESS, fd

    def cuMemImportFromShareableHandle(self, fd, kind):
        return CUresult.CUDA_SUCCESS, self._handle(self.exported[os.fstat(fd).st_ino])

    def cuMemAddressReserve(self, size, alignment, address, flags):
        assert size % GRANULE == 0 and alignment % GRANULE == 0
        base = self._next_address
        self._next_address += size + 64 * GRANULE
        self.reserved[base] = size
        return CUresult.CUDA_SUCCESS, base

    def cuMemAddressFree(self, base, size):
        assert self.reserved.pop(base) == size, "free of a range not reserved so"
        assert not any(base <= a < base + size for a in self.mapped), "range freed with memory mapped in it"
        return (CUresult.CUDA_SUCCESS,)

    def cuMemMap(self, address, size, offset, handle, flags):
        allocation = self.handles[handle]
        assert offset == 0 and address % GRANULE == 0 and size % GRANULE == 0
        assert size <= self.allocations[allocation]["size"], "mapping past the allocation's end"
        assert any(b <= address and address + size <= b + s for b, s in self.reserved.items()), "not reserved"
        assert not any(a < address + size and address < a + s for a, (s, _) in self.mapped.items()), "overlap"
        self.mapped[address] = (size, allocation)
        self.mapped_by[address] = handle
        self.allocations[allocation]["refs"] += 1
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, address, size):
        assert self.mapped.get(address, (None,))[0] == size, "unmap of other than one whole mapping"
        self.allocations[self.mapped.pop(address)[1]]["refs"] -= 1
        del self.mapped_by[address]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, address, size, descriptions, count):
        covered = sum(s for a, (s, _) in self.mapped.items() if address <= a < address + size)
        assert covered == size, "access set on memory not mapped"
        return (CUresult.CUDA_SUCCESS,)

    def _mapping_at(self, address):
        return next(((a, s, allocation) for a, (s, allocation) in self.mapped.items() if a <= address < a + s), None)

    def cuPointerGetAttribute(self, attribute, address):
        found = self._mapping_at(address)
        if found is None:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return CUresult.CUDA_SUCCESS, self.allocations[found[2]]["types"]

    def live(self) -> dict[int, int]:
        """References each allocation still has (none left: nothing leaked)."""
        return {a: info["refs"] for a, info in self.allocations.items() if info["refs"]}


class OneRank:
    """The communicator of a world of one."""

    rank, world_size, timeout = 0, 1, 10.0

    def all_gather_object(self, obj):
        return [obj]


@pytest.fixture
def driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(cuda_vmm, "_driver", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    return fake


def _torch_segment(driver: FakeDriver, chunks: list[int], types: int = POSIX_FD) -> tuple[int, list[int]]:
    """What torch's expandable segment is: chunks of their own allocations, mapped one after
    another in a range of their own; its address and the chunks' handles (torch's references)."""
    base = driver.cuMemAddressReserve(sum(chunks), GRANULE, 0, 0)[1]
    handles, at = [], base
    for size in chunks:
        handles.append(driver.create(size, types))
        driver.cuMemMap(at, size, 0, handles[-1], 0)
        at += size
    return base, handles


@pytest.mark.parametrize("size, pieces", [(1 * MiB, (GRANULE, 1)), (64 * MiB, (GRANULE, 32)), (1 << 30, (16 * MiB, 64)),
                                          (100 * MiB + 1, (GRANULE, 51)), (300 * MiB, (6 * MiB, 50))])
def test_a_heap_is_at_most_64_pieces_of_whole_granules(size, pieces):
    piece, count = cuda_vmm._pieces(size, GRANULE)
    assert (piece, count) == pieces and piece * count >= size and count <= cuda_vmm.MAX_PIECES


def test_chunks_are_found_per_allocation_or_refused_with_the_reason(driver):
    base, _ = _torch_segment(driver, [2 * MiB, 20 * MiB])
    assert cuda_vmm._chunks(base + MiB, 3 * MiB, GRANULE) == [(base, 2 * MiB), (base + 2 * MiB, 20 * MiB)]
    assert cuda_vmm._chunks(base + 13 * MiB, 10, GRANULE) == [(base + 2 * MiB, 20 * MiB)]
    assert cuda_vmm._chunks(12345, 8, GRANULE) == cuda_vmm._NOT_VIRTUAL
    unshared, _ = _torch_segment(driver, [2 * MiB], types=0)
    assert "without a POSIX descriptor" in cuda_vmm._chunks(unshared, 8, GRANULE)
    assert driver.live() == {a: 2 for a in driver.live()}, "torch's references only: the probes released theirs"


@pytest.mark.parametrize("chunks, lead", [([2 * MiB], 4096), ([2 * MiB, 2 * MiB], 2 * MiB - 64), ([20 * MiB], 0)])
def test_a_tensor_is_mapped_over_whole_pieces_and_the_pieces_mapped_back(driver, chunks, lead):
    device = torch.device("cuda", 0)
    piece, count = cuda_vmm._pieces(64 * MiB, GRANULE)
    own = [driver.create(piece) for _ in range(count)]
    ranges, pieces = cuda_vmm._views(own, piece, OneRank(), device)
    view = ranges[0]
    importer = cuda_vmm._VirtualMemoryImporter(ranges, pieces, piece, GRANULE)
    segment, torch_handles = _torch_segment(driver, chunks)
    mine = Shareable(lead=lead, length=sum(chunks), source=cuda_vmm._chunks(segment + lead, 128, GRANULE))
    offset = 6 * piece
    restore = importer.attach(mine, offset, OneRank())
    covered = range(offset // piece, (offset + sum(chunks)) // piece)
    at = offset
    for size, handle in zip(chunks, torch_handles):
        # Each chunk is mapped where the block starts, one after another, as the same allocation.
        assert driver.mapped[view.pointer + at] == (size, driver.handles[handle])
        at += size
    assert all(view.pointer + k * piece not in driver.mapped for k in covered if k * piece >= at)
    assert all(driver.mapped[view.pointer + k * piece][0] == piece for k in range(count) if k not in covered)
    restore()
    assert all(driver.mapped[view.pointer + k * piece] == (piece, driver.handles[own[k]]) for k in range(count))
    # The chunks keep torch's references only: one handle and one mapping each.
    assert all(driver.allocations[driver.handles[h]]["refs"] == 2 for h in torch_handles)
    del restore, importer, ranges, view, pieces  # the heap gone: its ranges unmap, release and free what they hold
    assert list(driver.reserved) == [segment]
    for handle, address in zip(torch_handles, [segment + sum(chunks[:i]) for i in range(len(chunks))]):
        driver.cuMemUnmap(address, driver.mapped[address][0])  # torch frees its segment
        driver.cuMemRelease(handle)
    assert driver.live() == {}, "every allocation released"


@pytest.mark.parametrize("provider, bindings, get", [("cuda-vmm", "driver", cuda_vmm._driver),
                                                     ("cuda-ipc", "runtime", cuda_ipc._runtime)])
def test_without_cuda_bindings_the_gpu_heaps_say_how_to_install_it(monkeypatch, provider, bindings, get):
    monkeypatch.setitem(sys.modules, f"cuda.bindings.{bindings}", None)  # importing it raises ImportError
    with pytest.raises(IrisError, match=rf"the {provider} heap needs the cuda-bindings package: pip install"):
        get()


def test_a_failed_driver_call_names_the_call_and_the_error(driver):
    expected = r"cuMemMap of a piece failed: CUDA_ERROR_INVALID_VALUE \(CUDA_ERROR_INVALID_VALUE\)"
    with pytest.raises(IrisError, match=expected):
        cuda_vmm._check((CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap of a piece")
