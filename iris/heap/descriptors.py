"""Handing file descriptors to the other ranks of this machine.

Heaps and memory mapped into them in place travel between processes as file descriptors: a
memfd or shared-memory file on CPU ranks, a CUDA allocation exported as a POSIX descriptor on
GPU ranks. They move over Unix-domain sockets in the abstract namespace (nothing on disk) with
``SCM_RIGHTS``. Each rank listens under a random name and publishes the name and a random token
through the process group; it hands its descriptors only to connections of this user that
present the token. What a descriptor must be is for the caller to check before mapping it.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import time

from iris.context.bootstrap import Communicator
from iris.errors import IrisError, IrisTimeoutError

__all__ = ["exchange"]

_TOKEN_BYTES = 16
#: Descriptors per message: the kernel takes at most 253 in one ``SCM_RIGHTS`` message.
_BATCH = 250
_COUNT = struct.Struct("!I")


def _listen(backlog: int) -> socket.socket:
    """A socket listening in the abstract namespace under a random name (nothing on disk)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    server.bind(b"\0iris-fds-" + secrets.token_hex(16).encode())
    server.listen(max(backlog, socket.SOMAXCONN))  # room for strangers' connections beside the peers'
    return server


def _peer_uid(conn: socket.socket) -> int:
    """The effective uid of the process at the other end of a Unix-domain connection."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid


def _send(conn: socket.socket, fds: list[int]) -> None:
    """``fds`` in batches, each preceded by how many are still to come (that batch included)."""
    for start in range(0, max(len(fds), 1), _BATCH):
        batch = fds[start:start + _BATCH]
        socket.send_fds(conn, [_COUNT.pack(len(fds) - start)], batch, socket.MSG_NOSIGNAL)


def _serve(server: socket.socket, fds: list[int], token: bytes, peers: int, deadline: float, what: str) -> None:
    """Send ``fds`` to ``peers`` connections that come from this user and present ``token``;
    other connections are closed unanswered."""
    served = 0
    while served < peers:
        server.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            conn, _ = server.accept()
        except TimeoutError:
            raise IrisTimeoutError(
                f"{what}: {peers - served} of {peers} peer(s) did not fetch this rank's memory in time. Check that "
                f"every rank is alive and makes the same call, or raise the timeout with create(timeout=...) / "
                f"IRIS_TIMEOUT") from None
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
                _send(conn, fds)
            except OSError as error:
                raise IrisError(f"{what}: a peer closed its connection before it received this rank's memory "
                                f"({error}); did a rank exit?") from error
            served += 1


def _connect(address: bytes, token: bytes, deadline: float, peer: int, what: str) -> socket.socket:
    """A connection to ``peer``'s listener that has presented ``peer``'s token."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        conn.connect(address)
        conn.sendall(token)
    except OSError as error:
        conn.close()
        raise IrisError(f"{what}: could not reach rank {peer}'s listener ({error}); check that rank {peer} is "
                        f"alive and runs on this machine") from error
    return conn


def _receive(conn: socket.socket, count: int, deadline: float, peer: int, what: str) -> list[int]:
    """The ``count`` descriptors ``peer`` sends over ``conn``."""
    received: list[int] = []
    try:
        while True:
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                data, fds, flags, _ = socket.recv_fds(conn, _COUNT.size, _BATCH, socket.MSG_CMSG_CLOEXEC
                                                      | socket.MSG_WAITALL)
            except TimeoutError:
                raise IrisTimeoutError(
                    f"{what}: rank {peer} did not send its memory in time. Check that every rank is alive and "
                    f"makes the same call, or raise the timeout with create(timeout=...) / IRIS_TIMEOUT") from None
            received.extend(fds)
            remaining = _COUNT.unpack(data)[0] if len(data) == _COUNT.size else -1
            if flags & socket.MSG_CTRUNC or remaining != count - len(received) + len(fds) or len(fds) > remaining:
                raise IrisError(f"{what}: rank {peer} sent {len(received)} descriptor(s) where {count} were "
                                f"expected (did it exit?)")
            if len(received) == count:
                return received
    except BaseException:
        for fd in received:
            os.close(fd)
        raise
    finally:
        conn.close()


def exchange(fds: list[int], counts: list[int], comm: Communicator, what: str) -> list[list[int]]:
    """Every rank's descriptors, in rank order: this rank hands ``fds`` to every peer, and
    ``counts[r]`` is how many rank ``r`` hands over. This rank's entry is ``fds`` itself; the
    others are new descriptors the caller closes. Collective over ``comm``; ``what`` names the
    call in errors."""
    deadline = time.monotonic() + comm.timeout
    received: dict[int, list[int]] = {}
    with _listen(comm.world_size) as server:
        token = secrets.token_bytes(_TOKEN_BYTES)
        listeners = comm.all_gather_object((server.getsockname(), token))
        peers = [r for r in range(comm.world_size) if r != comm.rank]
        conns = {}
        try:
            for peer in peers:  # each connection waits in the peer's backlog: no peer blocks another
                conns[peer] = _connect(*listeners[peer], deadline, peer, what)
            _serve(server, fds, token, len(peers), deadline, what)
            for peer in peers:
                received[peer] = _receive(conns.pop(peer), counts[peer], deadline, peer, what)
        except BaseException:
            for conn in conns.values():
                conn.close()
            for others in received.values():
                for other in others:
                    os.close(other)
            raise
    received[comm.rank] = fds
    return [received[r] for r in range(comm.world_size)]
