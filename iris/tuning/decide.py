"""Timing and deciding: the candidates of each tuned bucket are checked to be the same on every
rank, tried against the torch reference, timed (:class:`Trial`), and decided the same on every rank
(see :mod:`iris.tuning`); the decisions are put in force on the context and saved."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from iris.calls.repeats import invalidate as invalidate_repeats
from iris.errors import IrisError
from iris.compat.timing import do_bench
from iris.tuning.cache import _save
from iris.tuning.table import Entry, TuningTable, _dtype_name, _entry_key

#: Untimed calls per candidate before the timed ones, by device type.
WARMUP = {"cuda": 5, "cpu": 1}


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
    """Every case's decision, the same on every rank (see :mod:`iris.tuning`)."""
    from iris.collectives.groups import GroupView

    if isinstance(ctx, GroupView):
        raise IrisError("tuning: a group's calls take the built-in choices (a tuned table is the world's, made for its "
                        "world size); tune on the world context instead (ctx.ccl.tune(...), ctx.ops.tune_...)")
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
    invalidate_repeats()  # an automatic call's repeat would keep its earlier choice
    if save and decided:
        _save(ctx, decided)
    return TuningTable(ctx.tuning.key, decided)
