"""Process lifecycle: nothing outlives a launch, whatever is killed when.

A rank, or ``iris.spawn``'s parent, is SIGKILLed at seeded random moments of ``iris.create()``,
``ctx.free``, an all_reduce, ``as_symmetric`` mapping a tensor in place and a plain wait;
afterwards no ``/dev/shm/iris-*`` segment, no iris temporary directory and no rank process is
left. SIGTERM and SIGINT of the parent end ranks that ignore both. A rank that exits early is
reported by rank and exit status, and a rank's exception reaches the caller as its own type with
the rank's traceback.
"""

from __future__ import annotations

import fcntl
import os
import queue
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import iris
from iris.errors import IrisError, IrisTimeoutError
from iris.heap import shm
from iris.errors import RankFailedError
from iris.testing import interpreted_device

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm") or sys.platform != "linux", reason="Linux only")

#: Seconds a launch gets to start its ranks, and its ranks to be gone after a kill (generous:
#: the machine may be loaded).
START_TIMEOUT = 180
GONE_TIMEOUT = 60

LAUNCH_SCRIPT = textwrap.dedent('''
    import os, signal, sys, time, warnings
    import torch
    import iris

    warnings.simplefilter("ignore", UserWarning)  # an as_symmetric that copies says why

    def work(rank, operation, ignore_signals):
        if ignore_signals:  # the parent must end its ranks without their help
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(1, f"RANK {rank} {os.getpid()}\\n".encode())  # one write: the ranks share the pipe
        if operation == "create":
            while True:
                iris.create(heap_size="8MiB", device="cpu").destroy()
        ctx = iris.create(heap_size="8MiB", device="cpu")
        x = ctx.ones(256)
        while True:
            if operation == "free":
                ctx.free(ctx.zeros(1000))
            elif operation == "all_reduce":
                ctx.ccl.all_reduce(x)
            elif operation == "as_symmetric":
                ctx.free(ctx.as_symmetric(torch.arange(5000.0), in_place=True))
            else:
                time.sleep(0.05)

    if __name__ == "__main__":
        import faulthandler
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, should it hang
        # As a shell starts a launcher: a process inherits an ignored SIGINT from its parent (the
        # test runner's may be, after other tests), and Python then leaves it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        print(f"PARENT {os.getpid()}", flush=True)
        iris.spawn(work, 2, sys.argv[1], sys.argv[2] == "1", device="cpu", start_method=sys.argv[3])
''')


# -- what is left behind ------------------------------------------------------------------------------


def _iris_entries() -> set[str]:
    """iris-named entries of /dev/shm. (Temporary files are checked in a launch's own TMPDIR:
    the machine's is shared with other test runs.)"""
    return {f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith("iris")}


def _assert_nothing_new(before: set[str], private_tmp: Path | None = None) -> None:
    """No iris entry that was not there before remains (one that vanishes within 3 s belongs to
    a test run elsewhere on the machine), and nothing at all in ``private_tmp``."""
    new = _iris_entries() - before
    deadline = time.monotonic() + 3
    while new and time.monotonic() < deadline:
        time.sleep(0.2)
        new &= _iris_entries()
    assert not new, f"left behind: {sorted(new)}"
    if private_tmp is not None:
        assert not os.listdir(private_tmp), f"left behind in TMPDIR: {os.listdir(private_tmp)}"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + GONE_TIMEOUT
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in pids if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"rank processes {survivors} outlived their launch"


# -- a launch to kill ------------------------------------------------------------------------------------


class Launch:
    """``iris.spawn`` of LAUNCH_SCRIPT's ``work`` on 2 CPU ranks, in a parent process of its own."""

    def __init__(self, tmp_path, operation: str, ignore_signals: bool = False, start_method: str = "spawn"):
        script = tmp_path / "launch.py"
        script.write_text(LAUNCH_SCRIPT)
        env = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_")}
        self.tmp = tmp_path / "tmp"  # the launch's TMPDIR: whatever it leaves there is a leak
        self.tmp.mkdir(exist_ok=True)
        env.update(TRITON_INTERPRET="1", IRIS_TIMEOUT="30", TMPDIR=str(self.tmp))
        self.stderr_path = tmp_path / "stderr.txt"
        with open(self.stderr_path, "w") as stderr:
            arguments = [operation, str(int(ignore_signals)), start_method]
            self.proc = subprocess.Popen([sys.executable, str(script), *arguments], env=env, cwd=tmp_path,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.stderr = ""
        try:
            self.ranks = self._wait_for_ranks()
        except BaseException:
            self.proc.kill()  # its ranks die with it
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def _wait_for_ranks(self) -> list[int]:
        """The pids of both ranks, once both have started."""
        ranks: dict[int, int] = {}
        deadline = time.monotonic() + START_TIMEOUT
        while len(ranks) < 2:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                if self.proc.poll() is None and time.monotonic() < deadline:
                    continue
                raise AssertionError(f"the ranks did not start: {self.stderr_path.read_text()[-3000:]}") from None
            found = re.fullmatch(r"RANK (\d) (\d+)\n", line)
            if found:
                ranks[int(found[1])] = int(found[2])
        return [ranks[0], ranks[1]]

    def wait(self) -> int:
        """The parent's exit status, once it has exited."""
        try:
            self.proc.wait(timeout=GONE_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # its threads' stacks to its stderr
            time.sleep(1)
            self.proc.kill()
            raise AssertionError("the launch did not end after the kill; where it was:\n"
                                 + self.stderr_path.read_text()[-6000:]) from None
        finally:
            self.stderr = self.stderr_path.read_text()
        return self.proc.returncode


def _kill_at_random_moments(tmp_path, operation: str, victim: str, seed: int, moments: int = 2) -> None:
    """SIGKILL ``victim`` ("rank" or "parent") at ``moments`` random moments of ``operation``;
    after each, nothing is left behind and the parent reports what happened."""
    rng = random.Random(seed)
    for _ in range(moments):
        before = _iris_entries()
        launch = Launch(tmp_path, operation)
        time.sleep(rng.uniform(0, 1.5))  # inside create() (about 0.5 s), or the operation
        if victim == "parent":
            os.kill(launch.proc.pid, signal.SIGKILL)
            assert launch.wait() == -signal.SIGKILL
        else:
            rank = rng.randrange(2)
            os.kill(launch.ranks[rank], signal.SIGKILL)
            assert launch.wait() == 1, launch.stderr[-3000:]
            # The killed rank, or a survivor that noticed it first, is reported by rank.
            assert "iris.errors.RankFailedError: rank " in launch.stderr or "raised on rank " in launch.stderr, \
                launch.stderr[-3000:]
        _assert_gone(launch.ranks)
        _assert_nothing_new(before, launch.tmp)


@pytest.mark.parametrize("operation, seed", [("create", 1), ("free", 2), ("all_reduce", 3), ("as_symmetric", 5)])
def test_a_rank_killed_at_any_moment_leaves_nothing(tmp_path, operation, seed):
    if operation == "all_reduce":
        interpreted_device()  # its CPU ranks run the kernel: skips where the interpreter cannot
    _kill_at_random_moments(tmp_path, operation, "rank", seed)


def test_the_parent_killed_at_any_moment_leaves_nothing(tmp_path):
    _kill_at_random_moments(tmp_path, "create", "parent", seed=4)


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)])
def test_sigterm_or_sigint_of_the_parent_ends_ranks_that_ignore_both(tmp_path, signum, status):
    before = _iris_entries()
    launch = Launch(tmp_path, "sleep", ignore_signals=True)
    time.sleep(0.5)
    os.kill(launch.proc.pid, signum)
    assert launch.wait() == status, launch.stderr[-3000:]
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in launch.stderr, launch.stderr[-3000:]
    _assert_gone(launch.ranks)
    _assert_nothing_new(before, launch.tmp)


def test_ranks_forked_from_the_server_end_with_a_killed_launcher(tmp_path):
    """Their parent is the server, which outlives the launcher while they run: they watch the
    launcher itself. (The server's socket folder in TMPDIR may stay: the documented cost.)"""
    launch = Launch(tmp_path, "sleep", start_method="forkserver")
    assert all(_parent_of(pid) != launch.proc.pid for pid in launch.ranks), "ranks not forked from the server"
    os.kill(launch.proc.pid, signal.SIGKILL)
    assert launch.wait() == -signal.SIGKILL
    _assert_gone(launch.ranks)


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _environment_and_parent(rank: int) -> tuple:
    return os.environ.get("IRIS_LAUNCH_MARK"), os.environ.get("IRIS_DEBUG"), os.getppid()


def test_forked_ranks_get_the_launchers_environment_and_other_import_settings_are_spawned(monkeypatch):
    monkeypatch.delenv("IRIS_DEBUG", raising=False)
    for mark in ("first", "second"):  # the second launch reuses the server started before it changed
        monkeypatch.setenv("IRIS_LAUNCH_MARK", mark)
        for value, debug, parent in iris.spawn(_environment_and_parent, 2, device="cpu", start_method="forkserver"):
            assert (value, debug) == (mark, None) and parent != os.getpid(), "a rank forked from the server"
    # IRIS_DEBUG is read when iris's device API is imported: a server without it cannot fork these.
    monkeypatch.setenv("IRIS_DEBUG", "1")
    for value, debug, parent in iris.spawn(_environment_and_parent, 2, device="cpu", start_method="forkserver"):
        assert (value, debug, parent) == ("second", "1", os.getpid()), "a rank spawned by this process"


def _process_id(rank: int) -> int:
    return os.getpid()


def test_ranks_that_return_at_once_never_break_a_peers_group_set_up():
    # A rank used to be able to leave while its peer was still connecting to it (gloo's connection
    # closed by peer): a few launches in a hundred failed, more on a loaded machine.
    for launch in range(40):
        pids = iris.spawn(_process_id, 2, device="cpu", start_method="forkserver")
        assert len(set(pids)) == 2 and os.getpid() not in pids, f"launch {launch}: {pids}"


def test_a_start_method_other_than_spawn_or_forkserver_for_cpu_ranks_is_refused():
    with pytest.raises(ValueError, match=r"start_method must be 'spawn', or 'forkserver' for CPU ranks .* got "
                                         r"'fork' for cpu ranks"):
        iris.spawn(_environment_and_parent, 2, device="cpu", start_method="fork")
    with pytest.raises(ValueError, match=r"cannot use CUDA\), got 'forkserver' for cuda ranks"):
        iris.spawn(_environment_and_parent, 1, device="cuda", start_method="forkserver")


# -- what the caller of iris.spawn sees ------------------------------------------------------------------


def _exits_early(rank: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_exits_early_is_reported_by_rank_and_status():
    with pytest.raises(RankFailedError, match=r"rank 1 of 2 ended without a result: its process exited with "
                                              r"status 3 before fn returned") as info:
        iris.spawn(_exits_early, 2, device="cpu")
    assert (info.value.rank, info.value.exitcode) == (1, 3)


class _NeedsTwoArguments(Exception):
    """An exception pickle cannot rebuild (its constructor does not take its ``args``)."""

    def __init__(self, first, second):
        super().__init__(f"{first} and {second}")


def _raises(rank: int, which: str) -> int:
    if rank == 1:
        if which == "timeout":
            raise IrisTimeoutError("waited 8 s for rank 0")
        raise _NeedsTwoArguments("one", "two")
    return rank


def test_a_rank_exception_reaches_the_caller_as_its_type_with_the_rank_traceback():
    with pytest.raises(IrisTimeoutError) as info:
        iris.spawn(_raises, 2, "timeout", device="cpu")
    message = str(info.value)
    assert message.startswith("waited 8 s for rank 0\n\nraised on rank 1 of 2:\nTraceback"), message
    assert 'in _raises\n    raise IrisTimeoutError("waited 8 s for rank 0")' in message, message


def test_a_rank_exception_that_cannot_be_rebuilt_is_a_rank_failed_error():
    with pytest.raises(RankFailedError, match=r"(?s)an exception raised on rank 1 of 2:\nTraceback.*"
                                              r"_NeedsTwoArguments: one and two") as info:
        iris.spawn(_raises, 2, "unpicklable", device="cpu")
    assert (info.value.rank, info.value.exitcode) == (1, 1)


# -- the heap and the launch leave no name and listen on loopback only ----------------------------------


def _fd_target(fd: str, pid: int | str = "self") -> str:
    """What descriptor ``fd`` of process ``pid`` refers to ("" for one closed since it was listed,
    such as the one that listed them)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:
        return ""


def _listening(pid: int) -> list[str]:
    """Local addresses (hex, as /proc writes them) of TCP sockets that ``pid`` listens on."""
    inodes = {target[8:-1] for target in (_fd_target(fd, pid) for fd in os.listdir(f"/proc/{pid}/fd"))
              if target.startswith("socket:[")}
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            found += [f[1].split(":")[0] for f in (line.split() for line in list(lines)[1:])
                      if f[3] == "0A" and f[9] in inodes]
    return found


def _heap_worker(rank: int) -> dict:
    ctx = iris.create(heap_size="8MiB", device="cpu")
    report = {
        "maps": [line.split(None, 5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if "iris" in line],
        "fds": [target for target in map(_fd_target, os.listdir("/proc/self/fd")) if "iris" in target],
        "launcher_listens_on": _listening(os.getppid()),
    }
    ctx.barrier()
    ctx.destroy()
    return report


def test_heaps_are_unnamed_memfds_and_the_launcher_listens_on_loopback_only(monkeypatch):
    monkeypatch.setenv("IRIS_TIMEOUT", "60")
    before = _iris_entries()
    # What this process listened on already (on a GPU machine, the session context's NCCL group).
    listening_before = set(_listening(os.getpid()))
    for report in iris.spawn(_heap_worker, 2, device="cpu"):
        # Each rank maps both heaps, unnamed; the only descriptors are two per heap: its mmap
        # object's own, and the one kept to map the heap back where as_symmetric mapped a tensor.
        assert report["maps"] == ["/memfd:iris-heap (deleted)"] * 2, report["maps"]
        assert report["fds"] == ["/memfd:iris-heap (deleted)"] * 4, report["fds"]
        # The launch's store listens on 127.0.0.1, and nothing new listens anywhere else.
        launcher = set(report["launcher_listens_on"])
        assert "0100007F" in launcher and launcher - listening_before <= {"0100007F"}, report
    _assert_nothing_new(before)


def test_a_peer_descriptor_is_checked_before_it_is_mapped(tmp_path):
    size = 1 << 20
    good = shm._new_segment(size)
    unsealed = os.memfd_create("iris-heap", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, size)
    path = tmp_path / "heap"
    path.write_bytes(b"\0" * size)
    named = os.open(path, os.O_RDWR)
    try:
        shm._check_segment(good, size, peer=1)
        with pytest.raises(IrisError, match=r"from rank 1 has 1048576 bytes where this rank's heap_size is 2097152: "
                                            r"all ranks must pass the same heap_size"):
            shm._check_segment(good, 2 * size, peer=1)
        with pytest.raises(IrisError, match=r"from rank 2 is not sealed against resizing"):
            shm._check_segment(unsealed, size, peer=2)
        with pytest.raises(IrisError, match=r"from rank 3 is not a memfd; it has 1 name\(s\) in a file system"):
            shm._check_segment(named, size, peer=3)
        assert fcntl.fcntl(good, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK  # the size is final
        with pytest.raises(PermissionError):
            os.ftruncate(good, size // 2)
    finally:
        for fd in (good, unsealed, named):
            os.close(fd)
