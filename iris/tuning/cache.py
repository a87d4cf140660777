"""The tuning cache: where its files are, whether ``iris.create()`` reads them, the machine's
key (device, world size, link topology, iris version), and reading (:func:`load`) and saving them,
rank 0 doing the file work and broadcasting, so the ranks never disagree."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from iris.collectives import algorithm_registry
from iris.errors import IrisError
from iris.tuning.table import TUNABLE, CacheKey, Entry, TuningTable

#: The cache directory, when set.
CACHE_ENV = "IRIS_TUNING_CACHE"
#: ``off`` (or 0, false, no) leaves the cache unread at ``iris.create()``.
SWITCH_ENV = "IRIS_TUNING"
_OFF, _ON = frozenset({"off", "0", "false", "no"}), frozenset({"", "on", "1", "true", "yes"})


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
