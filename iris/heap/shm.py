"""``shm`` heap provider: one anonymous shared-memory file per CPU rank, mapped by every peer.

Each rank's heap is a memfd (``memfd_create``): it has no name in any file system, so whatever
moment a rank dies at, nothing is left behind; the kernel frees the memory when the last
descriptor and mapping of it go. It is made 0600 and sealed against shrinking and growing, so a
peer that maps it can never fault on pages cut from under it.

Descriptors travel to the peers over Unix-domain sockets in the abstract namespace (no file
either) with ``SCM_RIGHTS``. Each rank listens under a random name and publishes the name and a
random token through the process group; it hands its descriptor only to connections of this
user that present the token, and checks every descriptor it receives (a sealed memfd of this
user, unnamed, of exactly the heap size) before mapping it.
"""

from __future__ import annotations

import fcntl
import hmac
import mmap
import os
import secrets
import socket
import stat
import struct
import time

import torch

from iris.context.bootstrap import Communicator
from iris.errors import IrisError, IrisTimeoutError, format_bytes
from iris.heap.mapping import HeapMapping, HeapProvider

__all__ = ["SHM_DIR", "provider"]

SHM_DIR = "/dev/shm"
#: What ``/proc/<pid>/maps`` shows for a heap: ``/memfd:iris-heap (deleted)``.
SEGMENT_NAME = "iris-heap"
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_TOKEN_BYTES = 16


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


# -- handing descriptors to peers --------------------------------------------------------------------


def _listen(backlog: int) -> socket.socket:
    """A socket listening in the abstract namespace under a random name (nothing on disk)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    server.bind(b"\0iris-heap-" + secrets.token_hex(16).encode())
    server.listen(max(backlog, socket.SOMAXCONN))  # room for strangers' connections beside the peers'
    return server


def _peer_uid(conn: socket.socket) -> int:
    """The effective uid of the process at the other end of a Unix-domain connection."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _serve(server: socket.socket, fd: int, token: bytes, peers: int, deadline: float, rank: int) -> None:
    """Send ``fd`` to ``peers`` connections that come from this user and present ``token``;
    other connections are closed unanswered."""
    served = 0
    while served < peers:
        server.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            raise IrisTimeoutError(
                f"heap set-up on rank {rank}: {peers - served} of {peers} peer(s) did not fetch this rank's heap "
                f"in time. Check that every rank is alive and calls iris.create(), or raise the timeout with "
                f"create(timeout=...) / IRIS_TIMEOUT") from None
        with conn:
            if _peer_uid(conn) != os.geteuid():
                continue
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                presented = conn.recv(_TOKEN_BYTES, socket.MSG_WAITALL)
            except OSError:
                continue
            if not hmac.compare_digest(presented, token):
                continue
            try:
                socket.send_fds(conn, [b"h"], [fd], socket.MSG_NOSIGNAL)
            except OSError as error:
                raise IrisError(f"heap set-up on rank {rank}: a peer closed its connection before it received this "
                                f"rank's heap ({error}); did a rank exit?") from error
            served += 1


def _connect(address: bytes, token: bytes, deadline: float, peer: int) -> socket.socket:
    """A connection to ``peer``'s listener that has presented ``peer``'s token."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        conn.connect(address)
        conn.sendall(token)
    except OSError as error:
        conn.close()
        raise IrisError(f"heap set-up: could not reach rank {peer}'s heap listener ({error}); check that rank "
                        f"{peer} is alive and runs on this machine") from error
    return conn


def _receive(conn: socket.socket, deadline: float, peer: int, rank: int) -> int:
    """The one descriptor ``peer`` sends over ``conn``."""
    conn.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        _, fds, flags, _ = socket.recv_fds(conn, 1, 1, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError:
        raise IrisTimeoutError(
            f"heap set-up on rank {rank}: rank {peer} did not send its heap in time. Check that every rank is "
            f"alive and calls iris.create(), or raise the timeout with create(timeout=...) / IRIS_TIMEOUT") from None
    finally:
        conn.close()
    if len(fds) != 1 or flags & socket.MSG_CTRUNC:
        for extra in fds:
            os.close(extra)
        raise IrisError(f"heap set-up on rank {rank}: rank {peer} sent {len(fds)} descriptor(s) where one heap "
                        f"was expected (did it exit?)")
    return fds[0]


def _exchange(fd: int, comm: Communicator) -> list[int]:
    """Every rank's heap descriptor, in rank order; this rank's entry is ``fd`` itself, the
    others are new descriptors the caller closes."""
    deadline = time.monotonic() + comm.timeout
    received: list[int] = []
    with _listen(comm.world_size) as server:
        token = secrets.token_bytes(_TOKEN_BYTES)
        listeners = comm.all_gather_object((server.getsockname(), token))
        peers = [r for r in range(comm.world_size) if r != comm.rank]
        conns = {}
        try:
            for peer in peers:  # each connection waits in the peer's backlog: no peer blocks another
                conns[peer] = _connect(*listeners[peer], deadline, peer)
            _serve(server, fd, token, len(peers), deadline, comm.rank)
            for peer in peers:
                received.append(_receive(conns.pop(peer), deadline, peer, comm.rank))
        except BaseException:
            for conn in conns.values():
                conn.close()
            for other in received:
                os.close(other)
            raise
    received.insert(comm.rank, fd)
    return received


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def create(size: int, comm: Communicator, device: torch.device) -> HeapMapping:
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))
    _check_space(size, local_ranks)
    own = _new_segment(size)
    fds = [own]
    try:
        fds = _exchange(own, comm)
        for peer, fd in enumerate(fds):
            if peer != comm.rank:
                _check_segment(fd, size, peer)
        maps = [_map(fd, size) for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)
    # Each tensor keeps its mmap alive; the memory is unmapped when the last tensor viewing it
    # is collected, so it never disappears under a live tensor.
    return HeapMapping(size=size, peers=tuple(torch.frombuffer(m, dtype=torch.uint8) for m in maps))


provider = HeapProvider(name="shm", device_type="cpu", create=create)
