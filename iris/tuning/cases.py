"""What is tuned: the cases (seeded inputs, the call of each candidate, the torch reference) of the
collectives, ``all_reduce_rmsnorm`` and the fused matrix products, and the ``tune`` entry points
that decide them (:func:`tune_collectives`, :func:`tune_all_reduce_rmsnorm`, :func:`tune_matmul`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch

from iris.collectives import MOVED_ONLY_DTYPES, REDUCING, SAME_SIZE_INTEGER, algorithm_registry
from iris.config import parse_size
from iris.tuning.decide import Trial, _apply, _benchmark, _Case, _decide
from iris.tuning.table import MATMULS, RMSNORM, TUNABLE, TuningTable, _dtype_name, bucket, parse_dtype

#: What is tuned when nothing is named, by device type: GPUs every power of two from 1 KiB to
#: 64 MiB (1 to 16384 tokens); CPU ranks, which run kernels in Triton's interpreter, a few small
#: sizes (their times only exercise the machinery).
DEFAULT_DTYPES = {"cuda": (torch.bfloat16, torch.float32), "cpu": (torch.float32,)}
DEFAULT_SIZES = {"cuda": tuple(1 << k for k in range(10, 27)), "cpu": (256, 1 << 10)}
DEFAULT_TOKENS = {"cuda": tuple(1 << k for k in range(15)), "cpu": (1, 4)}
#: Timed calls per candidate, by device type.
DEFAULT_REPEATS = {"cuda": 25, "cpu": 3}
#: The RMSNorm epsilon of the tuning calls.
EPS = 1e-6


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


def _candidates_installed(collective: str, device: str) -> int:
    """How many candidates ``collective`` has on ``device``: each algorithm once per launch shape."""
    registry = algorithm_registry(collective)
    return sum(max(1, len(registry.get(name).launch_shapes.get(device, {}))) for name in registry.names())


def tune_collectives(ccl, collectives: Iterable[str] | None = None, dtypes: Iterable | None = None,
                     sizes: Iterable[int | str] | None = None, *, repeats: int | None = None, save: bool = True,
                     timer: Callable[[Trial], float] | None = None) -> TuningTable:
    """``ctx.ccl.tune``: time every applying algorithm of ``collectives`` (default: each tunable
    one with more than one candidate, algorithms and their launch shapes, on this device) for each
    of ``dtypes`` and size buckets
    (``sizes``: bytes per rank or strings such as ``"64KiB"``, each rounded up to its power of
    two); put the decisions in force on the context and, if ``save``, in the cache file.
    ``timer(trial)`` returns a rank's milliseconds for one :class:`Trial` (default: the median of
    ``repeats`` calls). Collective. Returns the table of this run's decisions."""
    ctx = ccl._context
    device = ctx.device.type
    if collectives is None:
        names = [c for c in TUNABLE if _candidates_installed(c, device) > 1]
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


# -- the fused matrix products' cases -------------------------------------------------------------------


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
