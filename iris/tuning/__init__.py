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

The submodules: :mod:`~iris.tuning.table` (size buckets, dtype names, :class:`CacheKey`,
:class:`Entry`, :class:`TuningTable` and its JSON and text forms), :mod:`~iris.tuning.cache` (the
cache directory, the ``IRIS_TUNING`` switch, the machine's key and link topology, :func:`load` and
saving), :mod:`~iris.tuning.decide` (the plan check, the correctness check, the timer,
:class:`Trial`, the decisions agreed across ranks), :mod:`~iris.tuning.cases` (what is tuned: the
collectives', ``all_reduce_rmsnorm``'s and the fused matrix products' cases, and the ``tune``
functions) and :mod:`~iris.tuning.ranks` (what ``iris tune`` runs on each rank).
"""

from iris.tuning.cache import (CACHE_ENV, SWITCH_ENV, cache_directory, link_topology, load, loading_enabled,
                               machine_key)
from iris.tuning.cases import tune_all_reduce_rmsnorm, tune_collectives, tune_matmul
from iris.tuning.decide import Trial
from iris.tuning.ranks import tune_on_rank
from iris.tuning.table import TUNABLE, CacheKey, Entry, TuningTable, bucket, format_table, parse_dtype

__all__ = ["CACHE_ENV", "SWITCH_ENV", "TUNABLE", "CacheKey", "Entry", "Trial", "TuningTable", "bucket",
           "cache_directory", "format_table", "link_topology", "load", "loading_enabled", "machine_key",
           "parse_dtype", "tune_all_reduce_rmsnorm", "tune_collectives", "tune_matmul", "tune_on_rank"]
