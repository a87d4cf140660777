"""The tuned table: its keys (size buckets, dtype names, :class:`CacheKey`), its decisions
(:class:`Entry`), the lookups that put them in force (:class:`TuningTable`), its JSON form and its
text (:func:`format_table`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch

from iris.collectives import (COLLECTIVES, POINT_TO_POINT, SUPPORTED_DTYPES, UNEVEN, Algorithm, CallShape,
                               algorithm_registry)

#: The version of the cache file's layout.
FORMAT = 1
#: The collectives that can be tuned: those whose calls have the same shape on every rank.
TUNABLE = tuple(c for c in COLLECTIVES if c not in POINT_TO_POINT + UNEVEN)
#: The fused operation whose automatic method can be tuned.
RMSNORM = "all_reduce_rmsnorm"
#: The fused matrix products whose automatic method is tuned (ctx.ops.tune_matmul).
MATMULS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


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

