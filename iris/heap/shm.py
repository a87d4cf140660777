"""``shm`` heap provider: one anonymous shared-memory file per CPU rank, mapped by every peer.

Each rank's heap is a memfd (``memfd_create``): it has no name in any file system, so whatever
moment a rank dies at, nothing is left behind; the kernel frees the memory when the last
descriptor and mapping of it go. It is made 0600 and sealed against shrinking and growing, so a
peer that maps it can never fault on pages cut from under it.

Descriptors travel to the peers as :mod:`iris.heap.descriptors` hands them over; every rank
checks each one it receives (a sealed memfd of this user, unnamed, of exactly the heap size)
before mapping it.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import stat

from typing import Callable

import torch

from iris.context.bootstrap import Communicator
from iris.errors import IrisError, format_bytes
from iris.heap.descriptors import exchange
from iris.heap.mapping import HeapMapping, HeapProvider, Shareable, span_bytes

__all__ = ["SHM_DIR", "provider"]

SHM_DIR = "/dev/shm"
#: What ``/proc/<pid>/maps`` shows for a heap: ``/memfd:iris-heap (deleted)``.
SEGMENT_NAME = "iris-heap"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


# -- room for the heaps ------------------------------------------------------------------------------


def _cgroup_headroom() -> int | None:
    """Bytes this process's cgroup (v2) may still use, or None without a limit."""
    try:
        with open("/proc/self/cgroup") as lines:
            path = next(line.split(":", 2)[2].strip() for line in lines if line.startswith("0::"))
        folder = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as limit, open(os.path.join(folder, "memory.current")) as used:
            text = limit.read().strip()
            return None if text == "max" else int(text) - int(used.read())
    except (OSError, StopIteration, ValueError):
        return None


def _available_memory() -> tuple[int, str]:
    """Bytes of memory that heap pages can still take, and where that limit comes from."""
    with open("/proc/meminfo") as lines:
        available = next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:"))
    headroom = _cgroup_headroom()
    if headroom is not None and headroom < available:
        return headroom, "under the container's memory limit"
    return available, "MemAvailable"


def _check_space(size: int, local_ranks: int) -> None:
    available, source = _available_memory()
    needed = size * local_ranks
    if needed > available:
        raise IrisError(
            f"the symmetric heap does not fit in memory: {local_ranks} rank(s) x heap_size {format_bytes(size)} "
            f"need {format_bytes(needed)} of shared memory, but only {format_bytes(available)} is free ({source}); "
            f"pass a smaller heap_size=... (or IRIS_HEAP_SIZE), or raise the container's memory limit "
            f"(docker run --memory=...). CPU heaps are anonymous shared memory counted against RAM, not against "
            f"{SHM_DIR}: docker's --shm-size does not matter"
        )


# -- this rank's segment -----------------------------------------------------------------------------


def _new_segment(size: int) -> int:
    """A descriptor of a new memfd of ``size`` bytes, 0600, sealed at that size."""
    fd = os.memfd_create(SEGMENT_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_segment(fd: int, size: int, peer: int) -> None:
    """IrisError unless ``fd`` is what a peer's ``_new_segment(size)`` made: a sealed, unnamed
    memfd of this user, private to it, of exactly ``size`` bytes."""
    info = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = None
    problems = [
        (not stat.S_ISREG(info.st_mode), f"is not a regular file (mode {oct(info.st_mode)})"),
        (seals is None, "is not a memfd"),
        (seals is not None and seals & _SEALS != _SEALS, f"is not sealed against resizing (seals {seals})"),
        (info.st_nlink != 0, f"has {info.st_nlink} name(s) in a file system"),
        (info.st_uid != os.geteuid(), f"belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}"),
        (info.st_mode & 0o077 != 0, f"is accessible to other users (mode {oct(info.st_mode & 0o777)})"),
        (info.st_size != size, (f"has {info.st_size} bytes where this rank's heap_size is {size}: all ranks "
                                f"must pass the same heap_size")),
    ]
    found = [what for bad, what in problems if bad]
    if found:
        raise IrisError(f"the heap descriptor received from rank {peer} {'; it '.join(found)}. Refusing to map it: "
                        f"every rank must be an iris rank of the same job, run by the same user")


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


# -- memory mapped in place (as_symmetric) -----------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_MAP_FIXED = 0x10  # Linux


def _map_over(address: int, length: int, fd: int, file_offset: int) -> None:
    """Map ``length`` bytes of ``fd`` from ``file_offset`` at exactly ``address``, in place of
    whatever was mapped there."""
    placed = _libc.mmap(address, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd,
                        file_offset)
    if placed != address:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap at {address:#x} of {length} bytes: {os.strerror(errno)}")


def _check_shared_file(fd: int, needed: int, peer: int) -> None:
    """IrisError unless ``fd``, received from ``peer``, is a file of this user, private to it,
    with at least ``needed`` bytes."""
    info = os.fstat(fd)
    problems = [
        (not stat.S_ISREG(info.st_mode), f"is not a regular file (mode {oct(info.st_mode)})"),
        (info.st_uid != os.geteuid(), f"belongs to uid {info.st_uid}, not to this process's uid {os.geteuid()}"),
        (info.st_mode & 0o077 != 0, f"is accessible to other users (mode {oct(info.st_mode & 0o777)})"),
        (info.st_size < needed, f"has {info.st_size} bytes where {needed} are mapped"),
    ]
    found = [what for bad, what in problems if bad]
    if found:
        raise IrisError(f"as_symmetric: the memory received from rank {peer} {'; it '.join(found)}. Refusing to "
                        f"map it: every rank must be an iris rank of the same job, run by the same user")


class _SharedFileImporter:
    """Maps a CPU tensor's storage, moved to shared memory as ``Tensor.share_memory_()`` moves
    it, over a block of every rank's heap; the heaps' own files map back when it is released."""

    granule = mmap.PAGESIZE

    def __init__(self, heap_fds: list[int], mapping_bases: tuple[int, ...]):
        self._heap_fds = heap_fds
        self._bases = mapping_bases

    def __del__(self):
        for fd in self._heap_fds:
            os.close(fd)

    def shareable(self, tensor: torch.Tensor) -> Shareable | str:
        if tensor.device.type != "cpu":
            return f"it is on {tensor.device}, and this heap is in CPU memory"
        storage = tensor.untyped_storage()
        if storage.is_shared():
            try:
                storage._share_fd_cpu_()  # its shared-memory file, by descriptor: nothing moves
            except RuntimeError as error:
                return f"its storage is in shared memory that torch does not share by descriptor ({error})"
        # The storage starts its file (where attach moves it, if it is not in one yet).
        start = tensor.storage_offset() * tensor.element_size()
        span = span_bytes(tensor)
        first = start - start % self.granule
        end_of_file = -(-storage.nbytes() // self.granule) * self.granule
        stop = min(-(-(start + span) // self.granule) * self.granule, end_of_file)
        return Shareable(lead=start - first, length=stop - first, source=(first, storage))

    def attach(self, mine: Shareable, offset: int, comm: Communicator) -> Callable[[], None]:
        first, storage = mine.source
        # Moves the storage to a shared-memory file unless it is in one (only now that every rank
        # maps in place): every tensor over the storage, the caller's too, then views that file,
        # with its values unchanged.
        fd, _ = storage._share_fd_cpu_()
        places = comm.all_gather_object((first, mine.length))
        fds = exchange([fd], [1] * comm.world_size, comm, "as_symmetric")
        mapped = []
        try:
            for rank, ((file_offset, length), (received,)) in enumerate(zip(places, fds)):
                if rank != comm.rank:
                    _check_shared_file(received, file_offset + length - self.granule + 1, rank)
                _map_over(self._bases[rank] + offset, length, received, file_offset)
                mapped.append((rank, length))
        except BaseException:
            self._restore(mapped, offset)
            raise
        finally:
            for rank, (received,) in enumerate(fds):
                if rank != comm.rank:
                    os.close(received)
        return lambda: self._restore(mapped, offset)

    def _restore(self, mapped: list[tuple[int, int]], offset: int) -> None:
        for rank, length in mapped:
            _map_over(self._bases[rank] + offset, length, self._heap_fds[rank], offset)


def create(size: int, comm: Communicator, device: torch.device) -> HeapMapping:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))
    _check_space(size, local_ranks)
    own = _new_segment(size)
    fds = [own]
    try:
        fds = [received for (received,) in exchange([own], [1] * comm.world_size, comm, "heap set-up")]
        for peer, fd in enumerate(fds):
            if peer != comm.rank:
                _check_segment(fd, size, peer)
        maps = [_map(fd, size) for fd in fds]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    # Each tensor keeps its mmap alive; the memory is unmapped when the last tensor viewing it
    # is collected, so it never disappears under a live tensor. The descriptors stay open for
    # the importer, which maps the heaps back where memory was mapped over them in place.
    peers = tuple(torch.frombuffer(m, dtype=torch.uint8) for m in maps)
    return HeapMapping(size=size, peers=peers,
                       importer=_SharedFileImporter(fds, tuple(p.data_ptr() for p in peers)))


provider = HeapProvider(name="shm", device_type="cpu", create=create)
