"""``iris.spawn``: run a function on N fresh rank processes with torch.distributed ready.

For scripts, notebooks and tests. Each rank is a new process (start method ``spawn``), so CUDA
and Triton start clean; the ranks get the environment their backend asks for
(:meth:`iris.DeviceOps.rank_environment`: the Triton backend's CPU ranks, ``TRITON_INTERPRET=1``)
before anything imports it, and the launcher's whole environment as it was at the launch. CPU
ranks can instead be forked from a server process that imported torch, Triton and iris once
(``start_method="forkserver"``: the test suite's helpers), which saves each rank the seconds of
CPU those imports cost; a launch whose import-time settings (``TRITON_*``, ``IRIS_DEBUG``) differ
from the server's spawns its ranks.

Nothing of a launch outlives it or listens on the network: the ranks meet through a TCP store
the parent hosts on 127.0.0.1 (no file anywhere), gloo and NCCL keep their sockets on the
loopback interface, every rank is killed when the parent dies (``PR_SET_PDEATHSIG``, whatever
killed the parent), and the parent ends its ranks when it is interrupted or one rank fails.
"""

from __future__ import annotations

import ctypes
import multiprocessing.forkserver
import os
import pickle
import select
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import connection
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from iris.context.bootstrap import default_device_type
from iris.config import DEFAULT_BACKEND, timeout_from_environment
from iris.errors import RankFailedError
from iris.registry import get_backend, is_backend_available

__all__ = ["RankFailedError", "backend_environment", "cpu_rank_context", "die_with_launcher", "die_with_parent",
           "end_processes", "import_time_settings", "loopback_store", "rank_environment", "spawn"]

#: Seconds a rank gets to exit after SIGTERM before it is killed.
TERMINATE_GRACE = 3.0
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def backend_environment(device: str, backend: str | None = None) -> dict[str, str]:
    """What the ranks' backend (``backend``, else ``IRIS_BACKEND``, else the default) asks to be
    set before it is imported on ``device`` ranks; nothing when that backend is not installed
    (the ranks' ``iris.create`` then says so). With ``backend`` given, the ranks' default too."""
    name = backend or os.environ.get("IRIS_BACKEND") or DEFAULT_BACKEND
    env = {"IRIS_BACKEND": name} if backend else {}
    if is_backend_available(name):
        env.update(get_backend(name).device_ops.rank_environment(device))
    return env


def rank_environment(nprocs: int, device: str, port: int, backend: str | None = None) -> dict[str, str]:
    """Environment shared by all ranks of a local launch (rank variables are set per process).
    The ranks join, as clients, the store at 127.0.0.1:``port`` that the launcher hosts (as
    torchrun's workers join its agent's), and gloo and NCCL keep their sockets on the loopback
    interface: nothing of a local launch listens on the network. The backend's environment
    (:func:`backend_environment`) comes with it."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "IRIS_DEVICE": device,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
    }
    return env | backend_environment(device, backend)


#: Modules the CPU ranks' server imports once, for every rank it forks.
SERVER_PRELOAD = ("torch", "torch.distributed", "numpy", "triton", "iris", "iris_triton")
_server_settings: dict[str, str] | None = None


def import_time_settings(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that modules read when they are imported (Triton's, and
    ``IRIS_DEBUG`` for the device API's pointer checks): a rank forked from a server that
    imported them under other values would run with the server's."""
    return {k: v for k, v in env.items() if k.startswith("TRITON_") or k == "IRIS_DEBUG"}


def cpu_rank_context(env: dict[str, str]):
    """The multiprocessing context for CPU ranks whose environment is ``env``: the forkserver
    (started on first use under ``env`` without ``IRIS_DEBUG``, with :data:`SERVER_PRELOAD`
    imported) where ``env``'s import-time settings are the server's; else ``spawn`` (a launch
    with ``IRIS_DEBUG`` set, for one)."""
    global _server_settings
    if _server_settings is None:
        server_env = {k: v for k, v in env.items() if k != "IRIS_DEBUG"}
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(SERVER_PRELOAD))
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(server_env)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _server_settings = import_time_settings(server_env)
    return mp.get_context("forkserver" if import_time_settings(env) == _server_settings else "spawn")


@contextmanager
def loopback_store(start_ranks: Callable[[int], T]) -> Iterator[T]:
    """Host a TCP store on 127.0.0.1 for ranks to meet through, and yield what ``start_ranks(port)``
    returns. A TCPStore that opens its own socket listens on every interface, so it is handed one
    bound to the loopback interface (the store owns and closes it). The ranks are started before
    the store's threads exist, so a launcher may fork them; their connections wait in the backlog."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        started = start_ranks(listener.getsockname()[1])
    except BaseException:
        listener.close()
        raise
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                          master_listen_fd=listener.detach())
    try:
        yield started
    finally:
        del store


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent ends, and end now if the parent
    ``parent`` already has (this process was then handed to another parent). Safe between fork
    and exec (``preexec_fn``): libc is loaded beforehand."""
    if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def die_with_launcher(launcher: int) -> None:
    """Have this process SIGKILL itself when process ``launcher`` ends, and end now if it has.
    For ranks forked from a server, whose parent is the server, not the launcher: the server
    outlives the launcher while its children run, so the parent-death signal of
    :func:`die_with_parent` cannot tell. A daemon thread waits on a pidfd of the launcher."""
    try:
        watched = os.pidfd_open(launcher)
    except ProcessLookupError:
        os._exit(1)

    def watch() -> None:
        select.select([watched], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="iris-launcher-watch", daemon=True).start()


def end_processes(pids: Sequence[int], is_alive: Callable[[int], bool], grace: float = TERMINATE_GRACE) -> None:
    """SIGTERM the processes ``pids`` that are still alive, then SIGKILL those still alive after
    ``grace`` seconds (a rank may ignore SIGTERM)."""

    def signal_alive(signum: int) -> list[int]:
        alive = [pid for pid in pids if is_alive(pid)]
        for pid in alive:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        return alive

    deadline = time.monotonic() + grace
    if signal_alive(signal.SIGTERM):
        while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
            time.sleep(0.05)
        signal_alive(signal.SIGKILL)


def describe_exit(exitcode: int) -> str:
    """``exited with status 3`` or ``was killed by signal SIGKILL``, from a Popen-style code."""
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables for the children started inside the block, then restore the parent's."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _portable(error: BaseException) -> bytes | None:
    """``error`` pickled, if the parent can rebuild it (an exception whose constructor takes
    other arguments than its ``args`` cannot be)."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - any failure means: send the traceback text only
        return None


def _run_rank(rank: int, fn: Callable[..., Any], args: tuple, results: Any, launcher: int, forked: bool,
              env: dict[str, str]) -> None:
    """One rank: end with the launcher (its child, or ``forked`` from the server), take the
    launcher's environment ``env``, join the group, run ``fn`` and send ``("returned", value)``
    or ``("raised", pickled exception or None, traceback text)`` to the launcher."""
    from iris.context.bootstrap import ensure_process_group

    if forked:
        die_with_launcher(launcher)
    else:
        die_with_parent(launcher)
    os.environ.clear()
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    ensure_process_group(os.environ["IRIS_DEVICE"], timeout=timeout_from_environment())
    try:
        try:
            results.send(("returned", fn(rank, *args)))
        except Exception as error:  # noqa: BLE001 - fn's, or pickling its result: reported to the parent
            results.send(("raised", _portable(error), traceback.format_exc()))
            raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, device: str | None = None,
          backend: str | None = None, start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` new processes and return their results by rank.

    ``torch.distributed`` is initialized in each (gloo on CPU ranks; on GPUs nccl, one GPU per
    rank). ``fn`` and ``args`` must be picklable (a module-level function). An exception on any
    rank stops the others and is raised here with that rank's traceback. ``backend``: the ranks'
    default backend (else ``IRIS_BACKEND``, else ``"triton"``), whose environment they get.
    ``start_method``: ``"spawn"`` (fresh interpreters), or for CPU ranks ``"forkserver"``: ranks
    forked from a server that imported torch, Triton and iris once (:func:`cpu_rank_context`),
    a fraction of a second per rank instead of seconds of CPU. The server listens on a socket in
    a temporary folder that Python removes when this process exits normally, not when it is
    killed: launches of many small jobs (test suites) gain, a launch that must leave nothing
    behind whatever happens keeps the default.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    device = device or default_device_type()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if start_method not in ("spawn", "forkserver") or (start_method == "forkserver" and device != "cpu"):
        raise ValueError(f"start_method must be 'spawn', or 'forkserver' for CPU ranks (a process forked from the "
                         f"server cannot use CUDA), got {start_method!r} for {device} ranks")
    if device == "cuda" and torch.cuda.device_count() < nprocs:
        raise ValueError(
            f"spawn(nprocs={nprocs}, device='cuda') needs {nprocs} GPUs but "
            f"{torch.cuda.device_count()} are visible; lower nprocs or use device='cpu'"
        )
    readers: list = []

    def start_ranks(port: int) -> list:
        procs = []
        env = dict(os.environ) | rank_environment(nprocs, device, port, backend)
        context = cpu_rank_context(env) if start_method == "forkserver" else mp.get_context("spawn")
        forked = context.get_start_method() == "forkserver"
        with _environment(env):
            for rank in range(nprocs):
                reader, writer = context.Pipe(duplex=False)
                proc = context.Process(target=_run_rank, args=(rank, fn, args, writer, os.getpid(), forked, env),
                                       name=f"iris-rank-{rank}")
                proc.start()
                writer.close()  # the rank holds the only writer: its exit ends the pipe
                procs.append(proc)
                readers.append(reader)
        return procs

    with loopback_store(start_ranks) as procs:
        try:
            return _collect(procs, readers)
        except BaseException:  # a rank failed, or this process was interrupted: end the others
            by_pid = {proc.pid: proc for proc in procs}
            end_processes(list(by_pid), lambda pid: by_pid[pid].is_alive())
            raise
        finally:
            for proc in procs:
                proc.join()


def _collect(procs: list, readers: list) -> list[Any]:
    """Every rank's result, by rank; the first rank to end without one is raised."""
    # Results are read as they come: a rank blocks in send() while its result fills the pipe.
    pending = dict(enumerate(readers))
    results: dict[int, Any] = {}
    while pending:
        ready = connection.wait(list(pending.values()))
        for rank in [r for r, reader in pending.items() if reader in ready]:
            try:
                message = pending.pop(rank).recv()
            except EOFError:
                procs[rank].join()
                raise RankFailedError(
                    f"rank {rank} of {len(procs)} ended without a result: its process "
                    f"{describe_exit(procs[rank].exitcode)} before fn returned (os._exit, sys.exit, a crash or a "
                    f"signal inside fn?)", rank=rank, exitcode=procs[rank].exitcode) from None
            if message[0] == "raised":
                raise _rank_exception(rank, len(procs), *message[1:]) from None
            results[rank] = message[1]
    return [results[rank] for rank in range(len(procs))]


def _rank_exception(rank: int, nprocs: int, pickled: bytes | None, text: str) -> BaseException:
    """The exception a rank raised, as its own type, with the rank's traceback in its message
    (or, for a type whose message is not its ``args``, in a note); a RankFailedError when it
    cannot be rebuilt here."""
    where = f"raised on rank {rank} of {nprocs}:\n{text.rstrip()}"
    error = pickle.loads(pickled) if pickled is not None else None
    if error is None:
        return RankFailedError(f"an exception {where}", rank=rank, exitcode=1)
    original, message = error.args, f"{error}\n\n{where}" if str(error) else where
    error.args = (message,)
    if str(error) != message:  # a type that makes its message otherwise (KeyError, OSError with errno)
        error.args = original
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(where)
    return error
