"""``do_bench``: upstream iris's benchmark loop, timing one call across ranks in milliseconds.

Every timed iteration starts with the ranks lined up (``barrier_fn``), resets whatever the call
consumes (``preamble_fn``), evicts the GPU's L2 cache so that each call reads from memory as in
real use, lines the ranks up again, and only then times ``fn``: so the time is one rank's call,
not its wait for the slowest peer, and no call profits from data an earlier one left in the cache.
"""

from __future__ import annotations

import statistics
from time import perf_counter
from typing import Any, Callable, Sequence

import torch

__all__ = ["RETURN_MODES", "do_bench"]

#: What ``return_mode`` may be, and how each reduces the list of times.
RETURN_MODES: dict[str, Callable[[list[float]], Any]] = {
    "mean": statistics.mean,
    "min": min,
    "max": max,
    "median": statistics.median,
    "all": list,
}

#: Bytes written before each timed call to evict the GPU's L2 cache (larger than any GPU's L2).
CACHE_FLUSH_BYTES = 256 * 1024 * 1024


def _nothing() -> None:
    return None


def do_bench(
    fn: Callable[[], Any],
    barrier_fn: Callable[[], Any] = _nothing,
    preamble_fn: Callable[[], Any] = _nothing,
    n_warmup: int = 25,
    n_repeat: int = 100,
    quantiles: Sequence[float] | None = None,
    return_mode: str = "mean",
    *,
    device: str | torch.device | None = None,
):
    """Time ``fn()`` and return milliseconds, as upstream iris's ``iris.do_bench``.

    The sequence is: one untimed ``barrier_fn(); preamble_fn(); fn(); barrier_fn()``; then
    ``n_warmup`` untimed and ``n_repeat`` timed iterations of ``barrier_fn(); preamble_fn();``
    (cache flush) ``barrier_fn(); fn()``; then a last ``barrier_fn()``. So ``fn`` and
    ``preamble_fn`` run ``1 + n_warmup + n_repeat`` times and ``barrier_fn``
    ``3 + 2 * (n_warmup + n_repeat)`` times. Pass ``barrier_fn=ctx.barrier`` to line the ranks up.

    On a GPU (``device`` "cuda", the default when CUDA is available) each timed call is bracketed
    by ``torch.cuda.Event``\\ s recorded on the current stream, and a 256 MiB buffer is zeroed
    before it to evict the L2 cache. On the CPU (``device="cpu"``, the default without CUDA; CPU
    ranks) the time is ``time.perf_counter()`` around the call, and nothing is flushed.

    Returns, with ``quantiles`` (numbers in [0, 1]), the list of those quantiles of the times
    (linear interpolation, as :func:`torch.quantile`), or the single value when one was asked;
    otherwise the times reduced by ``return_mode``: ``"mean"``, ``"min"``, ``"max"``,
    ``"median"`` or ``"all"`` (the list, in call order).
    """
    if return_mode not in RETURN_MODES:
        raise ValueError(f"return_mode must be one of {', '.join(map(repr, RETURN_MODES))}; got {return_mode!r}")
    if isinstance(n_repeat, bool) or not isinstance(n_repeat, int) or n_repeat < 1:
        raise ValueError(f"n_repeat must be an int >= 1 (the number of timed calls), got {n_repeat!r}")
    if isinstance(n_warmup, bool) or not isinstance(n_warmup, int) or n_warmup < 0:
        raise ValueError(f"n_warmup must be an int >= 0, got {n_warmup!r}")
    if quantiles is not None:
        quantiles = [float(q) for q in quantiles]
        if not all(0.0 <= q <= 1.0 for q in quantiles):
            raise ValueError(f"quantiles must lie in [0, 1], got {quantiles}")
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))

    barrier_fn()
    preamble_fn()
    fn()
    barrier_fn()

    if device.type == "cuda":
        times = _gpu_times(fn, barrier_fn, preamble_fn, n_warmup, n_repeat, device)
    else:
        times = _cpu_times(fn, barrier_fn, preamble_fn, n_warmup, n_repeat)

    if quantiles is not None:
        values = torch.quantile(torch.tensor(times, dtype=torch.float64),
                                torch.tensor(quantiles, dtype=torch.float64)).tolist()
        return values[0] if len(values) == 1 else values
    return RETURN_MODES[return_mode](times)


def _gpu_times(fn, barrier_fn, preamble_fn, n_warmup: int, n_repeat: int, device: torch.device) -> list[float]:
    cache = torch.empty(CACHE_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_repeat)]
    for _ in range(n_warmup):
        barrier_fn()
        preamble_fn()
        cache.zero_()
        barrier_fn()
        fn()
    for start, end in zip(starts, ends):
        barrier_fn()
        preamble_fn()
        cache.zero_()
        barrier_fn()
        start.record()
        fn()
        end.record()
    barrier_fn()
    torch.cuda.synchronize(device)  # elapsed_time needs both events done, whatever barrier_fn does
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def _cpu_times(fn, barrier_fn, preamble_fn, n_warmup: int, n_repeat: int) -> list[float]:
    for _ in range(n_warmup):
        barrier_fn()
        preamble_fn()
        barrier_fn()
        fn()
    times = []
    for _ in range(n_repeat):
        barrier_fn()
        preamble_fn()
        barrier_fn()
        begin = perf_counter()
        fn()
        times.append((perf_counter() - begin) * 1e3)
    barrier_fn()
    return times
