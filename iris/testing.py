"""Multi-rank tests with pytest: a marker that runs a test on N ranks, and helpers for tests that
spawn ranks themselves. iris installs a pytest plugin (entry point ``pytest11``), so any project
with iris installed can write::

    import pytest

    @pytest.mark.iris_ranks(3)
    def test_ring(rank_ctx):          # runs on 3 ranks, each with its own context
        x = rank_ctx.ones(8) * rank_ctx.rank
        rank_ctx.ccl.all_reduce(x)
        assert x.eq(0 + 1 + 2).all()

The ranks are GPUs when at least N are visible, else CPU ranks (Triton's interpreter). Each rank
gets a fresh context (``rank_ctx``); a rank whose test body raises is reported with its own
traceback, every failing rank in one failure. ``@pytest.mark.iris_ranks(n, backend="triton",
heap_size="32MiB", timeout=120)`` sets the context's options; the test function must be defined
at module level (ranks import it by name). Besides ``rank_ctx`` it may take parameters
(``@pytest.mark.parametrize``) and fixtures whose values pickle (``tmp_path``, say): the ranks get
the values the parent resolved.

For tests that want one spawn to make many checks: :func:`spawn_reports` runs a worker on N
ranks that fills a :class:`RankReport`; :func:`assert_rank_checks` asserts on every rank's;
:func:`reports_on_available_ranks` also runs the ranks on one shared GPU when that is all there is
(:func:`run_sharing_one_gpu`).

The plugin pytest loads is the top-level module ``iris_pytest_plugin``: it registers the marker
and the ``rank_ctx`` fixture without importing torch or iris, and imports this module only when
a marked test runs (:func:`run_marked_test`), so projects that do not use the marker pay nothing.

For checks of what kernels compile to: :func:`run_without_interpreter` runs a script in a process
of its own with Triton's interpreter off and returns the JSON it printed.
"""

from __future__ import annotations

import gc
import inspect
import json
import multiprocessing
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Collection
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch

import iris
from iris.config import DEFAULT_BACKEND, timeout_from_environment

__all__ = [
    "RankReport",
    "assert_rank_checks",
    "backend_rank_device",
    "compiling_environment",
    "free_loopback_port",
    "interpreted_device",
    "mapped_heap_segments",
    "message_raised",
    "rank_device",
    "reports_on_available_ranks",
    "run_marked_test",
    "run_on_ranks",
    "run_sharing_one_gpu",
    "run_without_interpreter",
    "seeded_generator",
    "spawn_reports",
]

#: Longest traceback text a rank sends back (results pass through one pipe).
MAX_TRACEBACK = 8000
#: How much of the end of a failed script's stderr :func:`run_without_interpreter` shows.
MAX_STDERR = 5000


# -- where ranks run --------------------------------------------------------------------------------------


def rank_device(nprocs: int, backend: str | None = None) -> str:
    """GPU ranks when there is one GPU per rank, else CPU ranks; skips the test when the backend's
    kernels cannot run on CPU ranks here (:func:`interpreted_device`)."""
    if torch.cuda.device_count() >= nprocs:
        return "cuda"
    return interpreted_device(backend)


def interpreted_device(backend: str | None = None) -> str:
    """``"cpu"``, for CPU ranks (the Triton backend runs its kernels there in Triton's
    interpreter); skips the test when the backend (default: the default backend) says its kernels
    cannot run on CPU ranks in this installation (``DeviceOps.unavailable_reason``: Triton 3.6's
    interpreter with numpy >= 2.4, say)."""
    reason = iris.registry.get_backend(backend or DEFAULT_BACKEND).device_ops.unavailable_reason("cpu")
    if reason is not None:
        pytest.skip(reason)
    return "cpu"


def backend_rank_device(backend: str, nprocs: int) -> str:
    """:func:`rank_device`, skipping when ``backend``'s kernels do not run there (Gluon needs GPUs)."""
    runs_on = iris.registry.get_backend(backend).device_types
    device = "cuda" if torch.cuda.device_count() >= nprocs else "cpu"
    if device not in runs_on:
        pytest.skip(f"backend {backend!r} runs on {', '.join(sorted(runs_on))} only; {nprocs} ranks here are "
                    f"{device} ranks")
    return device if device == "cuda" else interpreted_device(backend)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now, for ranks launched by hand (``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def message_raised(call: Callable[[], Any], error_type: type[BaseException] = Exception) -> str:
    """The message of the ``error_type`` that ``call()`` raises, or ``"nothing"`` when it returns
    (what a rank reports of a call that must fail; other exceptions propagate)."""
    try:
        call()
    except error_type as error:
        return str(error)
    return "nothing"


def seeded_generator(*seed) -> torch.Generator:
    """A CPU generator seeded from ``seed`` the same way in every process (``hash`` of a str is not)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))


def mapped_heap_segments() -> list[str]:
    """The CPU ranks' heap segments (the ``shm`` provider's) this process still maps, after a
    garbage collection: their lines of ``/proc/self/maps`` (Linux)."""
    from iris.heap.shm import SEGMENT_NAME

    gc.collect()
    with open("/proc/self/maps") as maps:
        return [line.strip() for line in maps if f"/memfd:{SEGMENT_NAME}" in line]


# -- compiled, not interpreted ----------------------------------------------------------------------------


def compiling_environment(pythonpath: str | os.PathLike | None = None) -> dict[str, str]:
    """This process's environment without ``TRITON_INTERPRET`` (a process started with it compiles
    kernels), ``pythonpath`` first on ``PYTHONPATH`` where given."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.fspath(pythonpath), env.get("PYTHONPATH")]))
    return env


def run_without_interpreter(*argv: str | os.PathLike, timeout: float, cwd: str | os.PathLike | None = None,
                            pythonpath: str | os.PathLike | None = None, whole_stdout: bool = False) -> Any:
    """The JSON value that ``python *argv`` (a script and its arguments, or ``-c`` and a source)
    printed on the last line of its stdout (on all of it with ``whole_stdout``: JSON printed
    indented), run in a process of its own with Triton's interpreter off; asserts that it exited
    0, showing the end of its stderr when it did not.

    The interpreter accepts code the compiler refuses (a constexpr reassigned, say), so a check
    that kernels compile, or of what they compile to, has to compile them; and ``triton.jit``
    returns interpreted functions in a process that imported Triton with ``TRITON_INTERPRET`` set
    (as tests on CPU-only machines do), hence the fresh process without it. Kernels to compile
    belong in a file, not a ``-c`` source: Triton reads a kernel's source from its file.
    ``pythonpath`` is put first on ``PYTHONPATH`` (a folder of packages the script imports that
    are not installed); the process runs in ``cwd`` and is killed after ``timeout`` seconds
    (``subprocess.TimeoutExpired``)."""
    proc = subprocess.run([sys.executable, *map(os.fspath, argv)], env=compiling_environment(pythonpath), cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    stderr_end = proc.stderr[-MAX_STDERR:]
    assert proc.returncode == 0, f"the script exited with {proc.returncode}; its stderr ends:\n{stderr_end}"
    assert proc.stdout.strip(), f"the script printed nothing; its stderr ends:\n{stderr_end}"
    printed = proc.stdout if whole_stdout else proc.stdout.strip().splitlines()[-1]
    try:
        return json.loads(printed)
    except json.JSONDecodeError as error:
        raise AssertionError(f"the script did not print JSON last ({error}): {printed[-500:]!r}; its stderr "
                             f"ends:\n{stderr_end}") from error


# -- many checks per spawn --------------------------------------------------------------------------------


class RankReport(dict):
    """What one rank saw: check name -> True / False / error text. A section that raises records
    its traceback under ``<section>/completed`` instead of ending the worker, so the other
    sections still report."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def check(self, name: str, ok) -> None:
        """Record the check ``name``: passed when ``ok`` is true (a bool, or what ``bool`` takes,
        such as a one-element tensor); a string is the description of a failure, kept as it is
        (never true, however it reads)."""
        self[name] = ok if isinstance(ok, str) else bool(ok)

    @contextmanager
    def section(self, name: str):
        try:
            yield
            self[f"{name}/completed"] = True
        except Exception:  # noqa: BLE001 - recorded in the report, which the parent asserts on
            self[f"{name}/completed"] = f"rank {self.rank}: {traceback.format_exc()[-3000:]}"

    def packed(self) -> bytes:
        """The report, compressed: ranks' results come back through one pipe after every rank
        has exited, and a pickled result larger than the pipe's 64 KiB would block forever."""
        return zlib.compress(pickle.dumps(dict(self)))


@contextmanager
def _rank_environment(timeout: float):
    """A bounded wait for every device-side and host-side wait of the ranks, and no debug mode."""
    mp = pytest.MonkeyPatch()
    mp.setenv("IRIS_TIMEOUT", str(timeout))
    mp.delenv("IRIS_DEBUG", raising=False)
    try:
        yield
    finally:
        mp.undo()


def spawn_reports(worker: Callable[..., bytes], nprocs: int, *args, device: str, timeout: float = 120) -> list[dict]:
    """Every rank's unpacked :class:`RankReport` from ``worker(rank, *args)`` (which returns
    ``report.packed()``) on ``nprocs`` ranks; any wait gives up after ``timeout`` seconds."""
    with _rank_environment(timeout):
        start = "forkserver" if device == "cpu" else "spawn"  # CPU ranks: torch, Triton and iris imported once
        return [pickle.loads(zlib.decompress(p)) for p in iris.spawn(worker, nprocs, *args, device=device,
                                                                   start_method=start)]


def reports_on_available_ranks(worker: Callable[..., bytes], nprocs: int, *args, backend: str = DEFAULT_BACKEND,
                               timeout: float = 120) -> list[dict]:
    """:func:`spawn_reports` on the ranks this machine has: a GPU per rank when there are enough,
    every rank on GPU 0 when exactly one is visible (:func:`run_sharing_one_gpu`), else CPU ranks
    (skipping where ``backend``'s kernels cannot run there)."""
    gpus = torch.cuda.device_count()
    if gpus == 1 and nprocs > 1:
        with _rank_environment(timeout):
            results = run_sharing_one_gpu(worker, *args, world=nprocs, bound=4 * timeout)
        failed = {rank: r for rank, r in enumerate(results) if not isinstance(r, bytes)}
        if failed:
            pytest.fail("ranks sharing GPU 0 failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in failed.items()))
        return [pickle.loads(zlib.decompress(p)) for p in results]
    return spawn_reports(worker, nprocs, *args, device=backend_rank_device(backend, nprocs), timeout=timeout)


def _shared_gpu_rank(rank: int, world: int, port: int, worker: Callable, args: tuple, results) -> None:
    """One rank on GPU 0: a gloo process group (NCCL refuses two ranks on one GPU), then ``worker``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", IRIS_DEVICE="cuda")
    try:
        import torch.distributed as dist

        torch.cuda.set_device(0)
        timeout = timeout_from_environment(default=60)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        results.put((rank, worker(rank, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "raised: " + traceback.format_exc()[-MAX_TRACEBACK:]))
    results.close()
    results.join_thread()
    os._exit(0)


def run_sharing_one_gpu(worker: Callable, *args, world: int = 2, bound: float = 240) -> list:
    """``worker(rank, *args)`` on ``world`` ranks that all use GPU 0: processes on one device share
    heaps through CUDA IPC like processes on separate GPUs, and the device time-slices their
    kernels (so nothing run this way is timed). Each rank's return value, or a string saying how
    the rank failed (``"raised: <traceback>"``, ``"no result (exit code ...)"``); ranks still
    running after ``bound`` seconds are killed."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_loopback_port()
    procs = [context.Process(target=_shared_gpu_rank, args=(r, world, port, worker, args, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + bound
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, value = results.get(timeout=1)
                got[rank] = value
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and results.empty():
                    break
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return [got.get(r, f"no result (exit code {procs[r].exitcode})") for r in range(world)]


def assert_rank_checks(reports: list[dict], prefix: str,
                       expected: int | Collection[str] | Callable[[int], Collection[str]]) -> None:
    """Every rank's sections completed, and the checks named ``prefix*`` are exactly the expected
    ones and all passed: a check that a worker stopped making, or one it makes twice as often,
    fails the test as surely as a check that fails.

    ``prefix`` is a section's name followed by ``/`` (``"dispatch/"``, ``"groups/pair/"``), so
    that a section whose name merely starts alike is not counted with it. ``expected`` is one of

    - the number of such checks over all ranks together, derived from the test's cases;
    - the exact set of names (``"dispatch/fp8/counts"``, ...) every rank's report holds under
      ``prefix``;
    - a function of the rank giving that rank's set, where ranks check different things (a
      root, a member of a group).

    A section named ``prefix`` adds its ``<name>/completed``. When there are more or fewer checks,
    the assertion says which: for sets, the names missing and the extra ones on each rank; for a
    number, the count on each rank and the names some ranks have and others lack. Raises
    ValueError for an empty prefix or one not ending in ``/`` (it would gather the checks of
    unrelated sections), a negative count, or an expected name outside ``prefix*``."""
    if not prefix.strip("/") or not prefix.endswith("/"):
        raise ValueError(f"prefix must name a section and end with '/' (as in 'dispatch/'), got {prefix!r}")
    if isinstance(expected, (str, bool)) or not isinstance(expected, (int, Collection)) and not callable(expected):
        raise TypeError(f"expected must be a count of checks, a collection of check names or a function of the "
                        f"rank giving its names, got {expected!r}")
    if isinstance(expected, int) and expected < 0:
        raise ValueError(f"expected must be a count of checks >= 0, got {expected}")
    assert reports, "no rank reported"
    wanted = None
    if not isinstance(expected, int):
        wanted = [set(expected(r)) if callable(expected) else set(expected) for r in range(len(reports))]
        outside = sorted({name for want in wanted for name in want if not name.startswith(prefix)})
        if outside:
            raise ValueError(f"expected names outside {prefix}*: {outside[:30]}")
    errors = {f"r{r}/{k}": v for r, rep in enumerate(reports) for k, v in rep.items()
              if k.endswith("/completed") and v is not True}
    assert not errors, "\n".join(f"{k}: {v}" for k, v in errors.items())
    names = [{k for k in rep if k.startswith(prefix)} for rep in reports]
    if wanted is None:
        found = sum(map(len, names))
        uneven = sorted(set.union(*names) - set.intersection(*names))
        assert found == expected, (f"{found} checks named {prefix}*, expected {expected}; per rank "
                                   f"{[len(n) for n in names]}"
                                   + (f"; not on every rank: {uneven[:30]}" if uneven else ""))
    else:
        wrong = [f"rank {r}: missing {sorted(want - have)[:30]}, extra {sorted(have - want)[:30]}"
                 for r, (want, have) in enumerate(zip(wanted, names)) if have != want]
        assert not wrong, f"the checks named {prefix}* are not the expected ones:\n" + "\n".join(wrong)
    checks = {f"r{r}/{k}": rep[k] for r, rep in enumerate(reports) for k in sorted(names[r])}
    failed = [k for k, v in checks.items() if v is not True]
    assert not failed, f"{len(failed)} of {len(checks)} failed: {failed[:30]}" + "".join(
        f"\n{k}: {checks[k]}" for k in failed[:30] if checks[k] is not False)


# -- the marker -------------------------------------------------------------------------------------------


def _run_test_on_rank(rank: int, test: Callable, arguments: dict[str, Any], options: dict[str, Any],
                      device: str) -> str | None:
    """One rank of a marked test: a fresh context, the test body, the context destroyed; the
    tracebacks of what raised, if anything did."""
    ctx = iris.create(device=device, **options)
    failures = []
    try:
        test(rank_ctx=ctx, **arguments)
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with every rank's traceback
        failures.append(traceback.format_exc()[-MAX_TRACEBACK:])
    try:
        ctx.destroy()
    except BaseException:  # noqa: BLE001 - reported like the body's failure
        failures.append("ctx.destroy() raised after the test body:\n" + traceback.format_exc()[-MAX_TRACEBACK:])
    return "\n".join(failures) or None


def run_on_ranks(test: Callable, nprocs: int, *, timeout: float = 120, arguments: dict[str, Any] | None = None,
                 **options) -> None:
    """Run ``test(rank_ctx=ctx, **arguments)`` on ``nprocs`` ranks; fail (pytest) with the
    traceback of every rank where it (or the context's ``destroy()``) raised. ``arguments`` are
    the test's other arguments (parameters, fixture values: they must pickle); ``options`` go to
    :func:`iris.create` (``backend``, ``heap_size``, ...)."""
    arguments = arguments or {}
    for name, value in arguments.items():
        try:
            pickle.dumps(value)
        except Exception as error:
            raise pytest.UsageError(f"{getattr(test, '__name__', test)}: its argument {name!r} cannot be sent to the "
                                    f"ranks ({type(error).__name__}: {error}); tests run on ranks take "
                                    f"parameters and fixtures whose values pickle (tmp_path does; a lock or an open "
                                    f"file does not: make such things inside the test)") from error
    backend = options.get("backend") or DEFAULT_BACKEND
    device = backend_rank_device(backend, nprocs)
    with _rank_environment(timeout):
        failures = iris.spawn(_run_test_on_rank, nprocs, test, arguments, options, device, device=device,
                              backend=backend)
    report = [f"--- rank {rank} of {nprocs} ({device}) ---\n{text}" for rank, text in enumerate(failures) if text]
    if report:
        pytest.fail(f"the test failed on {len(report)} of {nprocs} ranks:\n" + "\n".join(report), pytrace=False)


def run_marked_test(pyfuncitem, marker) -> None:
    """Run a test marked ``@pytest.mark.iris_ranks(n, **options)`` (``marker``, the plugin's, found on
    ``pyfuncitem``) on its ranks, as the plugin's ``pytest_pyfunc_call`` does: the marker's options
    go to :func:`run_on_ranks`, the test's other arguments (parameters, fixture values) to every rank."""
    nprocs = marker.args[0] if marker.args else marker.kwargs.get("n")
    if not isinstance(nprocs, int) or nprocs < 1:
        raise pytest.UsageError(f"@pytest.mark.{marker.name} needs a number of ranks >= 1, got {nprocs!r}")
    options = {k: v for k, v in marker.kwargs.items() if k != "n"}
    arguments = {name: pyfuncitem.funcargs[name] for name in inspect.signature(pyfuncitem.obj).parameters
                 if name != "rank_ctx"}
    run_on_ranks(pyfuncitem.obj, nprocs, arguments=arguments, **options)
