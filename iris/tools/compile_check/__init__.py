"""``iris compile-check``: every kernel the installed backends launch, compiled for a GPU, without one.

Triton's interpreter, which runs kernels on CPU ranks, never compiles them: it accepts what the
compiler refuses (a constexpr reassigned, a layout the target lacks) and follows neither the
compiler's dtype promotion nor its memory model. So a kernel proven only there, and only at the
world sizes tests spawn, is not known to compile where users run it. This check compiles, for
each world size, rank, installed backend, and device-side tracing off and on
(:func:`iris.tools.compile_check.cases.contexts_checked`), every kernel launch the host side can
choose (:mod:`iris.tools.compile_check.cases`), on compile-only contexts
(:mod:`iris.tools.compile_check.world`) whose launches are recorded rather than run
(:mod:`iris.tools.compile_check.recorder`). It then compiles each distinct launch for the target
architecture, in parallel, checks what the PTX must hold at every world size
(:mod:`iris.tools.compile_check.ptx`) and that ptxas reports serializing no tensor-core
instructions (:mod:`iris.tools.compile_check.ptxas`), and checks that every launch site in the
backends' sources was reached (:mod:`iris.tools.compile_check.coverage`): a site the calls do not
reach is a failure.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

from iris.config import DEFAULT_BACKEND
from iris.tools.compile_check.cases import Checked, calls, contexts_checked
from iris.tools.compile_check.coverage import uncovered_launch_sites
from iris.tools.compile_check.ptx import ptx_violations
from iris.tools.compile_check.ptxas import reported, serialized_tensor_cores
from iris.tools.compile_check.recorder import Launch, compile_launch, parse_arch, recording
from iris.tools.compile_check.world import compile_only_context

__all__ = ["DEFAULT_WORLDS", "Failure", "Report", "compile_check"]

#: The world sizes checked unless others are asked for.
DEFAULT_WORLDS = (1, 2, 3, 4, 5, 8)


@attrs.frozen(kw_only=True)
class Failure:
    """One kernel launch that did not compile, a call that failed before it launched, a PTX
    expectation that does not hold, or a launch site no call reached."""

    family: str
    """The kernel's name (or ``"host"``, ``"coverage"``)."""
    where: str
    """Which backend, world, rank and call."""
    arguments: str
    """The kernel's compile-time arguments and signature."""
    message: str
    """The compiler's message (or what else failed)."""

    def __str__(self) -> str:
        arguments = f"\n    arguments: {self.arguments}" if self.arguments else ""
        message = "\n    ".join(self.message.strip().splitlines()[-30:])
        return f"FAILED {self.family}: {self.where}{arguments}\n    {message}"


@attrs.frozen(kw_only=True)
class Report:
    """What :func:`compile_check` compiled and what failed."""

    arch: str
    worlds: tuple[int, ...]
    backends: tuple[str, ...]
    compiled: dict[str, int]
    """Distinct launches compiled, by kernel family."""
    launches: int
    """Launches recorded (many compile alike)."""
    failures: tuple[Failure, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def lines(self) -> list[str]:
        """One line per kernel family with its counts, then every failure."""
        failed = Counter(f.family for f in self.failures)
        width = max((len(name) for name in self.compiled), default=10)
        out = [f"iris compile-check: {self.arch}, worlds {','.join(map(str, self.worlds))}, backends "
               f"{', '.join(self.backends)}"]
        for family in sorted(self.compiled):
            out.append(f"  {family:<{width}}  {self.compiled[family]:5d} compiled  {failed.get(family, 0):4d} failed")
        out.append(f"{sum(self.compiled.values())} distinct kernels from {self.launches} launches in "
                   f"{self.seconds:.0f} s: {len(self.failures)} failure(s)")
        out += [str(f) for f in self.failures]
        return out


def compile_check(worlds: Iterable[int] = DEFAULT_WORLDS, *, arch: str = "sm_90", backends: Iterable[str] | None = None,
                  only: Iterable[str] | None = None, ranks: Iterable[int] | None = None, focused: bool = False,
                  jobs: int | None = None, progress: Callable[[str], None] | None = None) -> Report:
    """Compile every kernel the installed backends launch at each of ``worlds`` for ``arch``
    (see the module), with ``jobs`` compiler processes (default: the usable cores); ``only``:
    compile just these kernel families (names as the report prints them; the launch-site
    coverage is checked all the same); ``ranks``: only these ranks of each world (default:
    every rank up to 4 ranks, the first and last above); ``focused``: only the focused calls
    (each algorithm, method and root once, one dtype), not the full ones. Needs no GPU, and
    Triton's interpreter off (``TRITON_INTERPRET`` unset when Triton was imported)."""
    from triton import knobs

    import iris

    start = time.perf_counter()
    worlds = tuple(sorted(set(worlds)))
    if not worlds or min(worlds) < 1:
        raise ValueError(f"worlds must be positive world sizes, got {worlds}")
    ranks = None if ranks is None else tuple(ranks)
    if ranks is not None and (not ranks or min(ranks) < 0 or min(ranks) >= max(worlds)):
        raise ValueError(f"ranks must be ranks (0 and up) of at least one of the worlds {worlds}, got {ranks}")
    if knobs.runtime.interpret:
        raise RuntimeError("iris compile-check compiles kernels: run it with TRITON_INTERPRET unset (the "
                           "interpreter was on when Triton was imported)")
    target = parse_arch(arch)
    names = tuple(backends) if backends is not None else tuple(sorted(
        (name for name in iris.available_backends() if _compiles_for_gpus(name)),
        key=lambda name: name != DEFAULT_BACKEND))  # the default backend first: every kernel of it is checked
    say = progress or (lambda message: None)
    launches, failures = _record(contexts_checked(names, worlds, ranks, not focused), target, say)
    distinct = list({launch.identity: launch for launch in launches}.values())
    if only is not None:
        wanted = set(only)
        distinct = [launch for launch in distinct if launch.family in wanted]
    say(f"compiling {len(distinct)} distinct kernels from {len(launches)} launches")
    failures += _compile_all(distinct, target, jobs or len(os.sched_getaffinity(0)))
    if max(worlds) > 1:  # a world of one exchanges nothing: the kernels that announce calls to peers never run
        failures += [Failure(family="coverage", where=site, arguments="", message="no call of the check launches it")
                     for site in uncovered_launch_sites(names, {launch.kernel.fn.__name__ for launch in launches})]
    compiled = Counter(launch.family for launch in distinct)
    return Report(arch=arch, worlds=worlds, backends=names, compiled=dict(compiled), launches=len(launches),
                  failures=tuple(failures), seconds=time.perf_counter() - start)


def _compiles_for_gpus(backend: str) -> bool:
    from iris.registry import get_backend

    return "cuda" in get_backend(backend).device_types


def _record(contexts: list[Checked], target, say) -> tuple[list[Launch], list[Failure]]:
    """Every launch of every call of the ``contexts``, and the calls that failed before launching."""
    where = [""]
    failures: list[Failure] = []
    with recording(target, where) as launches:
        for checked in contexts:
            label = (f"{checked.backend}, world {checked.world_size}, rank {checked.rank}"
                     + (", tracing" if checked.tracing else ""))
            say(f"recording {label}")
            ctx = compile_only_context(checked.backend, checked.rank, checked.world_size, tracing=checked.tracing)
            try:
                for what, call in calls(ctx, checked.full):
                    where[0] = f"{label}: {what}"
                    try:
                        call()
                    except Exception:  # noqa: BLE001 (reported with its traceback)
                        failures.append(Failure(family="host", where=where[0], arguments="",
                                                message=traceback.format_exc()))
            finally:
                ctx.destroy()
    return launches, failures


def _compile_all(launches: list[Launch], target, jobs: int) -> list[Failure]:
    """Compile ``launches`` in ``jobs`` forked processes (they inherit the recorded launches). A
    compiler that crashes its process (an assertion in its C++ passes aborts it) fails the launch
    it was compiling, and a new process takes over the rest."""
    global _TO_COMPILE
    _TO_COMPILE = (launches, target)
    logs = tempfile.TemporaryDirectory(prefix="iris-compile-check-")
    context = multiprocessing.get_context("fork")
    tasks, results = context.Queue(), context.Queue()
    for index in range(len(launches)):
        tasks.put(index)
    workers = min(jobs, len(launches))
    for _ in range(workers):
        tasks.put(None)  # one end marker per process
    failures: list[Failure] = []
    running: dict[int, tuple] = {}  # pid: (process, index it compiles or None)
    done = 0
    try:
        for _ in range(workers):
            process = context.Process(target=_compile_worker, args=(tasks, results, logs.name), daemon=True)
            process.start()
            running[process.pid] = (process, None)
        while done < len(launches):
            try:
                kind, pid, index, found = results.get(timeout=1.0)
            except queue.Empty:
                for pid, (process, index) in list(running.items()):
                    if not process.is_alive():  # crashed (or ended: then it compiled all it took)
                        del running[pid]
                        if process.exitcode != 0 and index is not None:
                            launch = launches[index]
                            failures.append(Failure(family=launch.family, where=launch.where,
                                                    arguments=launch.arguments(),
                                                    message=f"the compiler crashed its process (exit code "
                                                            f"{process.exitcode}):\n{_output_of(logs.name, pid)}"))
                            done += 1
                            replacement = context.Process(target=_compile_worker, args=(tasks, results, logs.name),
                                                          daemon=True)
                            replacement.start()
                            running[replacement.pid] = (replacement, None)
                continue
            if kind == "start":
                running[pid] = (running[pid][0], index)
            else:
                running[pid] = (running[pid][0], None)
                failures += found
                done += 1
    finally:
        for process, _ in running.values():
            process.kill()
        logs.cleanup()
        _TO_COMPILE = None
    return failures


def _output_of(directory: str, pid: int, lines: int = 12) -> str:
    """The last lines a compiler process wrote (its stderr: an assertion's message, say)."""
    try:
        text = (Path(directory) / f"{pid}.log").read_text(errors="replace")
    except OSError:
        return "(no output)"
    return "\n".join(line[:300] for line in text.strip().splitlines()[-lines:] if line.strip())


def _compile_worker(tasks, results, logs: str) -> None:
    """Compile the launches ``tasks`` names until its end marker; the compiler's own output
    (MLIR dumps of a failing pass, say) goes to this process's log, not the check's output."""
    pid = os.getpid()
    log = os.open(Path(logs) / f"{pid}.log", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    while (index := tasks.get()) is not None:
        results.put(("start", pid, index, None))
        before = os.lseek(log, 0, os.SEEK_CUR)
        found = _compile_one(index)
        said = _new_output(log, before)
        if said:  # what the compiler printed before it failed (a C++ pass's assertion, say)
            found = [attrs.evolve(f, message=f"{said}\n{f.message}") for f in found]  # the error itself last
        results.put(("done", pid, index, found))


def _new_output(log: int, start: int, lines: int = 8) -> str:
    """The last lines written to ``log`` (a file descriptor) from ``start`` on."""
    end = os.lseek(log, 0, os.SEEK_END)
    if end <= start:
        return ""
    text = os.pread(log, min(end - start, 1 << 16), max(start, end - (1 << 16))).decode(errors="replace")
    return "\n".join(line[:300] for line in text.strip().splitlines()[-lines:] if line.strip())


def _compile_one(index: int) -> list[Failure]:
    launches, target = _TO_COMPILE
    launch = launches[index]
    try:
        ptx, report = reported(lambda: compile_launch(launch, target))
        serialized = serialized_tensor_cores(ptx, target, launch.options.__dict__, report)
    except Exception as error:  # noqa: BLE001 (the compiler's or assembler's message is the report)
        return [Failure(family=launch.family, where=launch.where, arguments=launch.arguments(),
                        message=f"{type(error).__name__}: {error}")]
    problems = ptx_violations(launch, ptx) + [
        f"ptxas serializes the kernel's tensor-core (wgmma) instructions, a large share of the product's speed: {line}"
        for line in serialized]
    return [Failure(family=launch.family, where=launch.where, arguments=launch.arguments(), message=problem)
            for problem in problems]
