"""Per-machine tuning of the automatic choices, agreed by every rank and kept in a cache file.

The built-in tables of a backend (``iris_triton.tuning``) were measured on one machine. On
another, :func:`tune_collectives` (``ctx.ccl.tune``) and :func:`tune_all_reduce_rmsnorm`
(``ctx.ops.tune``) time the candidates on the ranks themselves and record, per collective (or
fused operation), dtype and size bucket, the candidate that was fastest on the slowest rank:

- a collective's candidates are the registered algorithms that apply to the call
  (:meth:`iris.collectives.Algorithm.refusal`); its buckets are powers of two of bytes per rank,
  bucket ``b`` holding the sizes in ``(b / 2, b]``;
- ``all_reduce_rmsnorm``'s candidates are its methods; its buckets are powers of two of tokens, for
  one hidden size.

Agreement: every rank must time the same candidates in the same order (checked first, every
rank raising with the difference if not). Each candidate's result is compared with a torch
reference on every rank, and one that is wrong on any rank is dropped on all. The per-rank
medians are reduced to their maximum over torch.distributed (the slowest rank decides: a
collective is as fast as its last rank), the fastest candidate by that figure is chosen (the
first one in order on a tie), and rank 0's decisions are broadcast, so every rank holds the same
table whatever rounding or ties it saw.

The table is saved as JSON in the cache directory (``$IRIS_TUNING_CACHE``, else
``$XDG_CACHE_HOME/iris/tuning``, else ``~/.cache/iris/tuning``), one file per :class:`CacheKey`
(device model, world size, link topology, iris version). ``iris.create()`` loads it (:func:`load`):
rank 0 reads and checks the file, then broadcasts it, so the ranks never disagree. A file that is
unreadable or made for another key, and an entry naming an algorithm no longer installed, are
logged as warnings and left to the built-in tables; so is any call the table has no entry for,
or whose tuned algorithm does not apply to it (a reduction it does not take, a group's call).
``IRIS_TUNING=off`` leaves the cache unread.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from iris.collectives import (COLLECTIVES, MOVED_ONLY_DTYPES, POINT_TO_POINT, REDUCING, SAME_SIZE_INTEGER,
                               SUPPORTED_DTYPES, UNEVEN, Algorithm, CallShape, algorithm_registry)
from iris.config import DEFAULT_HEAP_SIZE, parse_size
from iris.errors import IrisError
from iris.timing import do_bench

__all__ = ["CACHE_ENV", "SWITCH_ENV", "TUNABLE", "CacheKey", "Entry", "Trial", "TuningTable", "bucket",
           "cache_directory", "format_table", "link_topology", "load", "loading_enabled", "machine_key",
           "parse_dtype", "tune_all_reduce_rmsnorm", "tune_collectives", "tune_on_rank"]

#: The cache directory, when set.
CACHE_ENV = "IRIS_TUNING_CACHE"
#: ``off`` (or 0, false, no) leaves the cache unread at ``iris.create()``.
SWITCH_ENV = "IRIS_TUNING"
_OFF, _ON = frozenset({"off", "0", "false", "no"}), frozenset({"", "on", "1", "true", "yes"})
#: The version of the cache file's layout.
FORMAT = 1
#: The collectives that can be tuned: those whose calls have the same shape on every rank.
TUNABLE = tuple(c for c in COLLECTIVES if c not in POINT_TO_POINT + UNEVEN)
#: The fused operation whose automatic method can be tuned.
RMSNORM = "all_reduce_rmsnorm"
#: What is tuned when nothing is named, by device type: GPUs every power of two from 1 KiB to
#: 64 MiB (1 to 16384 tokens); CPU ranks, which run kernels in Triton's interpreter, a few small
#: sizes (their times only exercise the machinery).
DEFAULT_DTYPES = {"cuda": (torch.bfloat16, torch.float32), "cpu": (torch.float32,)}
DEFAULT_SIZES = {"cuda": tuple(1 << k for k in range(10, 27)), "cpu": (256, 1 << 10)}
DEFAULT_TOKENS = {"cuda": tuple(1 << k for k in range(15)), "cpu": (1, 4)}
#: Timed and untimed calls per candidate, by device type.
DEFAULT_REPEATS = {"cuda": 25, "cpu": 3}
WARMUP = {"cuda": 5, "cpu": 1}
#: The RMSNorm epsilon of the tuning calls.
EPS = 1e-6


def bucket(n: int) -> int:
    """The power of two at or above ``n``: the bucket ``(b / 2, b]`` that ``n`` falls in (0 for 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A dtype the collectives take, from its name (``"bfloat16"``) or itself."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else name
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; the collectives take "
                         f"{', '.join(map(_dtype_name, SUPPORTED_DTYPES))}")
    return dtype


# -- the table ------------------------------------------------------------------------------------------


@attrs.frozen
class CacheKey:
    """What a tuning holds for: the cache file of one key is never used under another."""

    device: str
    """``torch.cuda.get_device_name`` of rank 0's GPU, or ``"cpu"``."""
    world_size: int
    topology: str
    """The links between the machine's GPUs (:func:`link_topology`), or ``"shared-memory"``."""
    iris_version: str

    @property
    def file_name(self) -> str:
        """The cache file's name: readable, and unique to the key by its digest."""
        digest = hashlib.sha256(json.dumps(attrs.asdict(self), sort_keys=True).encode()).hexdigest()[:12]
        return f"{re.sub(r'[^A-Za-z0-9]+', '-', self.device).strip('-').lower()}-{self.world_size}ranks-{digest}.json"

    def describe(self) -> str:
        return (f"{self.device}, {self.world_size} ranks, topology {self.topology!r}, "
                f"iris {self.iris_version}")


@attrs.frozen
class Entry:
    """The decision of one collective (or fused operation), dtype and bucket."""

    chosen: str
    times: Mapping[str, float | None]
    """Each candidate's median milliseconds on the slowest rank, in the order timed; None for a
    candidate dropped because it was wrong on some rank."""


def _entry_key(what: str, dtype: torch.dtype | str, bucket_: tuple[int, ...]) -> tuple:
    return (what, dtype if isinstance(dtype, str) else _dtype_name(dtype), *bucket_)


@attrs.frozen
class TuningTable:
    """Tuned decisions of one :class:`CacheKey`, by ``(collective, dtype name, bucket of bytes per
    rank)`` and ``("all_reduce_rmsnorm", dtype name, hidden, bucket of tokens)``."""

    key: CacheKey
    entries: Mapping[tuple, Entry] = attrs.field(factory=dict)

    def choice(self, shape: CallShape) -> tuple[Algorithm, str | None] | None:
        """The tuned algorithm of a call of ``shape`` and the name of its tuned launch shape (None:
        the algorithm's own), if one is tuned for its bucket, installed and applies to it (with
        that launch shape); else None (the built-in choice)."""
        if not self.entries or shape.world_size != self.key.world_size:
            return None
        entry = self.entries.get(_entry_key(shape.collective, shape.dtype, (bucket(shape.nbytes),)))
        if entry is None:
            return None
        name, _, launch_shape = entry.chosen.partition("/")
        registry = algorithm_registry(shape.collective)
        if not registry.is_available(name):
            return None
        algorithm = registry.get(name)
        if algorithm.refusal(shape) is not None or (
                launch_shape and launch_shape not in algorithm.launch_shapes.get(shape.device_type, {})):
            return None
        return algorithm, launch_shape or None

    def algorithm(self, shape: CallShape) -> Algorithm | None:
        """The algorithm of :meth:`choice`, or None."""
        chosen = self.choice(shape)
        return None if chosen is None else chosen[0]

    def method(self, operation: str, methods: Iterable[str], world_size: int, dtype: torch.dtype,
               fixed: tuple[int, ...], rows: int) -> str | None:
        """The tuned method of ``operation`` (one of ``methods``) for ``rows`` rows of ``dtype`` at
        the ``fixed`` extents (all_reduce_rmsnorm: ``(hidden,)``; the matrix products: ``(N,
        K)``), or None (the built-in choice)."""
        if not self.entries or world_size != self.key.world_size:
            return None
        entry = self.entries.get(_entry_key(operation, dtype, (*fixed, bucket(rows))))
        return entry.chosen if entry is not None and entry.chosen in methods else None

    def merged(self, entries: Mapping[tuple, Entry]) -> "TuningTable":
        """This table with ``entries`` added (replacing those of the same keys)."""
        return TuningTable(self.key, {**self.entries, **entries})

    def to_json(self) -> dict:
        return {"format": FORMAT, "key": attrs.asdict(self.key),
                "entries": [{"what": k[0], "dtype": k[1], "bucket": list(k[2:]), "chosen": e.chosen,
                             "times": dict(e.times)} for k, e in sorted(self.entries.items())]}

    @classmethod
    def from_json(cls, data: Any) -> "TuningTable":
        """The table of a cache file's contents; ValueError saying what is malformed."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not an iris tuning cache of format {FORMAT}")
        key = data.get("key")
        if not isinstance(key, dict) or set(key) != {f.name for f in attrs.fields(CacheKey)}:
            raise ValueError("its key is malformed")
        entries = {}
        for item in data.get("entries", None) or []:
            fields = ("what", "dtype", "bucket", "chosen", "times")
            if not isinstance(item, dict) or set(item) != set(fields):
                raise ValueError(f"malformed entry {item!r}")
            what, dtype, extent, chosen, times = (item[f] for f in fields)
            if not (isinstance(what, str) and isinstance(chosen, str) and isinstance(times, dict)
                    and isinstance(extent, list) and extent and all(type(n) is int for n in extent)):
                raise ValueError(f"malformed entry {item!r}")
            if not all(t is None or isinstance(t, (int, float)) for t in times.values()):
                raise ValueError(f"malformed times in entry {item!r}")
            entries[_entry_key(what, _dtype_name(parse_dtype(dtype)), tuple(extent))] = Entry(chosen, times)
        return cls(CacheKey(**key), entries)


def format_table(table: TuningTable) -> str:
    """The table as text: one line per entry, with every candidate's slowest-rank time."""
    lines = [f"{'tuned':20s} {'dtype':9s} {'bucket':>18s}   {'chosen':12s} candidates (slowest rank, median)"]
    for key, entry in sorted(table.entries.items()):
        what, dtype, *extent = key
        if what == RMSNORM:
            where = f"{extent[1]} x {extent[0]}"  # tokens x hidden
        elif what in MATMULS:
            where = f"{extent[2]} x {extent[1]} x {extent[0]}"  # rows of A x K x N
        else:
            where = _size(extent[0])
        times = ", ".join(f"{name} {'dropped' if ms is None else f'{ms:.4f} ms'}" for name, ms in entry.times.items())
        lines.append(f"{what:20s} {dtype:9s} {where:>18s}   {entry.chosen:12s} {times}")
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


# -- the cache ------------------------------------------------------------------------------------------


def cache_directory() -> Path:
    """Where the cache files are: ``$IRIS_TUNING_CACHE``, else ``$XDG_CACHE_HOME/iris/tuning``,
    else ``~/.cache/iris/tuning``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "iris" / "tuning"


def loading_enabled() -> bool:
    """Whether ``iris.create()`` reads the cache (``IRIS_TUNING``, on unless ``off``)."""
    value = os.environ.get(SWITCH_ENV, "").strip().lower()
    if value not in _OFF | _ON:
        raise ValueError(f"{SWITCH_ENV}={os.environ[SWITCH_ENV]!r}: use 'off' to leave the tuning cache unread, "
                         f"'on' (or unset) to read it")
    return value not in _OFF


def _nvidia_smi_links() -> str:
    """The link types between GPU pairs in ``nvidia-smi topo -m`` (``NV18``, ``PIX``, ...), sorted,
    or ``unknown`` when it cannot be read."""
    if shutil.which("nvidia-smi") is None:
        return "unknown"
    try:
        proc = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    rows = [re.sub(r"\x1b\[[0-9;]*m", "", line).split("\t") for line in proc.stdout.splitlines()]
    header = next((row for row in rows if any(cell.strip().startswith("GPU") for cell in row)), None)
    if header is None:
        return "unknown"
    gpu_columns = [i for i, cell in enumerate(header) if re.fullmatch(r"GPU\d+", cell.strip())]
    links = {row[i].strip() for row in rows if re.fullmatch(r"GPU\d+", row[0].strip())
             for i in gpu_columns if i < len(row) and row[i].strip() not in ("X", "")}
    return ",".join(sorted(links)) or "none"


@functools.cache
def link_topology(device_type: str) -> str:
    """This machine's links between its GPUs: which pairs have peer access (torch) and the link
    types ``nvidia-smi topo -m`` names; ``"shared-memory"`` for CPU ranks."""
    if device_type != "cuda":
        return "shared-memory"
    count = torch.cuda.device_count()
    access = ",".join("".join("X" if i == j else "P" if torch.cuda.can_device_access_peer(i, j) else "-"
                              for j in range(count)) for i in range(count))
    return f"peer-access {access or 'none'}; links {_nvidia_smi_links()}"


def _iris_version() -> str:
    try:
        return importlib.metadata.version("iris")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def machine_key(ctx) -> CacheKey:
    """The cache key of ``ctx`` as this rank sees it (rank 0's is the one used)."""
    device = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    return CacheKey(device=device, world_size=ctx.world_size, topology=link_topology(ctx.device.type),
                    iris_version=_iris_version())


def _read(path: Path, key: CacheKey, warn: Callable[[str], None]) -> TuningTable:
    """The table of ``path`` if it is a readable cache of ``key``, with only the entries whose
    collective algorithms are installed; else an empty table. Each problem is warned of."""
    empty = TuningTable(key)
    if not path.is_file():
        return empty
    fallback = "the built-in tables are used instead"
    try:
        table = TuningTable.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as error:
        warn(f"the tuning cache {path} cannot be read ({error}); {fallback} (run `iris tune` to rewrite it)")
        return empty
    if table.key != key:
        warn(f"the tuning cache {path} was made for {table.key.describe()}, not for this machine "
             f"({key.describe()}); {fallback} (run `iris tune` here)")
        return empty
    kept = {}
    for entry_key, entry in table.entries.items():
        what = entry_key[0]
        if what in TUNABLE and not algorithm_registry(what).is_available(entry.chosen.partition("/")[0]):
            warn(f"the tuning cache {path} chooses {what} algorithm {entry.chosen!r} for {entry_key[1]} up to "
                 f"{entry_key[2]} bytes, which is not installed; that size falls back to the built-in choice")
            continue
        kept[entry_key] = entry
    return TuningTable(key, kept)


def load(ctx) -> TuningTable:
    """The tuned table of ``ctx`` (collective): rank 0 reads its cache file, unless
    ``IRIS_TUNING=off``, and broadcasts it."""
    enabled = loading_enabled()  # a bad value raises on every rank, before the exchange
    table = None
    if ctx.rank == 0:
        key = machine_key(ctx)
        table = _read(cache_directory() / key.file_name, key, ctx.warning) if enabled else TuningTable(key)
    return ctx.comm.broadcast_object(table, 0)


def _save(ctx, entries: Mapping[tuple, Entry]) -> None:
    """Add ``entries`` to ``ctx``'s cache file (rank 0 writes, every rank raises if it cannot;
    collective)."""
    failure = None
    if ctx.rank == 0:
        path = cache_directory() / ctx.tuning.key.file_name
        try:
            table = _read(path, ctx.tuning.key, ctx.warning).merged(entries)
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(table.to_json(), indent=1) + "\n")
            os.replace(temporary, path)
        except OSError as error:
            failure = (f"cannot write the tuning cache {path}: {error}; set {CACHE_ENV} to a writable directory, or "
                       f"tune with save=False")
    failure = ctx.comm.broadcast_object(failure, 0)
    if failure is not None:
        raise IrisError(failure)


# -- timing and deciding --------------------------------------------------------------------------------


@attrs.frozen
class Trial:
    """One candidate of one tuned bucket, as a timer gets it: ``run()`` makes the call (on
    every rank), ``reset()`` restores its inputs (untimed, before each call)."""

    what: str
    dtype: torch.dtype
    bucket: tuple[int, ...]
    """Collectives: (bytes per rank,); all_reduce_rmsnorm: (hidden, tokens)."""
    candidate: str
    run: Callable[[], Any]
    reset: Callable[[], Any]


@attrs.frozen
class _Case:
    """The candidates of one tuned bucket and the call that tries them."""

    what: str
    dtype: torch.dtype
    bucket: tuple[int, ...]
    candidates: tuple[str, ...]
    run: Callable[[str], Any]
    """Makes the call with one candidate."""
    reset: Callable[[], Any]
    correct: Callable[[], bool]
    """Whether the call's result on this rank matches the torch reference."""

    @property
    def key(self) -> tuple:
        return _entry_key(self.what, self.dtype, self.bucket)

    def describe(self) -> str:
        return f"{self.what} {_dtype_name(self.dtype)} {'x'.join(map(str, self.bucket))}"


def _benchmark(ctx, repeats: int) -> Callable[[Trial], float]:
    """The default timer: the median of ``repeats`` calls in milliseconds, the ranks lined up by
    a host barrier before each (CUDA events on GPUs, ``perf_counter`` on CPU ranks)."""
    def timer(trial: Trial) -> float:
        return do_bench(trial.run, barrier_fn=ctx.barrier, preamble_fn=trial.reset,
                        n_warmup=WARMUP[ctx.device.type], n_repeat=repeats, return_mode="median", device=ctx.device)

    return timer


def _check_same_plan(ctx, cases: list[_Case]) -> None:
    """Every rank has the same buckets and candidates, in the same order, or every rank raises."""
    plans = ctx.comm.all_gather_object([(case.describe(), case.candidates) for case in cases])
    for rank, plan in enumerate(plans):
        if plan != plans[0]:
            mine, theirs = dict(plans[0]), dict(plan)
            differ = next((name for name in {**mine, **theirs} if mine.get(name) != theirs.get(name)), None)
            what = (f"for {differ}, rank 0 has {mine.get(differ)} and rank {rank} {theirs.get(differ)}" if differ
                    else f"rank 0 and rank {rank} list the buckets in another order")
            raise IrisError(f"tuning: the ranks would time different candidates: {what}; every rank needs the same "
                            f"iris plugins installed and the same tune() arguments")


def _is_right(ctx, case: _Case, candidate: str) -> bool:
    """Whether ``candidate`` gives the reference's result on this rank (a call that raises does
    not, unless it failed the context, which raises)."""
    case.reset()
    try:
        case.run(candidate)
        right = bool(case.correct())
    except Exception as error:
        if ctx.failed:
            raise
        ctx.warning(f"tuning {case.describe()}: {candidate} raised {type(error).__name__}: {error}; dropped")
        return False
    if not right:
        ctx.warning(f"tuning {case.describe()}: {candidate} gave a wrong result on this rank; dropped")
    return right


def _nanoseconds(milliseconds: float, trial: Trial) -> int:
    if isinstance(milliseconds, bool) or not isinstance(milliseconds, (int, float)) or \
            not math.isfinite(milliseconds) or milliseconds < 0:
        raise ValueError(f"tuning {trial.what}: the timer returned {milliseconds!r} for {trial.candidate}; it must "
                         f"return milliseconds (a finite number >= 0)")
    return round(milliseconds * 1e6)


def _decide(ctx, cases: list[_Case], timer: Callable[[Trial], float]) -> dict[tuple, Entry]:
    """Every case's decision, the same on every rank (see the module)."""
    _check_same_plan(ctx, cases)
    decided = {}
    for case in filter(lambda case: case.candidates, cases):  # the same on every rank, as checked
        wrong = ctx.comm.host_max([0 if _is_right(ctx, case, c) else 1 for c in case.candidates])
        kept = [c for c, w in zip(case.candidates, wrong) if not w]
        if not kept:
            ctx.warning(f"tuning {case.describe()}: no candidate was right on every rank; nothing is recorded")
            continue
        trials = [Trial(case.what, case.dtype, case.bucket, c, functools.partial(case.run, c), case.reset)
                  for c in kept]
        slowest = ctx.comm.host_max([_nanoseconds(timer(trial), trial) for trial in trials])
        times = dict.fromkeys(case.candidates) | {c: ns / 1e6 for c, ns in zip(kept, slowest)}
        chosen = kept[min(range(len(kept)), key=slowest.__getitem__)]  # the first of equal times
        decided[case.key] = Entry(chosen, times)
    return ctx.comm.broadcast_object(decided, 0)


def _apply(ctx, decided: dict[tuple, Entry], save: bool) -> TuningTable:
    """Put ``decided`` in force on ``ctx`` (and in its cache file if ``save``); the table of them."""
    ctx.tuning = ctx.tuning.merged(decided)
    ctx._torch_ccl._repeats.clear()  # an automatic call's repeat would keep its earlier algorithm
    if save and decided:
        _save(ctx, decided)
    return TuningTable(ctx.tuning.key, decided)


# -- the collectives' cases -----------------------------------------------------------------------------


def _data(dtype: torch.dtype, n: int, *seed) -> torch.Tensor:
    """``n`` seeded elements of ``dtype``, alike on every rank for one seed; small integers, so
    that sums over ranks do not overflow."""
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(repr(seed).encode()).digest()[:8], "little"))
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 4, (n,), generator=g, dtype=dtype)


def _reduced(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sum of ``parts``, 16-bit floats accumulated in float32 (as the kernels do)."""
    wide = torch.stack([p.float() if p.dtype in (torch.bfloat16, torch.float16) else p for p in parts])
    return wide.sum(0).to(parts[0].dtype)


def _matches(result: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit for what is moved (integers, fp8); close for reduced floats."""
    if not result.dtype.is_floating_point or result.dtype in MOVED_ONLY_DTYPES:
        bits = SAME_SIZE_INTEGER[result.element_size()]
        return torch.equal(result.view(bits), expected.view(bits))
    tolerance = 1e-4 if result.dtype == torch.float32 else 2e-2
    return torch.allclose(result.float(), expected.float(), rtol=tolerance, atol=tolerance)


def _elements(collective: str, dtype: torch.dtype, nbytes: int, world: int) -> int:
    """Elements of the input per rank (scatter: of the root's) of a call in bucket ``nbytes``:
    as many as fit, a multiple of the world size where the collective splits the input."""
    n = nbytes // dtype.itemsize
    if collective in ("reduce_scatter", "all_to_all", "scatter"):
        n -= n % world
    if n < 1 or bucket(n * dtype.itemsize) != nbytes:
        raise ValueError(f"{collective}: the size bucket of {nbytes} bytes holds no {_dtype_name(dtype)} call on "
                         f"{world} ranks (splitting collectives need a multiple of the world size); tune sizes of at "
                         f"least {2 * world * dtype.itemsize} bytes")
    return n


def _collective_case(ccl, collective: str, dtype: torch.dtype, nbytes: int) -> _Case:
    """The case of ``collective`` on ``dtype`` in bucket ``nbytes``: seeded inputs, every rank's
    known to every rank, so each computes the reference; root 0, reductions summing."""
    ctx = ccl._context
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    n = _elements(collective, dtype, nbytes, world)
    inputs = [_data(dtype, n, collective, _dtype_name(dtype), nbytes, q).to(device) for q in range(world)]
    mine, m = inputs[rank], n // world
    if collective in ("all_reduce", "broadcast", "reduce"):  # in place: reset restores the input
        output, source = mine.clone(), mine
    else:
        source = None
        output_numel = {"all_gather": world * n, "gather": world * n, "reduce_scatter": m, "scatter": m}
        output = torch.empty(output_numel.get(collective, n), dtype=dtype, device=device)
    calls = {  # the call, and its result's reference (made only for the collective tuned)
        "all_reduce": (lambda a: ccl.all_reduce(output, "sum", algorithm=a), lambda: _reduced(inputs)),
        "broadcast": (lambda a: ccl.broadcast(output, 0, algorithm=a), lambda: inputs[0]),
        "reduce": (lambda a: ccl.reduce(output, 0, "sum", algorithm=a),
                   lambda: _reduced(inputs) if rank == 0 else mine),
        "all_gather": (lambda a: ccl.all_gather(output, mine, algorithm=a), lambda: torch.cat(inputs)),
        "gather": (lambda a: ccl.gather(output if rank == 0 else None, mine, 0, algorithm=a),
                   lambda: torch.cat(inputs) if rank == 0 else None),
        "reduce_scatter": (lambda a: ccl.reduce_scatter(output, mine, "sum", algorithm=a),
                           lambda: _reduced(inputs)[rank * m:(rank + 1) * m]),
        "all_to_all": (lambda a: ccl.all_to_all(output, mine, algorithm=a),
                       lambda: torch.stack(inputs).view(world, world, m)[:, rank].reshape(-1)),
        "scatter": (lambda a: ccl.scatter(output, mine if rank == 0 else None, 0, algorithm=a),
                    lambda: inputs[0][rank * m:(rank + 1) * m]),
    }
    run, reference = calls[collective]
    expected = reference()
    bits = output.view(SAME_SIZE_INTEGER[output.element_size()])

    def reset():
        if source is not None:
            output.copy_(source)
        else:
            bits.fill_(-1)  # all-ones (NaN): a result that is not written is not right

    def correct() -> bool:
        return expected is None or _matches(output, expected)

    probe = torch.empty(n, dtype=dtype, device="meta")
    candidates = []
    for name in ccl.algorithms(collective, applying_to=probe, op="sum" if collective in REDUCING else None):
        shapes = algorithm_registry(collective).get(name).launch_shapes.get(device.type, {})
        candidates += [f"{name}/{shape}" for shape in shapes] if len(shapes) > 1 else [name]  # each launch shape
    return _Case(collective, dtype, (nbytes,), tuple(candidates), run, reset, correct)


def _normalized_sizes(sizes: Iterable[int | str]) -> list[int]:
    return sorted({bucket(parse_size(size)) for size in sizes})


def tune_collectives(ccl, collectives: Iterable[str] | None = None, dtypes: Iterable | None = None,
                     sizes: Iterable[int | str] | None = None, *, repeats: int | None = None, save: bool = True,
                     timer: Callable[[Trial], float] | None = None) -> TuningTable:
    """``ctx.ccl.tune``: time every applying algorithm of ``collectives`` (default: each tunable
    one with more than one algorithm installed) for each of ``dtypes`` and size buckets
    (``sizes``: bytes per rank or strings such as ``"64KiB"``, each rounded up to its power of
    two); put the decisions in force on the context and, if ``save``, in the cache file.
    ``timer(trial)`` returns a rank's milliseconds for one :class:`Trial` (default: the median of
    ``repeats`` calls). Collective. Returns the table of this run's decisions."""
    ctx = ccl._context
    device = ctx.device.type
    if collectives is None:
        names = [c for c in TUNABLE if len(algorithm_registry(c).names()) > 1]
    else:
        names = list(collectives)
        unknown = [c for c in names if c not in TUNABLE]
        if unknown:
            raise ValueError(f"cannot tune {', '.join(unknown)}; tunable collectives: {', '.join(TUNABLE)}")
    kinds = [parse_dtype(d) for d in (DEFAULT_DTYPES[device] if dtypes is None else dtypes)]
    buckets = _normalized_sizes(DEFAULT_SIZES[device] if sizes is None else sizes)
    if not buckets or not kinds:
        raise ValueError("tune needs at least one size and one dtype")
    cases = [_collective_case(ccl, c, d, b) for c in names for d in kinds for b in buckets
             if not (c in REDUCING and d in MOVED_ONLY_DTYPES)]
    if names and not cases:
        raise ValueError(f"none of the dtypes {', '.join(map(_dtype_name, kinds))} can be reduced by "
                         f"{', '.join(names)}")
    return _apply(ctx, _decide(ctx, cases, timer or _benchmark(ctx, repeats or DEFAULT_REPEATS[device])), save)


# -- all_reduce_rmsnorm's cases -------------------------------------------------------------------------


def _rmsnorm_case(ops, methods: tuple[str, ...], dtype: torch.dtype, hidden: int, tokens: int) -> _Case:
    """The case of ``all_reduce_rmsnorm`` on ``tokens x hidden`` of ``dtype``: seeded inputs (the
    residual and weight alike on every rank, as in a tensor-parallel layer), the reference
    computed in float32 from every rank's ``x``."""
    ctx = ops._context
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    seed = (RMSNORM, _dtype_name(dtype), hidden, tokens)
    xs = [_data(dtype, tokens * hidden, *seed, q).view(tokens, hidden).to(device) for q in range(world)]
    residual = _data(dtype, tokens * hidden, *seed, "residual").view(tokens, hidden).to(device)  # replicated
    weight = _data(dtype, hidden, *seed, "weight").to(device)
    s = torch.stack([x.float() for x in xs]).sum(0) + residual.float()
    expected = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(dtype)
    out = torch.empty_like(expected)

    def run(method: str):
        ops.all_reduce_rmsnorm(out, xs[rank], residual, weight, EPS, method=method)

    return _Case(RMSNORM, dtype, (hidden, tokens), methods, run, lambda: out.fill_(float("nan")),
                 lambda: _matches(out, expected))


def tune_all_reduce_rmsnorm(ops, methods: Iterable[str], hidden: int, tokens: Iterable[int] | None = None,
                            dtypes: Iterable | None = None, *, repeats: int | None = None, save: bool = True,
                            timer: Callable[[Trial], float] | None = None) -> TuningTable:
    """``ctx.ops.tune``: time each of ``methods`` of ``all_reduce_rmsnorm`` for rows of
    ``hidden`` elements, each of ``dtypes`` and token buckets (``tokens``, each rounded up to its
    power of two), as :func:`tune_collectives` does for the collectives. Collective."""
    ctx = ops._context
    device = ctx.device.type
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden must be the number of elements of a row (an int >= 1), got {hidden!r}")
    counts = sorted({bucket(t) for t in (DEFAULT_TOKENS[device] if tokens is None else tokens)})
    if not counts or counts[0] < 1:
        raise ValueError(f"tokens must be numbers of rows >= 1, got {tokens!r}")
    kinds = [parse_dtype(d) for d in ((torch.bfloat16,) if dtypes is None else dtypes)]
    cases = [_rmsnorm_case(ops, tuple(methods), d, hidden, t) for d in kinds for t in counts]
    return _apply(ctx, _decide(ctx, cases, timer or _benchmark(ctx, repeats or DEFAULT_REPEATS[device])), save)


#: The fused matrix products whose automatic method is tuned (ctx.ops.tune_matmul).
MATMULS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def _matmul_case(ops, operation: str, methods: tuple[str, ...], dtype: torch.dtype, n: int, k: int,
                 rows_bucket: int, rows: int) -> _Case:
    """The case of ``operation`` in bucket ``rows_bucket``, timed with ``rows`` rows of A on each
    rank (all_gather_matmul: its shard; the others: a multiple of the world size) times a
    ``k x n`` B, the same on every rank; the reference computed in float32 from every rank's A."""
    ctx = ops._context
    world, rank, device = ctx.world_size, ctx.rank, ctx.device
    seed = (operation, _dtype_name(dtype), n, k, rows)
    parts = [_data(dtype, rows * k, *seed, q).view(rows, k).to(device) for q in range(world)]
    b = _data(dtype, k * n, *seed, "b").view(k, n).to(device)
    if operation == "all_gather_matmul":
        expected = torch.cat(parts).float() @ b.float()
    else:
        expected = torch.stack([p.float() @ b.float() for p in parts]).sum(0)
        if operation == "matmul_reduce_scatter":
            share = rows // world
            expected = expected[rank * share:(rank + 1) * share]
    out = torch.empty(expected.shape, dtype=dtype, device=device)
    call = getattr(ops, operation)

    def correct() -> bool:  # a product of k terms: its error relative to the whole result
        return bool((out.float() - expected).norm() <= 2e-2 * expected.norm())

    return _Case(operation, dtype, (n, k, rows_bucket), methods,
                 lambda method: call(out, parts[rank], b, method=method),
                 lambda: out.fill_(float("nan")), correct)


def tune_matmul(ops, operation: str, methods: Iterable[str], n: int, k: int, rows: Iterable[int] | None = None,
                dtypes: Iterable | None = None, *, repeats: int | None = None, save: bool = True,
                timer: Callable[[Trial], float] | None = None) -> TuningTable:
    """``ctx.ops.tune_matmul``: time each of ``methods`` of the fused product ``operation`` for a
    ``k x n`` B, each of ``dtypes`` (default bfloat16) and buckets of the rows of A on each rank
    (``rows``, each rounded up to its power of two and timed at the largest multiple of the world
    size in it), as :func:`tune_collectives` does for the collectives. Collective."""
    ctx = ops._context
    device, world = ctx.device.type, ctx.world_size
    if operation not in MATMULS:
        raise ValueError(f"tune_matmul: operation must be one of {', '.join(MATMULS)}, got {operation!r}")
    for name, extent in (("n", n), ("k", k)):
        if isinstance(extent, bool) or not isinstance(extent, int) or extent < 1:
            raise ValueError(f"tune_matmul: {name} must be an int >= 1, got {extent!r}")
    counts = sorted({bucket(r) for r in (DEFAULT_TOKENS[device] if rows is None else rows)})
    if not counts or counts[0] < 1:
        raise ValueError(f"tune_matmul: rows must be numbers of rows >= 1, got {rows!r}")
    divisor = 1 if operation == "all_gather_matmul" else world
    timed = [(c, c - c % divisor) for c in counts if c - c % divisor > c // 2]  # a multiple of the world in it
    kinds = [parse_dtype(d) for d in ((torch.bfloat16,) if dtypes is None else dtypes)]
    cases = [_matmul_case(ops, operation, tuple(methods), d, n, k, c, r) for d in kinds for c, r in timed]
    return _apply(ctx, _decide(ctx, cases, timer or _benchmark(ctx, repeats or DEFAULT_REPEATS[device])), save)


# -- iris tune ------------------------------------------------------------------------------------------


def tuning_heap_size(device: str, world: int, largest: int) -> int:
    """A heap that holds the workspaces of the largest tuned call (two slots of every rank's
    input, for each algorithm's workspace), and at least the default."""
    return max(DEFAULT_HEAP_SIZE[device], 8 * world * largest + (64 << 20))


def tune_on_rank(rank: int, options: dict) -> str | None:
    """One rank of ``iris tune``: a context, the tuning ``options`` ask for, saved; rank 0
    returns the table as text and where it was saved."""
    import iris

    device, world = options["device"], options["nprocs"]
    largest = max(_normalized_sizes(options["sizes"] or DEFAULT_SIZES[device]))
    if options["hidden"]:
        tokens = options["tokens"] or DEFAULT_TOKENS[device]
        largest = max(largest, 4 * bucket(max(tokens)) * options["hidden"])
    ctx = iris.create(heap_size=tuning_heap_size(device, world, largest))
    try:
        tuned = ctx.ccl.tune(options["collectives"], options["dtypes"], options["sizes"],
                             repeats=options["repeats"])
        if options["hidden"]:
            tuned = tuned.merged(ctx.ops.tune(options["hidden"], options["tokens"], options["dtypes"],
                                              repeats=options["repeats"]).entries)
        text = f"{format_table(tuned)}\n\nsaved in {cache_directory() / tuned.key.file_name}"
        ctx.barrier()
    finally:
        ctx.destroy()
    return text if rank == 0 else None
