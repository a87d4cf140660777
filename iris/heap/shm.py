"""``shm`` heap provider: one POSIX shared-memory segment per CPU rank, mapped by every peer.

Each segment is created with mode 0600 under an unpredictable name, mapped by every rank, and
unlinked as soon as all ranks have mapped it: from then on no name refers to it, no other
process can attach to it, and the kernel frees it when the last mapping goes, even if ranks are
killed.
"""

from __future__ import annotations

import mmap
import os
import secrets

import torch

from iris.bootstrap import Communicator
from iris.errors import IrisError, format_bytes
from iris.heap.mapping import HeapMapping, HeapProvider

__all__ = ["provider", "SHM_DIR"]

SHM_DIR = "/dev/shm"
_PREFIX = "iris-"


def _check_space(size: int, local_ranks: int) -> None:
    stats = os.statvfs(SHM_DIR)
    available = stats.f_bavail * stats.f_frsize
    needed = size * local_ranks
    if needed > available:
        raise IrisError(
            f"{SHM_DIR} is too small for the symmetric heap: {local_ranks} rank(s) x "
            f"heap_size {format_bytes(size)} need {format_bytes(needed)}, but only "
            f"{format_bytes(available)} is free; pass a smaller heap_size=... (or IRIS_HEAP_SIZE), "
            f"or enlarge {SHM_DIR} (e.g. docker run --shm-size=...)"
        )


def _map(path: str, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise IrisError(
                f"shared-memory segment {path} has {os.fstat(fd).st_size} bytes, expected {size}: "
                f"all ranks must pass the same heap_size"
            )
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def create(size: int, comm: Communicator, device: torch.device) -> HeapMapping:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))
    _check_space(size, local_ranks)
    path = os.path.join(SHM_DIR, _PREFIX + secrets.token_hex(16))
    maps: list[mmap.mmap] = []
    try:
        own = _map(path, size, create=True)
        paths = comm.all_gather_object(path)
        for rank, peer_path in enumerate(paths):
            maps.append(own if rank == comm.rank else _map(peer_path, size, create=False))
        comm.barrier()  # every rank has mapped every segment
    finally:
        if os.path.exists(path):
            os.unlink(path)
    # Each tensor keeps its mmap alive; the segment is unmapped when the last tensor viewing
    # it is collected, so memory never disappears under a live tensor.
    return HeapMapping(size=size, peers=tuple(torch.frombuffer(m, dtype=torch.uint8) for m in maps))


provider = HeapProvider(name="shm", device_type="cpu", create=create)
