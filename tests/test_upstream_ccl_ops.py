"""Upstream iris's collectives (``ctx.ccl``) and fused operations (``ctx.ops``, ``iris.ops``),
called as upstream's own tests and examples 24-31 call them, on 2 and 3 ranks.

Contexts come from upstream's spelling, ``ctx = iris.iris(heap)``; options from
``iris.ccl.Config`` / ``iris.ops.FusedConfig``; outputs come first (``ctx.ccl.all_reduce(out,
inp, config=..., workspace=ws)``, ``iris.ops.matmul_all_reduce(ctx, C, A, B, config=...)``).
Every rank's input is seeded by its rank, so every rank rebuilds the torch reference from all
ranks' inputs. The expected results are upstream's:

- all_reduce: the sum (min, max) of every rank's ``(M, N)`` input, for every variant and tile
  distribution; all_gather: ``(W*M, N)``, rank blocks stacked along rows; all_to_all on
  ``(M, N*W)``: column block ``r`` of rank ``s``'s output is column block ``s`` of rank ``r``'s input;
- reduce_scatter keeps the full ``(M, N)`` shape: a rank's output holds the sum on the tiles it
  owns and is untouched elsewhere. Ownership is computed here from upstream's rule (tiles in
  grouped-swizzle order of ``swizzle_size`` tile rows; striding or contiguous runs of
  ``cdiv(T, W)``), not taken from iris;
- matmul_reduce_scatter: the full ``(M, N)`` output holds the summed product on the tiles a rank
  owns (numbered row by row, ``floor(T / W)`` per rank, the last rank the remainder), zero
  elsewhere.

Upstream's tolerances apply to upstream's data (integer fills, exact in every dtype) as upstream
has them. Random data is compared with the float32 sum rounded once to the dtype, allowing one
unit in the last place for 16-bit dtypes (Triton's interpreter rounds float32 to bfloat16 by
truncation). Contexts from ``iris.create`` keep torch.distributed's conventions: upstream-style
calls there raise ``iris.IrisError`` naming upstream's spelling and ``iris.iris(...)``.

One spawn per world size does every check (small shapes: CPU ranks interpret the kernels) and
returns a report per rank; each test asserts on its section of the reports.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import iris
import iris.ops
from iris import ops
from iris.ccl import Config, ReduceOp
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

WORLDS = (2, 3)
HEAP = "64MiB"
DTYPES = (torch.float16, torch.float32, torch.bfloat16)
VARIANTS = ("atomic", "two_shot", "one_shot", "spinlock")
#: A shape with whole tiles and a ragged one (no block size divides 37 or 20).
SMALL, RAGGED = (128, 64), (37, 20)
#: Upstream's ccl tolerances (tests/ccl): atol 1e-3 for float16, else 1e-5; torch's default rtol.
CCL_ATOL = {torch.float16: 1e-3, torch.float32: 1e-5, torch.bfloat16: 1e-5}
#: One unit in the last place, relative: what a single rounding of a random float32 sum may differ by.
ULP = {torch.float16: 2.0 ** -10, torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}
#: Upstream's fused-op tolerances (tests/ops): (atol, rtol).
MATMUL_ALL_REDUCE_TOL = {torch.float16: (0.2, 0.01), torch.float32: (0.3, 0.01)}
ALL_GATHER_MATMUL_TOL = {torch.float16: (1e-2, 1e-2), torch.float32: (1e-2, 1e-2)}
MATMUL_ALL_GATHER_TOL = {torch.float16: (0.5, 0.01), torch.float32: (0.5, 0.01)}
MATMUL_REDUCE_SCATTER_TOL = {torch.float16: (0.2, 0.01), torch.float32: (0.1, 0.01)}
#: Fused-op problem size (upstream's smallest is 128 x 64 x 32; half the rows, one 64 x 64 x 32 block).
MNK = (64, 64, 32)
#: Untouched outputs start from these values: far from any sum of a few standard normal values.
CANARY_LOW = 20.0
#: Upstream's reduce_scatter test and example 27: tiles of 32 x 64 (block_size_m, block_size_n).
EXAMPLE27_TILE = (32, 64)
#: matmul_reduce_scatter's square tiles (block_size_m = block_size_n), as upstream's test configures them.
MATMUL_REDUCE_SCATTER_TILE = 64
#: (form, (M, N, K), dtype) of matmul_reduce_scatter: upstream's test shape 128 x 128 x 32 (4
#: tiles: on 3 ranks one each for ranks 0 and 1, two for the last), and example 31's call on
#: 96 x 80 x 32 (2 x 2 tiles, ragged in both dimensions).
MATMUL_REDUCE_SCATTER_CASES = (("module", (128, 128, 32), torch.float32), ("namespace", (96, 80, 32), torch.float16))
#: (dtype, with bias) of all_gather_matmul and matmul_all_gather.
GATHER_MATMUL_CASES = ((torch.float16, False), (torch.float32, False), (torch.float16, True))
#: (dtype, variant) of matmul_all_reduce through the module function, as upstream's tests/ops call it.
MATMUL_ALL_REDUCE_CASES = ((torch.float16, "atomic"), (torch.float16, "one_shot"), (torch.float16, "two_shot"),
                           (torch.float32, "two_shot"))
#: (M, n) of the all_to_all both contexts make of one (M, n * W) input (iris.iris's and iris.create's).
CONVENTION_SHAPES = ((7, 5), (6, 8))
#: all_to_all's (dtype, (M, n), Config arguments or None for no config): ragged and whole tiles.
ALL_TO_ALL_CASES = ((torch.float16, (37, 5), None), (torch.float32, (16, 24), {}),
                    (torch.bfloat16, (9, 7), dict(block_size_m=16, block_size_n=16)))


# -- data and references -------------------------------------------------------------------------


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _random(shape, dtype, *seed) -> torch.Tensor:
    """Standard normal values (CPU) from a seed every rank can recompute."""
    return torch.randn(*shape, generator=seeded_generator(*seed)).to(dtype)


def _per_rank(world: int, shape, dtype, *seed) -> list[torch.Tensor]:
    """Every rank's random input: rank r's is seeded by ``(*seed, r)``."""
    return [_random(shape, dtype, *seed, r) for r in range(world)]


def _on_heap(ctx, values: torch.Tensor) -> torch.Tensor:
    """A heap tensor holding ``values``, as upstream's tests make them (``zeros`` then ``copy_``)."""
    t = ctx.zeros(tuple(values.shape), dtype=values.dtype)
    t.copy_(values.to(t.device))
    return t


def _reduce(tensors: list[torch.Tensor], op: str = "sum") -> torch.Tensor:
    """Reduction over ranks in float32, in rank order (not rounded)."""
    acc = tensors[0].float()
    for t in tensors[1:]:
        t = t.float()
        acc = acc + t if op == "sum" else torch.minimum(acc, t) if op == "min" else torch.maximum(acc, t)
    return acc


def _verdict(out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float):
    """True if ``out`` (any device) is close to ``expected``, else what differs (for the report)."""
    out = out.detach().cpu()
    if tuple(out.shape) != tuple(expected.shape):
        return f"shape {tuple(out.shape)}, expected {tuple(expected.shape)}"
    got, want = out.float(), expected.float()
    if torch.allclose(got, want, atol=atol, rtol=rtol):
        return True
    worst = (got - want).abs().max().item()
    bad = int((~torch.isclose(got, want, atol=atol, rtol=rtol)).sum())
    return f"{bad} of {got.numel()} elements differ (max |diff| {worst:.4g}, atol {atol}, rtol {rtol})"


def _close_random(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype):
    """``out`` against the float32 result ``exact`` rounded once to ``dtype``: upstream's atol,
    one unit in the last place of relative slack."""
    return _verdict(out, exact.to(dtype), CCL_ATOL[dtype], ULP[dtype])


def _equal(out: torch.Tensor, expected: torch.Tensor):
    out = out.detach().cpu()
    if tuple(out.shape) == tuple(expected.shape) and torch.equal(out, expected):
        return True
    if tuple(out.shape) != tuple(expected.shape):
        return f"shape {tuple(out.shape)}, expected {tuple(expected.shape)}"
    return f"{int((out != expected).sum())} of {out.numel()} elements differ"


def _record(report: RankReport, name: str, verdict) -> None:
    """``verdict``: True, or a description of what went wrong (kept in the report)."""
    report[name] = True if verdict is True else (verdict or False)


def _raises(call, error: type, *fragments: str):
    """True if ``call()`` raises ``error`` whose message contains every fragment, else what happened."""
    try:
        call()
    except error as e:
        missing = [f for f in fragments if f not in str(e)]
        return True if not missing else f"{type(e).__name__} without {missing}: {e}"
    except Exception as e:  # noqa: BLE001 - the wrong error is the finding
        return f"raised {type(e).__name__} instead of {error.__name__}: {e}"
    return f"returned without raising {error.__name__}"


# -- tile ownership, as upstream defines it (computed independently of iris) ----------------------


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _owned_tiles(tiles: int, world: int, rank: int) -> range:
    """The row-major tile ids ``rank`` owns in upstream's examples: ``cdiv(T, W)`` per rank."""
    per_rank = _cdiv(tiles, world)
    return range(rank * per_rank, min((rank + 1) * per_rank, tiles))


def _swizzle_order(num_pid_m: int, num_pid_n: int, group: int) -> list[tuple[int, int]]:
    """(pid_m, pid_n) of tile ids 0, 1, ...: bands of ``group`` tile rows (the last band may be
    shorter), each band walked column by column, the band's rows fastest."""
    order = []
    for first in range(0, num_pid_m, group):
        rows = range(first, min(first + group, num_pid_m))
        for pid_n in range(num_pid_n):
            order.extend((pid_m, pid_n) for pid_m in rows)
    return order


def _owner_map(M: int, N: int, bm: int, bn: int, tiles: list[tuple[int, int]], owner_of_id) -> torch.Tensor:
    """``(M, N)`` int map: which rank owns each element, tile id ``t`` covering ``tiles[t]``."""
    owner = torch.full((M, N), -1, dtype=torch.int64)
    for t, (pid_m, pid_n) in enumerate(tiles):
        owner[pid_m * bm:(pid_m + 1) * bm, pid_n * bn:(pid_n + 1) * bn] = owner_of_id(t)
    return owner


def _reduce_scatter_owners(M: int, N: int, bm: int, bn: int, swizzle: int, distribution: int,
                           world: int) -> torch.Tensor:
    """Owner of each element in upstream's ccl reduce_scatter (and two-shot tile distribution)."""
    num_pid_m, num_pid_n = _cdiv(M, bm), _cdiv(N, bn)
    per_rank = _cdiv(num_pid_m * num_pid_n, world)
    owner_of = (lambda t: t % world) if distribution == 0 else (lambda t: t // per_rank)
    return _owner_map(M, N, bm, bn, _swizzle_order(num_pid_m, num_pid_n, swizzle), owner_of)


def _matmul_reduce_scatter_owners(M: int, N: int, bm: int, bn: int, world: int) -> torch.Tensor:
    """Owner of each element in upstream's matmul_reduce_scatter: row-major tile ids, ``floor(T / W)``
    consecutive ids per rank, the last rank also the remainder."""
    num_pid_m, num_pid_n = _cdiv(M, bm), _cdiv(N, bn)
    per_rank = num_pid_m * num_pid_n // world
    row_major = [(t // num_pid_n, t % num_pid_n) for t in range(num_pid_m * num_pid_n)]
    return _owner_map(M, N, bm, bn, row_major,
                      lambda t: world - 1 if per_rank == 0 else min(t // per_rank, world - 1))


# -- the checks, on every rank --------------------------------------------------------------------


class _BarrierCounter:
    """Counts ``ctx.barrier()`` calls made while installed (on the instance, shadowing the method)."""

    def __init__(self, ctx):
        self.ctx, self.calls = ctx, 0

    def __enter__(self):
        original = type(self.ctx).barrier

        def counting(*args, **kwargs):
            self.calls += 1
            return original(self.ctx, *args, **kwargs)

        self.ctx.barrier = counting
        return self

    def __exit__(self, *exc):
        del self.ctx.barrier


def _all_reduce_cases(variant: str) -> list[tuple[int, torch.dtype]]:
    """(tile distribution, dtype) of the random-data calls of ``variant``: every dtype, both
    distributions for two_shot (whose tiles they assign upstream), else one in turn."""
    if variant == "two_shot":
        return [(d, dtype) for d in (0, 1) for dtype in DTYPES]
    return [(i % 2, dtype) for i, dtype in enumerate(DTYPES)]


def _upstream_fill(variant: str) -> tuple[torch.dtype, tuple[int, int]]:
    """(dtype, shape) of ``variant``'s call as upstream's own test makes it: two_shot on upstream's
    128 x 64, the others on the ragged shape; the dtypes in turn."""
    return DTYPES[VARIANTS.index(variant) % len(DTYPES)], SMALL if variant == "two_shot" else RAGGED


def _check_all_reduce(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    # Random data, the ragged shape: every variant in every dtype, both tile distributions per
    # variant (two_shot, whose tiles they assign upstream, in every dtype).
    for variant in VARIANTS:
        with report.section(f"all_reduce/{variant}"):
            for distribution, dtype in _all_reduce_cases(variant):
                name = f"all_reduce/{variant}/d{distribution}/{_name(dtype)}/{RAGGED[0]}x{RAGGED[1]}"
                inputs = _per_rank(world, RAGGED, dtype, "all_reduce", variant, distribution)
                inp = _on_heap(ctx, inputs[rank])
                out = ctx.zeros(RAGGED, dtype=dtype)
                config = Config(all_reduce_variant=variant)
                config.all_reduce_distribution = distribution  # as upstream's tests set it
                ws = ctx.ccl.all_reduce_preamble(out, inp, config=config)
                ctx.barrier()
                returned = ctx.ccl.all_reduce(out, inp, config=config, workspace=ws)
                _record(report, name, _close_random(out, _reduce(inputs), dtype))
                _record(report, f"{name}/input_unchanged", _equal(inp, inputs[rank]))
                _record(report, f"{name}/returns_its_workspace", returned is ws or f"returned {returned!r}")
                report.check(f"{name}/workspace_records_the_call",
                             ws.variant == variant and tuple(ws.shape) == RAGGED and ws.dtype == dtype)
            # Upstream's own test: randn filled with rank + 1, the sum W(W+1)/2 everywhere, upstream's
            # atol; two_shot with distribution 0 as upstream's test sets it, on upstream's 128 x 64.
            dtype, shape = _upstream_fill(variant)
            inp = _on_heap(ctx, torch.randn(shape).fill_(rank + 1).to(dtype))
            out = ctx.zeros(shape, dtype=dtype)
            config = Config(all_reduce_variant=variant)
            if variant == "two_shot":
                config.all_reduce_distribution = 0
            ws = ctx.ccl.all_reduce_preamble(out, inp, config=config)
            ctx.barrier()
            ctx.ccl.all_reduce(out, inp, config=config, workspace=ws)
            expected = torch.full(shape, world * (world + 1) / 2).to(dtype)
            _record(report, f"all_reduce/{variant}/upstream_fill/{_name(dtype)}/{shape[0]}x{shape[1]}",
                    _verdict(out, expected, CCL_ATOL[dtype], 1e-5))

    with report.section("all_reduce/reused_workspace"):
        # One workspace for calls in a row (upstream re-prepares a used one); new data each time.
        config = Config(all_reduce_variant="two_shot")
        out = ctx.zeros(RAGGED, dtype=torch.float32)
        ws = None
        for call in range(2):
            inputs = _per_rank(world, RAGGED, torch.float32, "reuse", call)
            inp = _on_heap(ctx, inputs[rank])
            ws = ctx.ccl.all_reduce(out, inp, config=config, workspace=ws)
            _record(report, f"all_reduce/reused_workspace/call{call}",
                    _close_random(out, _reduce(inputs), torch.float32))
        report.check("all_reduce/reused_workspace/not_prepared_after_a_call", ws.prepared is False)

    with report.section("all_reduce/example24"):
        # Example 24: default config, no preamble, fill rank + 1, atol 0.5.
        inp = ctx.zeros(RAGGED, dtype=torch.float16)
        inp.fill_(rank + 1)
        out = ctx.zeros(RAGGED, dtype=torch.float16)
        ctx.ccl.all_reduce(out, inp)
        _record(report, "all_reduce/example24/default_config",
                _verdict(out, torch.full(RAGGED, world * (world + 1) / 2), 0.5, 1e-5))


def _check_reduce_ops(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    with report.section("all_reduce_op"):
        for op, spelled, dtype in ((ReduceOp.SUM, "sum", torch.float16), (ReduceOp.MIN, "min", torch.float32),
                                   (ReduceOp.MAX, "max", torch.bfloat16)):
            inputs = _per_rank(world, RAGGED, dtype, "op", spelled)
            inp = _on_heap(ctx, inputs[rank])
            out = ctx.zeros(RAGGED, dtype=dtype)
            ctx.ccl.all_reduce(out, inp, op=op, config=Config(all_reduce_variant="two_shot"))
            _record(report, f"all_reduce_op/{spelled}/{_name(dtype)}",
                    _close_random(out, _reduce(inputs, spelled), dtype))
        x = ctx.zeros(RAGGED, dtype=torch.float32)
        y = ctx.zeros(RAGGED, dtype=torch.float32)
        for op in (ReduceOp.PRODUCT, ReduceOp.BAND):
            _record(report, f"all_reduce_op/{op.name}_refused/all_reduce",
                    _raises(lambda: ctx.ccl.all_reduce(y, x, op=op), ValueError))
            _record(report, f"all_reduce_op/{op.name}_refused/reduce_scatter",
                    _raises(lambda: ctx.ccl.reduce_scatter(y, x, op=op), ValueError))


def _check_all_gather(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    with report.section("all_gather/persistent"):
        for dtype in DTYPES:
            inputs = _per_rank(world, RAGGED, dtype, "all_gather")
            inp = _on_heap(ctx, inputs[rank])
            out = ctx.zeros((world * RAGGED[0], RAGGED[1]), dtype=dtype)
            ctx.ccl.all_gather(out, inp, config=Config())
            _record(report, f"all_gather/persistent/{_name(dtype)}", _equal(out, torch.cat(inputs, dim=0)))
        # Example 25: no config, fill rank + 1; rows [r*M, (r+1)*M) hold r + 1.
        M, N = RAGGED
        inp = ctx.zeros((M, N), dtype=torch.float16)
        inp.fill_(rank + 1)
        out = ctx.zeros((world * M, N), dtype=torch.float16)
        ctx.ccl.all_gather(out, inp)
        for r in range(world):
            _record(report, f"all_gather/example25/block{r}",
                    _verdict(out[r * M:(r + 1) * M], torch.full((M, N), r + 1.0), 0.5, 1e-5))

    with report.section("all_gather/partitioned"):
        # Upstream's test passes comm_sms=64, which the partitioned variant needs divisible by W.
        comm_sms = 64 if 64 % world == 0 else 63
        inputs = _per_rank(world, RAGGED, torch.float16, "partitioned")
        inp = _on_heap(ctx, inputs[rank])
        out = ctx.zeros((world * RAGGED[0], RAGGED[1]), dtype=torch.float16)
        ctx.ccl.all_gather(out, inp, config=Config(all_gather_variant="partitioned", comm_sms=comm_sms))
        _record(report, f"all_gather/partitioned/comm_sms{comm_sms}", _equal(out, torch.cat(inputs, dim=0)))
        if 64 % world:
            _record(report, "all_gather/partitioned/comm_sms64_not_divisible_refused",
                    _raises(lambda: ctx.ccl.all_gather(
                        out, inp, config=Config(all_gather_variant="partitioned", comm_sms=64)), ValueError))

    with report.section("all_gather/shape_mismatch"):
        inp = ctx.zeros(RAGGED, dtype=torch.float32)
        for label, shape in (("same_as_input", RAGGED), ("one_column_more", (world * RAGGED[0], RAGGED[1] + 1)),
                             ("one_block_short", ((world - 1) * RAGGED[0], RAGGED[1]))):
            out = ctx.zeros(shape, dtype=torch.float32)
            _record(report, f"all_gather/shape_mismatch/{label}",
                    _raises(lambda: ctx.ccl.all_gather(out, inp), ValueError, "shape"))


def _column_exchange(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """Upstream's all_to_all of ``(M, N*W)`` matrices, from every rank's input: column block ``r``
    of this rank's output is column block ``rank`` of rank ``r``'s input."""
    world = len(inputs)
    n = inputs[0].shape[1] // world
    return torch.cat([inputs[r][:, rank * n:(rank + 1) * n] for r in range(world)], dim=1)


def _check_all_to_all(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    with report.section("all_to_all"):
        for dtype, (M, n), config_args in ALL_TO_ALL_CASES:
            config = None if config_args is None else Config(**config_args)
            name = f"all_to_all/{_name(dtype)}/{M}x{n}x{world}"
            inputs = _per_rank(world, (M, n * world), dtype, "all_to_all")
            inp = _on_heap(ctx, inputs[rank])
            out = ctx.zeros((M, n * world), dtype=dtype)
            if config is None:
                ctx.ccl.all_to_all(out, inp)
            else:
                ctx.ccl.all_to_all(out, inp, config=config)
            _record(report, name, _equal(out, _column_exchange(inputs, rank)))
            # The chunk a rank sends itself: a local copy into its own column block.
            _record(report, f"{name}/self_chunk",
                    _equal(out[:, rank * n:(rank + 1) * n], inputs[rank][:, rank * n:(rank + 1) * n]))
        # Example 26: the block rank r addresses to t holds r*10 + t + 1.
        M, n = 32, 16
        inp = ctx.zeros((M, n * world), dtype=torch.float16)
        for t in range(world):
            inp[:, t * n:(t + 1) * n] = rank * 10 + t + 1
        out = ctx.zeros((M, n * world), dtype=torch.float16)
        ctx.ccl.all_to_all(out, inp)
        for s in range(world):
            _record(report, f"all_to_all/example26/block{s}",
                    _verdict(out[:, s * n:(s + 1) * n], torch.full((M, n), s * 10 + rank + 1.0), 0.5, 1e-5))


# (M, N, block_size_m, block_size_n, swizzle_size or None for the default, dtype). Ragged shapes and
# more tile rows than the swizzle group, so the grouped order differs from row-major.
REDUCE_SCATTER_CASES = (
    (37, 20, 8, 8, None, torch.float16),  # 5 x 3 tiles, ragged; a short last band
    (64, 48, 8, 16, 3, torch.bfloat16),  # 8 x 3 tiles, bands of 3
    (40, 72, 16, 16, 2, torch.float32),  # 3 x 5 tiles, ragged in both dimensions
)


def _check_reduce_scatter(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    for M, N, bm, bn, swizzle, dtype in REDUCE_SCATTER_CASES:
        for distribution in (0, 1):
            name = f"reduce_scatter/{M}x{N}/b{bm}x{bn}/s{swizzle or 'default'}/d{distribution}/{_name(dtype)}"
            with report.section(name):
                kwargs = dict(block_size_m=bm, block_size_n=bn, all_reduce_distribution=distribution)
                if swizzle is not None:
                    kwargs["swizzle_size"] = swizzle
                config = Config(**kwargs)
                inputs = _per_rank(world, (M, N), dtype, "reduce_scatter", M, N, distribution)
                canary = (CANARY_LOW + torch.rand(M, N, generator=seeded_generator("canary", M, N, rank))).to(dtype)
                inp = _on_heap(ctx, inputs[rank])
                out = _on_heap(ctx, canary)
                ctx.ccl.reduce_scatter(out, inp, config=config)
                got = out.cpu()
                owners = _reduce_scatter_owners(M, N, bm, bn, config.swizzle_size, distribution, world)
                mine = owners == rank
                total = _reduce(inputs).to(dtype)
                _record(report, f"{name}/owned_tiles_hold_the_sum",
                        _verdict(got[mine], total[mine], CCL_ATOL[dtype], ULP[dtype]))
                _record(report, f"{name}/other_tiles_untouched", _equal(got[~mine], canary[~mine]))
                _record(report, f"{name}/input_unchanged", _equal(inp, inputs[rank]))
                # What every rank actually wrote (sums are far below the canaries) covers each
                # element exactly once.
                written = ctx.comm.all_gather_object(got.float() < CANARY_LOW)
                times = torch.stack(written).sum(0)
                _record(report, f"{name}/union_covers_every_element_once",
                        bool((times == 1).all()) or f"{int((times != 1).sum())} elements written by 0 or >1 ranks")

    with report.section("reduce_scatter/upstream_check"):
        # Upstream's test and example 27: zeros out, input filled with rank + 1; summing every rank's
        # output gives W(W+1)/2 everywhere. Example 27 passes only block sizes (default distribution).
        M, N = SMALL
        full = world * (world + 1) / 2
        for distribution in (0, 1):
            inp = ctx.zeros((M, N), dtype=torch.float16)
            inp.fill_(rank + 1)
            out = ctx.zeros((M, N), dtype=torch.float16)
            bm, bn = EXAMPLE27_TILE
            config = Config(block_size_m=bm, block_size_n=bn)
            if distribution == 0:
                config = Config(block_size_m=bm, block_size_n=bn, all_reduce_distribution=0)
            ctx.ccl.reduce_scatter(out, inp, config=config)
            agg = out.clone().float()
            dist.all_reduce(agg)
            _record(report, f"reduce_scatter/upstream_check/d{distribution}/sum_of_outputs",
                    _verdict(agg, torch.full((M, N), full), 1e-3, 1e-5))
            if distribution == 1:
                # Example 27: owned tiles in row-major order, cdiv(T, W) per rank (here one tile column).
                for t in _owned_tiles(_cdiv(M, bm) * _cdiv(N, bn), world, rank):
                    pm, pn = divmod(t, _cdiv(N, bn))
                    tile = out[pm * bm:(pm + 1) * bm, pn * bn:(pn + 1) * bn]
                    _record(report, f"reduce_scatter/example27/tile{t}",
                            _verdict(tile, torch.full(tuple(tile.shape), full), 0.5, 1e-5))

    with report.section("reduce_scatter/default_config"):
        # config=None: upstream's Config(block_size_m=32, block_size_n=64), block distribution, swizzle 4.
        M, N = 40, 70  # 2 x 2 tiles of 32 x 64, ragged
        inputs = _per_rank(world, (M, N), torch.float32, "rs_default")
        canary = CANARY_LOW + torch.rand(M, N, generator=seeded_generator("rs_default_canary", rank))
        out = _on_heap(ctx, canary)
        ctx.ccl.reduce_scatter(out, _on_heap(ctx, inputs[rank]))
        mine = _reduce_scatter_owners(M, N, 32, 64, 4, 1, world) == rank
        got = out.cpu()
        _record(report, "reduce_scatter/default_config/owned", _verdict(got[mine], _reduce(inputs)[mine], 1e-5, 1e-5))
        _record(report, "reduce_scatter/default_config/untouched", _equal(got[~mine], canary[~mine]))

    with report.section("reduce_scatter/shape_mismatch"):
        inp = ctx.zeros((64, 32), dtype=torch.float32)
        for label, shape in (("torch_style_shard", (64 // world, 32)), ("one_column_more", (64, 33))):
            out = ctx.zeros(shape, dtype=torch.float32)
            _record(report, f"reduce_scatter/shape_mismatch/{label}",
                    _raises(lambda: ctx.ccl.reduce_scatter(out, inp), ValueError, "same shape"))


def _matmul_inputs(world: int, M: int, N: int, K: int, dtype, *seed) -> tuple[list, list]:
    """Every rank's A (M x K) and B (K x N), different on each rank."""
    return (_per_rank(world, (M, K), dtype, "A", M, N, K, *seed), _per_rank(world, (K, N), dtype, "B", M, N, K, *seed))


def _product_sum(As: list, Bs: list) -> torch.Tensor:
    return sum(a.float() @ b.float() for a, b in zip(As, Bs))


def _workspace_verdict(ws, operation: str, shape: tuple, dtype, world: int, variant: str | None = None):
    if not isinstance(ws, ops.FusedWorkspace):
        return f"returned {type(ws).__name__}, not an iris.ops.FusedWorkspace"
    wanted = (operation, shape, dtype, world)
    got = (ws.operation, tuple(ws.shape), ws.dtype, ws.world_size)
    if got != wanted or (variant is not None and ws.variant != variant):
        return f"workspace records {got} variant {ws.variant!r}, expected {wanted} variant {variant!r}"
    return True if ws.prepared is False else "workspace still marked prepared after the call"


def _check_matmul_all_reduce(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    M, N, K = MNK
    with report.section("matmul_all_reduce/module"):
        # tests/ops: ops.matmul_all_reduce(shmem, C, A, B, config=FusedConfig(64, 64, 32, all_reduce_variant=v)).
        for dtype, variant in MATMUL_ALL_REDUCE_CASES:
            name = f"matmul_all_reduce/module/{variant}/{_name(dtype)}"
            As, Bs = _matmul_inputs(world, M, N, K, dtype, variant)
            A, B = _on_heap(ctx, As[rank]), _on_heap(ctx, Bs[rank])
            C = ctx.zeros((M, N), dtype=dtype)
            config = ops.FusedConfig(64, 64, 32, all_reduce_variant=variant)
            ws = ops.matmul_all_reduce(ctx, C, A, B, config=config)
            atol, rtol = MATMUL_ALL_REDUCE_TOL[dtype]
            _record(report, name, _verdict(C, _product_sum(As, Bs), atol, rtol))
            _record(report, f"{name}/workspace", _workspace_verdict(ws, "matmul_all_reduce", (M, N, K), dtype, world,
                                                                     variant))
    with report.section("matmul_all_reduce/namespace"):
        # shmem.ops.matmul_all_reduce(out, A, B), default config, A and B from ctx.randn (per rank).
        As, Bs = _matmul_inputs(world, M, N, K, torch.float16, "namespace")
        C = ctx.zeros((M, N), dtype=torch.float16)
        ws = ctx.ops.matmul_all_reduce(C, _on_heap(ctx, As[rank]), _on_heap(ctx, Bs[rank]))
        _record(report, "matmul_all_reduce/namespace/default_config", _verdict(C, _product_sum(As, Bs), 0.2, 0.01))
        _record(report, "matmul_all_reduce/namespace/workspace",
                _workspace_verdict(ws, "matmul_all_reduce", (M, N, K), torch.float16, world))
        # Example 28: the same A and B on every rank (seed 42): the result is W * (A @ B); atol 1, rtol 0.05.
        torch.manual_seed(42)
        A = torch.randn(M, K).to(torch.float16)
        B = torch.randn(K, N).to(torch.float16)
        C = ctx.zeros((M, N), dtype=torch.float16)
        ctx.ops.matmul_all_reduce(C, _on_heap(ctx, A), _on_heap(ctx, B))
        _record(report, "matmul_all_reduce/example28",
                _verdict(C, (A.float() @ B.float()).to(torch.float16).float() * world, 1.0, 0.05))
        _record(report, "matmul_all_reduce/bad_variant_refused",
                _raises(lambda: ops.matmul_all_reduce(ctx, C, _on_heap(ctx, A), _on_heap(ctx, B),
                                                      config=ops.FusedConfig(all_reduce_variant="three_shot")),
                        ValueError))


def _check_all_gather_matmul(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    M, K_local, N = 64, 32, 64
    K = K_local * world
    with report.section("all_gather_matmul"):
        for dtype, with_bias in GATHER_MATMUL_CASES:
            name = f"all_gather_matmul/{_name(dtype)}" + ("/bias" if with_bias else "")
            shards = _per_rank(world, (M, K_local), dtype, "A_sharded", with_bias)
            B = _random((K, N), dtype, "B_replicated", with_bias)  # the same B on every rank
            out = ctx.zeros((M, N), dtype=dtype)
            A_sh, B_heap = _on_heap(ctx, shards[rank]), _on_heap(ctx, B)
            config = ops.FusedConfig(64, 64, 32)
            expected = torch.cat(shards, dim=1).float() @ B.float()
            if with_bias:
                bias = _random((M,), dtype, "bias")
                ws = ctx.ops.all_gather_matmul(out, A_sh, B_heap, bias=_on_heap(ctx, bias), config=config)
                expected = expected + bias.float()[:, None]
            else:
                ws = ctx.ops.all_gather_matmul(out, A_sh, B_heap, config=config)
            atol, rtol = ALL_GATHER_MATMUL_TOL[dtype]
            _record(report, name, _verdict(out, expected, atol, rtol))
            _record(report, f"{name}/workspace", _workspace_verdict(ws, "all_gather_matmul", (M, N, K), dtype, world))
        # Example 29's call (no config) through the module function; atol 1, rtol 0.05.
        shards = _per_rank(world, (M, K_local), torch.float16, "example29")
        B = _random((K, N), torch.float16, "example29_B")
        out = ctx.zeros((M, N), dtype=torch.float16)
        iris.ops.all_gather_matmul(ctx, out, _on_heap(ctx, shards[rank]), _on_heap(ctx, B))
        _record(report, "all_gather_matmul/example29_module_default_config",
                _verdict(out, torch.cat(shards, dim=1).float() @ B.float(), 1.0, 0.05))


def _check_matmul_all_gather(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    m, K, N = 32, 32, 64
    with report.section("matmul_all_gather"):
        for dtype, with_bias in GATHER_MATMUL_CASES:
            name = f"matmul_all_gather/{_name(dtype)}" + ("/bias" if with_bias else "")
            # Upstream's test: A_local and B random on every rank; rank r's rows are A_r @ B_r.
            As, Bs = _matmul_inputs(world, m, N, K, dtype, "matmul_all_gather", with_bias)
            out = ctx.zeros((world * m, N), dtype=dtype)
            A_heap, B_heap = _on_heap(ctx, As[rank]), _on_heap(ctx, Bs[rank])
            config = ops.FusedConfig(32, 32, 32)
            products = [a.float() @ b.float() for a, b in zip(As, Bs)]
            if with_bias:
                bias = _random((m,), dtype, "bias_m")
                ws = ctx.ops.matmul_all_gather(out, A_heap, B_heap, bias=_on_heap(ctx, bias), config=config)
                products = [p + bias.float()[:, None] for p in products]
            else:
                ws = ctx.ops.matmul_all_gather(out, A_heap, B_heap, config=config)
            atol, rtol = MATMUL_ALL_GATHER_TOL[dtype]
            _record(report, name, _verdict(out, torch.cat(products, dim=0), atol, rtol))
            _record(report, f"{name}/workspace", _workspace_verdict(ws, "matmul_all_gather", (m, N, K), dtype, world))
        # Example 30: seed 42 + rank for A_local, seed 0 for B (the same on every rank), no config.
        A_local = [torch.randn(m, K, generator=torch.Generator().manual_seed(42 + r)).to(torch.float16)
                   for r in range(world)]
        B = torch.randn(K, N, generator=torch.Generator().manual_seed(0)).to(torch.float16)
        out = ctx.zeros((world * m, N), dtype=torch.float16)
        ctx.ops.matmul_all_gather(out, _on_heap(ctx, A_local[rank]), _on_heap(ctx, B))
        _record(report, "matmul_all_gather/example30",
                _verdict(out, torch.cat([a.float() @ B.float() for a in A_local], dim=0), 1.0, 0.05))


def _check_matmul_reduce_scatter(ctx, report: RankReport) -> None:
    rank, world = ctx.rank, ctx.world_size
    tile = MATMUL_REDUCE_SCATTER_TILE
    config = ops.FusedConfig(block_size_m=tile, block_size_n=tile, block_size_k=32)
    for form, (M, N, K), dtype in MATMUL_REDUCE_SCATTER_CASES:
        name = f"matmul_reduce_scatter/{form}/{M}x{N}x{K}/{_name(dtype)}"
        with report.section(name):
            As, Bs = _matmul_inputs(world, M, N, K, dtype, "mrs", form)
            A, B = _on_heap(ctx, As[rank]), _on_heap(ctx, Bs[rank])
            # Start from nonzero values: upstream's preamble zeroes C, so tiles not owned read zero.
            C = _on_heap(ctx, CANARY_LOW + torch.rand(M, N, generator=seeded_generator("C", rank)).to(dtype))
            if form == "module":
                ws = iris.ops.matmul_reduce_scatter(ctx, C, A, B, config=config)
            else:
                ws = ctx.ops.matmul_reduce_scatter(C, A, B, config=config)
            got = C.cpu()
            mine = _matmul_reduce_scatter_owners(M, N, tile, tile, world) == rank
            atol, rtol = MATMUL_REDUCE_SCATTER_TOL[dtype]
            if world == 8 and dtype == torch.float32:
                atol = 0.2  # upstream's allowance on 8 ranks
            _record(report, f"{name}/owned_tiles_hold_the_sum", _verdict(got[mine], _product_sum(As, Bs)[mine], atol,
                                                                         rtol))
            _record(report, f"{name}/other_tiles_zero", _equal(got[~mine], torch.zeros(int((~mine).sum()),
                                                                                       dtype=dtype)))
            _record(report, f"{name}/workspace", _workspace_verdict(ws, "matmul_reduce_scatter", (M, N, K), dtype,
                                                                     world))
            # Example 31's check (cdiv(T, W) tiles per rank, row-major) agrees with upstream's rule
            # when W divides T; it is checked there.
            T = _cdiv(M, tile) * _cdiv(N, tile)
            if T % world == 0:
                expected = _product_sum(As, Bs)
                for t in _owned_tiles(T, world, rank):
                    pm, pn = divmod(t, _cdiv(N, tile))
                    window = (slice(pm * tile, (pm + 1) * tile), slice(pn * tile, (pn + 1) * tile))
                    _record(report, f"{name}/example31_tile{t}", _verdict(got[window], expected[window], 1.0, 0.05))


def _check_async(ctx, report: RankReport) -> None:
    """``async_op=True``: no barrier at the end of the call; the result is there after ``ctx.barrier()``.
    Without it, the call ends with one barrier (upstream's completion rule). Each call is made once
    beforehand so that first-call set-up is not counted."""
    rank, world = ctx.rank, ctx.world_size
    M, N = RAGGED
    config = Config(all_reduce_variant="two_shot")
    inputs = _per_rank(world, (M, N * world), torch.float32, "async")
    inp = _on_heap(ctx, inputs[rank])
    inp_mn = _on_heap(ctx, inputs[rank][:, :N].contiguous())
    mnk = MNK
    As, Bs = _matmul_inputs(world, *mnk, torch.float16, "async")
    A, B = _on_heap(ctx, As[rank]), _on_heap(ctx, Bs[rank])
    cases = {
        "all_reduce": (lambda out, **kw: ctx.ccl.all_reduce(out, inp_mn, config=config, **kw), (M, N),
                       lambda: _reduce([x[:, :N] for x in inputs]), torch.float32),
        "all_gather": (lambda out, **kw: ctx.ccl.all_gather(out, inp_mn, **kw), (world * M, N),
                       lambda: torch.cat([x[:, :N] for x in inputs]), torch.float32),
        "all_to_all": (lambda out, **kw: ctx.ccl.all_to_all(out, inp, **kw), (M, N * world),
                       lambda: _column_exchange(inputs, rank), torch.float32),
        "matmul_all_reduce": (lambda out, **kw: ctx.ops.matmul_all_reduce(out, A, B, **kw), mnk[:2],
                              lambda: _product_sum(As, Bs), torch.float16),
    }
    for op, (call, shape, reference, dtype) in cases.items():
        with report.section(f"async_op/{op}"):
            out = ctx.zeros(shape, dtype=dtype)
            call(out)
            with _BarrierCounter(ctx) as counter:
                out.zero_()
                call(out, async_op=True)
                barriers_async = counter.calls
                ctx.barrier()
                after_barrier = out.cpu()
                counter.calls = 0
                call(out, async_op=False)
                barriers_sync = counter.calls
            # Upstream's fused preambles barrier on every call; the collectives here have none.
            if not op.startswith("matmul"):
                report.check(f"async_op/{op}/no_barrier_with_async_op", barriers_async == 0)
            report.check(f"async_op/{op}/one_more_barrier_without", barriers_sync == barriers_async + 1)
            atol, rtol = (0.2, 0.01) if op.startswith("matmul") else (1e-5, 1e-5)
            _record(report, f"async_op/{op}/result_after_barrier", _verdict(after_barrier, reference(), atol, rtol))
    with report.section("async_op/reduce_scatter"):
        out = ctx.zeros((M, N), dtype=torch.float32)
        ctx.ccl.reduce_scatter(out, inp_mn)
        with _BarrierCounter(ctx) as counter:
            out.zero_()
            ctx.ccl.reduce_scatter(out, inp_mn, async_op=True)
            report.check("async_op/reduce_scatter/no_barrier_with_async_op", counter.calls == 0)
            ctx.barrier()
        mine = _reduce_scatter_owners(M, N, 32, 64, 4, 1, world) == rank
        got = out.cpu()
        _record(report, "async_op/reduce_scatter/result_after_barrier",
                _verdict(got[mine], _reduce([x[:, :N] for x in inputs])[mine], 1e-5, 1e-5))


def _flat_exchange(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """torch.distributed's all_to_all_single of the flattened tensors: segment ``r`` (numel / W
    consecutive elements) of this rank's output is segment ``rank`` of rank ``r``'s input."""
    world = len(inputs)
    size = inputs[0].numel() // world
    return torch.cat([x.reshape(-1)[rank * size:(rank + 1) * size] for x in inputs]).reshape(inputs[0].shape)


def _check_conventions(ctx, report: RankReport) -> None:
    """A context from ``iris.create`` keeps torch.distributed's conventions next to ``ctx``."""
    rank, world = ctx.rank, ctx.world_size
    tctx = iris.create(heap_size="16MiB")
    try:
        with report.section("conventions/refusals"):
            out = tctx.zeros(RAGGED, dtype=torch.float32)
            inp = tctx.zeros(RAGGED, dtype=torch.float32)
            # 36 x 20 elements divide among 2 and 3 ranks; 37 x 20 only among 2.
            full_out = tctx.zeros((36, 20), dtype=torch.float32)
            full_inp = tctx.zeros((36, 20), dtype=torch.float32)
            refusals = {
                "all_reduce_out_inp": (lambda: tctx.ccl.all_reduce(out, inp), ("all_reduce(out, inp)",)),
                "all_reduce_config": (lambda: tctx.ccl.all_reduce(inp, config=Config()), ("config=",)),
                "all_reduce_workspace": (lambda: tctx.ccl.all_reduce(inp, workspace=None), ("workspace=",)),
                "reduce_scatter_full_shape": (lambda: tctx.ccl.reduce_scatter(full_out, full_inp),
                                              ("reduce_scatter",)),
                "reduce_scatter_full_shape_ragged": (lambda: tctx.ccl.reduce_scatter(out, inp), ("reduce_scatter",)),
                "all_gather_config": (lambda: tctx.ccl.all_gather(tctx.zeros((world * RAGGED[0], RAGGED[1])), inp,
                                                                  config=Config()), ("config=",)),
                "all_to_all_config": (lambda: tctx.ccl.all_to_all(tctx.zeros(RAGGED[0], RAGGED[1] * world),
                                                                  tctx.zeros(RAGGED[0], RAGGED[1] * world),
                                                                  config=Config()), ("config=",)),
            }
            for label, (call, spelling) in refusals.items():
                _record(report, f"conventions/refusals/{label}",
                        _raises(call, iris.IrisError, *spelling, "upstream", "iris.iris("))
        with report.section("conventions/torch_style_still_works"):
            inputs = _per_rank(world, RAGGED, torch.float32, "torch_style")
            t = _on_heap(tctx, inputs[rank])
            tctx.ccl.all_reduce(t)
            _record(report, "conventions/torch_style_still_works/all_reduce_in_place",
                    _close_random(t, _reduce(inputs), torch.float32))
        with report.section("conventions/all_to_all"):
            # The same (M, N*W) data through both contexts: iris.iris()'s exchanges column blocks,
            # iris.create()'s exchanges flat segments (which cut across rows here).
            for M, n in CONVENTION_SHAPES:
                inputs = _per_rank(world, (M, n * world), torch.float32, "conventions", M, n)
                up_out = ctx.zeros((M, n * world), dtype=torch.float32)
                ctx.ccl.all_to_all(up_out, _on_heap(ctx, inputs[rank]))
                torch_out = tctx.zeros((M, n * world), dtype=torch.float32)
                tctx.ccl.all_to_all(torch_out, _on_heap(tctx, inputs[rank]))
                name = f"conventions/all_to_all/{M}x{n}x{world}"
                _record(report, f"{name}/iris_iris_column_blocks", _equal(up_out, _column_exchange(inputs, rank)))
                _record(report, f"{name}/iris_create_flat_segments", _equal(torch_out, _flat_exchange(inputs, rank)))
                report.check(f"{name}/the_two_differ", not torch.equal(up_out.cpu(), torch_out.cpu()))
    finally:
        tctx.barrier()
        tctx.destroy()


#: The worker's steps, in order, each in a section of its own (``worker/<name>``).
STEPS = (_check_all_reduce, _check_reduce_ops, _check_all_gather, _check_all_to_all, _check_reduce_scatter,
         _check_matmul_all_reduce, _check_all_gather_matmul, _check_matmul_all_gather, _check_matmul_reduce_scatter,
         _check_async, _check_conventions)


def _worker(rank: int, world: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.iris(heap_size=HEAP)
    report.check("context/is_upstream_style", type(ctx).__name__.endswith("Iris") and ctx.get_num_ranks() == world)
    for check in STEPS:
        with report.section(f"worker/{check.__name__}"):
            check(ctx, report)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def reports(request) -> list[dict]:
    world = request.param
    return reports_on_available_ranks(_worker, world, world, timeout=120)


def _assert_section(reports: list[dict], prefix: str, names) -> None:
    """The checks and sections named ``prefix*`` passed, and they are exactly ``names`` (each
    ``prefix`` + a name; or a function of the rank giving them) on every rank; the other
    sections' failures are the other tests'."""
    mine = [{k: v for k, v in rep.items() if k.startswith(prefix)} for rep in reports]
    assert_rank_checks(mine, prefix, (lambda rank: {prefix + name for name in names(rank)}) if callable(names)
                       else {prefix + name for name in names})


# -- the tests --------------------------------------------------------------------------------------


def test_context_from_iris_iris(reports):
    _assert_section(reports, "context/", {"is_upstream_style"})


def test_every_worker_step_completed(reports):
    # A step that raised outside its sections (set-up shared by several checks) shows here.
    _assert_section(reports, "worker/", {f"{step.__name__}/completed" for step in STEPS})


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_reduce_variants_distributions_dtypes(reports, variant):
    # Per call: the sum, the input unchanged, the workspace returned and what it records; then
    # upstream's fill check.
    fill_dtype, (rows, columns) = _upstream_fill(variant)
    _assert_section(reports, f"all_reduce/{variant}/", {
        f"d{distribution}/{_name(dtype)}/{RAGGED[0]}x{RAGGED[1]}{check}" for distribution, dtype in
        _all_reduce_cases(variant) for check in ("", "/input_unchanged", "/returns_its_workspace",
                                                 "/workspace_records_the_call")} | {
        f"upstream_fill/{_name(fill_dtype)}/{rows}x{columns}", "completed"})


def test_all_reduce_reused_workspace_and_example24(reports):
    _assert_section(reports, "all_reduce/reused_workspace/", {"call0", "call1", "not_prepared_after_a_call",
                                                              "completed"})
    _assert_section(reports, "all_reduce/example24/", {"default_config", "completed"})


def test_all_reduce_min_max_and_unsupported_ops(reports):
    _assert_section(reports, "all_reduce_op/", {"sum/float16", "min/float32", "max/bfloat16", "completed"} | {
        f"{op}_refused/{call}" for op in ("PRODUCT", "BAND") for call in ("all_reduce", "reduce_scatter")})


def test_all_gather(reports):
    world = len(reports)
    _assert_section(reports, "all_gather/persistent/", {_name(dtype) for dtype in DTYPES} | {"completed"})
    _assert_section(reports, "all_gather/example25/", {f"block{r}" for r in range(world)})
    # The partitioned variant needs comm_sms divisible by the world size: 64 where it is, else 63
    # and 64 refused.
    _assert_section(reports, "all_gather/partitioned/", {"comm_sms64", "completed"} if 64 % world == 0 else {
        "comm_sms63", "comm_sms64_not_divisible_refused", "completed"})
    _assert_section(reports, "all_gather/shape_mismatch/", {"same_as_input", "one_column_more", "one_block_short",
                                                            "completed"})


def test_all_to_all_column_blocks(reports):
    world = len(reports)
    calls = {f"{_name(dtype)}/{M}x{n}x{world}" for dtype, (M, n), _ in ALL_TO_ALL_CASES}
    _assert_section(reports, "all_to_all/", calls | {f"{call}/self_chunk" for call in calls} | {
        f"example26/block{s}" for s in range(world)} | {"completed"})


@pytest.mark.parametrize("case", REDUCE_SCATTER_CASES, ids=lambda c: f"{c[0]}x{c[1]}-b{c[2]}x{c[3]}-s{c[4]}")
@pytest.mark.parametrize("distribution", (0, 1))
def test_reduce_scatter_tile_ownership(reports, case, distribution):
    M, N, bm, bn, swizzle, dtype = case
    _assert_section(reports, f"reduce_scatter/{M}x{N}/b{bm}x{bn}/s{swizzle or 'default'}/d{distribution}/", {
        f"{_name(dtype)}/{check}" for check in ("owned_tiles_hold_the_sum", "other_tiles_untouched", "input_unchanged",
                                                "union_covers_every_element_once", "completed")})


def test_reduce_scatter_upstream_check_and_example27(reports):
    _assert_section(reports, "reduce_scatter/upstream_check/", {"d0/sum_of_outputs", "d1/sum_of_outputs", "completed"})
    # Example 27's owned tiles of upstream's 128 x 64 matrix, cdiv(T, W) per rank (the last ranks may own none).
    tiles = _cdiv(SMALL[0], EXAMPLE27_TILE[0]) * _cdiv(SMALL[1], EXAMPLE27_TILE[1])
    _assert_section(reports, "reduce_scatter/example27/",
                    lambda rank: {f"tile{t}" for t in _owned_tiles(tiles, len(reports), rank)})


def test_reduce_scatter_default_config_and_shape_errors(reports):
    _assert_section(reports, "reduce_scatter/default_config/", {"owned", "untouched", "completed"})
    _assert_section(reports, "reduce_scatter/shape_mismatch/", {"torch_style_shard", "one_column_more", "completed"})


def test_matmul_all_reduce(reports):
    module = {f"module/{variant}/{_name(dtype)}{check}" for dtype, variant in MATMUL_ALL_REDUCE_CASES
              for check in ("", "/workspace")}
    _assert_section(reports, "matmul_all_reduce/", module | {
        "module/completed", "namespace/default_config", "namespace/workspace", "namespace/completed", "example28",
        "bad_variant_refused"})


def _gather_matmul_names(example: str) -> set[str]:
    """The checks of all_gather_matmul's and matmul_all_gather's section: each call's result and
    workspace, and the example's call."""
    calls = {_name(dtype) + ("/bias" if with_bias else "") for dtype, with_bias in GATHER_MATMUL_CASES}
    return calls | {f"{call}/workspace" for call in calls} | {example, "completed"}


def test_all_gather_matmul(reports):
    _assert_section(reports, "all_gather_matmul/", _gather_matmul_names("example29_module_default_config"))


def test_matmul_all_gather(reports):
    _assert_section(reports, "matmul_all_gather/", _gather_matmul_names("example30"))


def test_matmul_reduce_scatter(reports):
    world, tile = len(reports), MATMUL_REDUCE_SCATTER_TILE

    def names(rank: int) -> set[str]:
        found = set()
        for form, (M, N, K), dtype in MATMUL_REDUCE_SCATTER_CASES:
            name = f"{form}/{M}x{N}x{K}/{_name(dtype)}"
            found |= {f"{name}/{check}" for check in ("owned_tiles_hold_the_sum", "other_tiles_zero", "workspace",
                                                      "completed")}
            tiles = _cdiv(M, tile) * _cdiv(N, tile)
            if tiles % world == 0:  # example 31's tiles, checked where its rule is upstream's
                found |= {f"{name}/example31_tile{t}" for t in _owned_tiles(tiles, world, rank)}
        return found

    _assert_section(reports, "matmul_reduce_scatter/", names)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "all_to_all", "matmul_all_reduce", "reduce_scatter"])
def test_async_op(reports, op):
    # Upstream's fused preambles barrier on every call: no count of barriers with async_op there;
    # reduce_scatter's result is checked after the async call alone.
    names = {"no_barrier_with_async_op", "result_after_barrier", "completed"}
    if op == "matmul_all_reduce":
        names = names - {"no_barrier_with_async_op"} | {"one_more_barrier_without"}
    elif op != "reduce_scatter":
        names |= {"one_more_barrier_without"}
    _assert_section(reports, f"async_op/{op}/", names)


def test_iris_create_refuses_upstream_calls(reports):
    _assert_section(reports, "conventions/refusals/", {
        "all_reduce_out_inp", "all_reduce_config", "all_reduce_workspace", "reduce_scatter_full_shape",
        "reduce_scatter_full_shape_ragged", "all_gather_config", "all_to_all_config", "completed"})
    _assert_section(reports, "conventions/torch_style_still_works/", {"all_reduce_in_place", "completed"})


def test_all_to_all_conventions_differ_as_documented(reports):
    world = len(reports)
    _assert_section(reports, "conventions/all_to_all/", {f"{M}x{n}x{world}/{check}" for M, n in CONVENTION_SHAPES
                                                         for check in ("iris_iris_column_blocks",
                                                                       "iris_create_flat_segments", "the_two_differ")}
                    | {"completed"})


# -- single-process: the configuration objects ------------------------------------------------------


def test_config_defaults_are_upstreams():
    c = Config()
    assert (c.block_size_m, c.block_size_n, c.swizzle_size, c.comm_sms) == (32, 64, 4, 64)
    assert (c.all_gather_variant, c.all_reduce_variant, c.all_reduce_distribution) == ("persistent", "two_shot", 1)
    assert (c.reduce_scatter_variant, c.all_reduce_num_rings, c.use_gluon) == ("two_shot", 1, False)
    assert c.all_reduce_ring_slice_n == c.block_size_n
    assert c.num_xcds >= 1 and c.chunk_size == min(c.swizzle_size ** 2, c.comm_sms // c.num_xcds)
    assert [(op.name, int(op)) for op in ReduceOp] == [("SUM", 0), ("PRODUCT", 1), ("MIN", 2), ("MAX", 3),
                                                       ("BAND", 4), ("BOR", 5), ("BXOR", 6)]


@pytest.mark.parametrize("bad", [
    dict(block_size_m=0), dict(block_size_n=-64), dict(swizzle_size=0), dict(comm_sms=0), dict(num_xcds=0),
    dict(all_reduce_num_rings=0), dict(all_reduce_variant="three_shot"), dict(all_gather_variant="bogus"),
    dict(all_reduce_distribution=2), dict(reduce_scatter_variant="one_shot"), dict(all_reduce_ring_slice_n=48),
    dict(all_reduce_ring_slice_n=128), dict(all_reduce_ring_slice_n=0),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        Config(**bad)


def test_config_fields_change_after_construction():
    config = Config(all_reduce_variant="two_shot")
    config.all_reduce_distribution = 0  # as upstream's all_reduce test does
    assert config.all_reduce_distribution == 0
    config.all_reduce_num_rings = min(2, config.comm_sms)
    assert config.all_reduce_num_rings == 2
    with pytest.raises(ValueError):
        config.all_reduce_distribution = 3
    with pytest.raises(ValueError):
        config.block_size_m = 0
    with pytest.raises(ValueError):
        config.all_reduce_variant = "bogus"


def test_fused_config_defaults_and_validation():
    assert iris.ops.FusedConfig is ops.FusedConfig
    c = ops.FusedConfig()
    assert (c.block_size_m, c.block_size_n, c.block_size_k, c.group_size_m) == (256, 64, 64, 1)
    assert (c.num_sms, c.num_xcds, c.chunk_size, c.all_reduce_variant) == (None, 1, 1, "two_shot")
    positional = ops.FusedConfig(64, 64, 32, all_reduce_variant="atomic")
    assert (positional.block_size_m, positional.block_size_n, positional.block_size_k) == (64, 64, 32)
    positional.validate(world_size=3)
    for bad in (dict(block_size_k=0), dict(group_size_m=0), dict(num_sms=0), dict(all_reduce_variant="bogus")):
        with pytest.raises(ValueError):
            ops.FusedConfig(**bad).validate()
    with pytest.raises(ValueError):
        ops.FusedConfig(block_size_n=64, all_reduce_variant="ring").validate(world_size=3)
    ops.FusedConfig(block_size_n=64, all_reduce_variant="ring").validate(world_size=2)
