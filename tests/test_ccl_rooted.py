"""Rooted collectives (``ctx.ccl.reduce``, ``gather``, ``scatter``), the reductions ``prod`` and
``avg``, and the 8-bit element types, across real ranks.

One spawn per world size (2 and 3 ranks) runs every check, and each rank returns
``{check name: True | False | error text}``:

- reduce, gather and scatter for every dtype (int8 and uint8 included), every reduction and every
  root, with heap and plain tensors: bit for bit against a reference computed from every rank's
  seeded input (reductions in rank order, 16-bit floats accumulated in float32, as the kernels do),
  and against torch.distributed on gloo, run in the same workers on the same data (its reduce,
  gather, scatter, and ReduceOp.PRODUCT; gloo sums 16-bit floats in their own type, so floats
  agree with it within a tolerance);
- ``avg`` against the sum divided by the world size; ``prod`` and ``avg`` through every all_reduce
  algorithm and reduce_scatter (and the sentinel's refusal of integers);
- fp8 moved bit for bit (every bit pattern, NaNs included) by all_gather, all_to_all, broadcast,
  gather and scatter;
- the errors every rank raises alike (a root that is not a rank, fp8 reductions, ``avg`` of
  integers), after which the context still works.

The two-rank world runs gather and scatter of every dtype from every root, and the new reductions
through every all_reduce algorithm; on 3 ranks each dtype takes one root and each new
reduction one algorithm, in turn (:func:`_grid`), so that every root and algorithm still meets
every world size. The two worlds cover what the rooted collectives depend on: a root that is
neither rank 0 nor the last rank (rank 1 of 3), an odd number of segments in gather and
scatter, non-roots on both sides of the root, and the one even world; a world of 4 runs the
same kernels with one more segment.

The session context (one rank, the root of every call) checks the errors only a root raises,
the algorithms' declarations of reductions and the call's signature.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

import iris
from iris.collectives import Algorithm, CollectiveCall, algorithm_registry, choose, register_algorithm
from iris.errors import IrisError
from iris.testing import RankReport, assert_rank_checks, reports_on_available_ranks, seeded_generator

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.int8, torch.uint8)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
OPS = ("sum", "prod", "max", "min", "avg")
#: torch.distributed's name of each reduction (iris takes either spelling).
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "avg": dist.ReduceOp.AVG}
#: Elements per rank, taken in turn: one element, a ragged block, and (CPU ranks: BLOCK 64,
#: ROUND 2, 2 programs) several pipelined rounds per program.
SIZES = (1, 37, 600)
ALL_REDUCE_ALGORITHMS = ("low_latency", "sentinel", "one_shot", "two_shot")
WORLDS = (2, 3)
#: Where all_reduce takes the new reductions: each named algorithm, then the automatic choice (None).
ALL_REDUCE_CHOICES = (*ALL_REDUCE_ALGORITHMS, None)
#: Integer dtypes whose avg the reducing collectives are checked to refuse.
AVG_REFUSED = (torch.int32, torch.uint8)


def _grid(world: int, index: int, count: int) -> range | tuple[int, ...]:
    """Which of ``count`` choices (roots, all_reduce choices) item ``index`` of a list (a dtype,
    a dtype and reduction) takes on ``world`` ranks: every one on two; on more, one in turn. What
    an item needs (its element type, its reduction) does not depend on the world size, and every
    choice still meets every world size; the two-rank world runs the whole grid."""
    return range(count) if world == 2 else (index % count,)


def _new_reductions():
    """(dtype, op) pairs the earlier collectives did not take: prod and avg, and every reduction
    of the 8-bit integers."""
    for dtype in DTYPES:
        for op in _ops(dtype):
            if op in ("prod", "avg") or dtype.itemsize == 1:
                yield dtype, op


def _others_pass_a_tensor(turn: int) -> bool:
    """Whether the ranks other than the root pass a tensor (else None) to the gather or scatter of ``turn``."""
    return turn % 3 == 0


def _bad_roots(world: int) -> tuple:
    """Roots that are not a rank of a world of ``world`` ranks."""
    return world, -1, "0", 1.0, True


def _ops(dtype: torch.dtype) -> tuple[str, ...]:
    """The reductions of ``dtype``: avg only for floating-point types."""
    return OPS if dtype.is_floating_point else OPS[:-1]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _data(dtype: torch.dtype, n: int, *seed) -> torch.Tensor:
    """Seeded values every rank can recompute: normal floats, integers of either sign, and every
    bit pattern of the 8-bit types (fp8 NaNs included; int8 and uint8 sums and products wrap)."""
    g = seeded_generator(*seed)
    if dtype.itemsize == 1:
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def _reference(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """Every rank's tensor reduced in rank order as the kernels reduce: 16-bit floats in float32,
    integers wrapping in their own type, avg the float32 sum divided by the world size."""
    acc = None
    for t in tensors:
        x = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
        if acc is None:
            acc = x
        elif op in ("sum", "avg"):
            acc = acc + x
        elif op == "prod":
            acc = acc * x
        else:
            acc = torch.maximum(acc, x) if op == "max" else torch.minimum(acc, x)
    if op == "avg":
        acc = acc / len(tensors)
    return acc.to(tensors[0].dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.cpu()), _bits(b.cpu()))


def _reduced_alike(t: torch.Tensor, expected: torch.Tensor) -> bool:
    """``t`` holds ``expected`` bit for bit, but that Triton's interpreter (CPU ranks) rounds
    float32 to bfloat16 toward zero, not to nearest: there a bfloat16 result may be one unit in
    the last place nearer zero."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu":
        return t.shape == expected.shape and torch.allclose(t.float(), expected.float(), rtol=2**-6, atol=0)
    return _same_bits(t, expected)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within torch.distributed's rounding of the same reduction (exact for integers)."""
    if not a.dtype.is_floating_point:
        return torch.equal(a.cpu(), b.cpu())
    tolerance = 2e-2 if a.element_size() == 2 else 1e-5
    return torch.allclose(a.cpu().float(), b.cpu().float(), rtol=tolerance, atol=tolerance)


def _raises(call, *fragments: str) -> bool:
    """Whether ``call()`` raises an IrisError whose message holds every fragment."""
    try:
        call()
    except IrisError as error:
        return all(f in str(error) for f in fragments)
    return False


class _Checks:
    """One rank's checks; tensors go on the heap or stay plain by turns."""

    def __init__(self, ctx, report: RankReport):
        self.ctx, self.report = ctx, report
        self.rank, self.world, self.device = ctx.rank, ctx.world_size, ctx.device
        self.turn = 0
        self.on_heap: list[torch.Tensor] = []

    def next_turn(self) -> int:
        self.turn += 1
        return self.turn

    def tensor(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` on the context's device: on the heap every other time, else a plain tensor."""
        values = values.to(self.device)
        if self.turn % 2:
            return values.clone()
        self.on_heap.append(self.ctx.as_symmetric(values))
        return self.on_heap[-1]

    def free(self) -> None:
        while self.on_heap:
            self.ctx.free(self.on_heap.pop())

    def everyone(self, dtype: torch.dtype, n: int, *seed) -> list[torch.Tensor]:
        return [_data(dtype, n, q, *seed) for q in range(self.world)]

    # -- reduce -----------------------------------------------------------------------------------

    def reduce(self) -> None:
        for dtype in DTYPES:
            for op in _ops(dtype):
                turn = self.next_turn()
                size, dst = SIZES[turn % len(SIZES)], turn % self.world
                name = f"reduce/{op}/{_name(dtype)}/n{size}/dst{dst}"
                mine = self.everyone(dtype, size, "reduce", op, str(dtype))
                t = self.tensor(mine[self.rank])
                spelled = REDUCE_OPS[op] if turn % 3 == 0 else op  # torch.distributed's spelling too
                returned = self.ctx.ccl.reduce(t, dst=dst, op=spelled)
                self.report.check(f"{name}/returns_the_tensor", returned is t)
                if self.rank == dst:
                    self.report.check(f"{name}/root_has_the_reduction", _reduced_alike(t, _reference(mine, op)))
                else:
                    self.report.check(f"{name}/others_unchanged", _same_bits(t, mine[self.rank]))
                if op == "avg":  # against iris's own sum of the same data, divided by the world size
                    summed = self.tensor(mine[self.rank])
                    self.ctx.ccl.reduce(summed, dst=dst, op="sum")
                    if self.rank == dst:
                        divided = summed.cpu().float() / self.world
                        self.report.check(f"{name}/sum_over_world", _same_bits(t, divided.to(dtype)) if
                                          dtype == torch.float32 else _close(t, divided))
                    continue
                theirs = mine[self.rank].clone()  # gloo: the same data, the same call
                dist.reduce(theirs, dst=dst, op=REDUCE_OPS[op])
                if self.rank == dst:
                    self.report.check(f"{name}/matches_gloo", _close(t, theirs))
        self.free()

    # -- gather and scatter -------------------------------------------------------------------------

    def gather(self) -> None:
        for i, dtype in enumerate(DTYPES + FP8):
            for dst in _grid(self.world, i, self.world):
                size = SIZES[self.next_turn() % len(SIZES)]
                name = f"gather/{_name(dtype)}/n{size}/dst{dst}"
                mine = self.everyone(dtype, size, "gather", dst, str(dtype))
                x = self.tensor(mine[self.rank])
                untouched = _data(dtype, self.world * size, "untouched", self.rank).view(self.world, size)
                if self.rank == dst:
                    out = untouched.to(self.device)
                else:  # None, or a tensor left as it was
                    out = untouched.to(self.device) if _others_pass_a_tensor(self.turn) else None
                returned = self.ctx.ccl.gather(out, x, dst=dst)
                self.report.check(f"{name}/returns_the_output", returned is out)
                if self.rank == dst:
                    self.report.check(f"{name}/in_rank_order", _same_bits(out, torch.stack(mine)))
                elif out is not None:
                    self.report.check(f"{name}/others_unchanged", _same_bits(out, untouched))
                self.report.check(f"{name}/input_unchanged", _same_bits(x, mine[self.rank]))
                if dtype in FP8:
                    continue  # gloo has no fp8
                listed = [torch.empty(size, dtype=dtype) for _ in range(self.world)] if self.rank == dst else None
                dist.gather(mine[self.rank].clone(), listed, dst=dst)
                if self.rank == dst:
                    self.report.check(f"{name}/matches_gloo", _same_bits(out, torch.stack(listed)))
        self.free()

    def scatter(self) -> None:
        for i, dtype in enumerate(DTYPES + FP8):
            for src in _grid(self.world, i, self.world):
                size = SIZES[self.next_turn() % len(SIZES)]
                name = f"scatter/{_name(dtype)}/n{size}/src{src}"
                segments = _data(dtype, self.world * size, "scatter", src, str(dtype)).view(self.world, size)
                # Every rank makes the same tensors (heap allocations are collective); the others
                # than the root pass None, or a tensor that is not read.
                inp = self.tensor(segments if self.rank == src else _data(dtype, self.world * size, "no", self.rank))
                if self.rank != src and not _others_pass_a_tensor(self.turn):
                    inp = None
                out = self.tensor(_data(dtype, size, "before", self.rank))
                returned = self.ctx.ccl.scatter(out, inp, src=src)
                self.report.check(f"{name}/returns_the_output", returned is out)
                self.report.check(f"{name}/my_segment", _same_bits(out, segments[self.rank]))
                if self.rank == src:
                    self.report.check(f"{name}/input_unchanged", _same_bits(inp, segments))
                if dtype in FP8:
                    continue
                theirs = torch.empty(size, dtype=dtype)
                dist.scatter(theirs, list(segments.unbind()) if self.rank == src else None, src=src)
                self.report.check(f"{name}/matches_gloo", _same_bits(out, theirs))
        self.free()

    def fp8_movement(self) -> None:
        """fp8 through the other data-movement collectives, bit for bit."""
        for dtype in FP8:
            size = SIZES[self.next_turn() % len(SIZES)]
            name = f"{_name(dtype)}/n{size}"
            mine = self.everyone(dtype, self.world * size, "fp8", str(dtype))
            out = torch.empty(self.world, self.world * size, dtype=dtype, device=self.device)
            self.ctx.ccl.all_gather(out, self.tensor(mine[self.rank]))
            self.report.check(f"fp8/all_gather/{name}", _same_bits(out, torch.stack(mine)))
            out = torch.empty(self.world * size, dtype=dtype, device=self.device)
            self.ctx.ccl.all_to_all(out, self.tensor(mine[self.rank]))
            expected = torch.cat([m[self.rank * size:(self.rank + 1) * size] for m in mine])
            self.report.check(f"fp8/all_to_all/{name}", _same_bits(out, expected))
            src = self.turn % self.world
            t = self.tensor(mine[self.rank])
            self.ctx.ccl.broadcast(t, src=src)
            self.report.check(f"fp8/broadcast/src{src}/{name}", _same_bits(t, mine[src]))
        self.free()

    # -- the new reductions through all_reduce and reduce_scatter ----------------------------------

    def all_reduce(self) -> None:
        pairs = list(_new_reductions())
        for choice, algorithm in enumerate(ALL_REDUCE_ALGORITHMS):
            for p, (dtype, op) in enumerate(pairs):
                if choice not in _grid(self.world, p, len(ALL_REDUCE_CHOICES)):
                    continue
                size = SIZES[self.next_turn() % len(SIZES)]
                name = f"all_reduce/{algorithm}/{op}/{_name(dtype)}/n{size}"
                mine = self.everyone(dtype, size, "all_reduce", algorithm, op, str(dtype))
                t = self.tensor(mine[self.rank])
                if algorithm == "sentinel" and not dtype.is_floating_point:
                    self.report.check(f"{name}/refused", _raises(
                        lambda: self.ctx.ccl.all_reduce(t, op=op, algorithm=algorithm),
                        "takes bfloat16, float16, float32 tensors"))
                    continue
                self.ctx.ccl.all_reduce(t, op=REDUCE_OPS[op] if self.turn % 3 == 0 else op, algorithm=algorithm)
                self.report.check(name, _reduced_alike(t, _reference(mine, op)))
                everyone = self.ctx.comm.all_gather_object(_bits(t.cpu()))
                self.report.check(f"{name}/identical_on_all_ranks", all(torch.equal(everyone[0], b) for b in everyone))
        for p, (dtype, op) in enumerate(pairs):  # the automatic choice takes them too
            if ALL_REDUCE_CHOICES.index(None) not in _grid(self.world, p, len(ALL_REDUCE_CHOICES)):
                continue
            size = SIZES[self.next_turn() % len(SIZES)]
            mine = self.everyone(dtype, size, "all_reduce", "auto", op, str(dtype))
            t = self.tensor(mine[self.rank])
            self.ctx.ccl.all_reduce(t, op=op)
            self.report.check(f"all_reduce/auto/{op}/{_name(dtype)}/n{size}", _reduced_alike(t, _reference(mine, op)))
        self.free()

    def reduce_scatter(self) -> None:
        for dtype, op in _new_reductions():
            size = SIZES[self.next_turn() % len(SIZES)]
            name = f"reduce_scatter/{op}/{_name(dtype)}/n{size}"
            mine = self.everyone(dtype, self.world * size, "reduce_scatter", op, str(dtype))
            out = self.tensor(torch.zeros(size, dtype=dtype))
            self.ctx.ccl.reduce_scatter(out, self.tensor(mine[self.rank]), op=op)
            expected = _reference(mine, op)[self.rank * size:(self.rank + 1) * size]
            self.report.check(name, _reduced_alike(out, expected))
        self.free()

    # -- errors every rank raises alike -------------------------------------------------------------

    def errors(self) -> None:
        ccl, world, device = self.ctx.ccl, self.world, self.device
        x = torch.ones(8, device=device)
        for root in _bad_roots(world):
            for name, call in (("reduce", lambda: ccl.reduce(x, dst=root)),
                               ("gather", lambda: ccl.gather(torch.ones(world, 8, device=device), x, dst=root)),
                               ("scatter", lambda: ccl.scatter(x, torch.ones(world * 8, device=device), src=root))):
                key = "src" if name == "scatter" else "dst"
                self.report.check(f"errors/{name}/root_{root!r}", _raises(
                    call, f"{name}: {key}={root!r} is not a rank of this world (ranks 0..{world - 1})"))
        for dtype in FP8:
            t = torch.zeros(world * 4, dtype=dtype, device=device)
            for name, call in (("reduce", lambda: ccl.reduce(t)), ("all_reduce", lambda: ccl.all_reduce(t)),
                               ("reduce_scatter", lambda: ccl.reduce_scatter(t[:4].clone(), t))):
                self.report.check(f"errors/{name}/{_name(dtype)}", _raises(
                    call, f"{name}: {dtype} tensors are moved, not reduced; cast to torch.bfloat16", "float32",
                    "accumulate in float32"))
        for dtype in AVG_REFUSED:
            t = torch.ones(world * 4, dtype=dtype, device=device)
            for name, call in (("reduce", lambda: ccl.reduce(t, op="avg")),
                               ("all_reduce", lambda: ccl.all_reduce(t, op=dist.ReduceOp.AVG)),
                               ("reduce_scatter", lambda: ccl.reduce_scatter(t[:4].clone(), t, op="avg"))):
                self.report.check(f"errors/{name}/avg_{_name(dtype)}", _raises(
                    call, f"{name}: op='avg' takes floating-point tensors, this one is {dtype}", "op='sum'",
                    f"divide the result by the world size ({world})"))
        # After the refusals the context works, and none of them made a call.
        t = torch.full((5,), float(self.rank + 1), device=device)
        ccl.reduce(t, dst=world - 1, op="prod")
        expected = float(torch.arange(1, world + 1).prod()) if self.rank == world - 1 else float(self.rank + 1)
        self.report.check("errors/then_a_call_succeeds", bool((t.cpu() == expected).all()))


def _worker(rank: int, world: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create(heap_size="16MiB")
    checks = _Checks(ctx, report)
    for section in ("reduce", "gather", "scatter", "fp8_movement", "all_reduce", "reduce_scatter", "errors"):
        with report.section(section):
            getattr(checks, section)()
    ctx.barrier()
    report.check("no_wait_failed/after_every_section", not ctx.failed)
    ctx.destroy()
    return report.packed()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def reports(request) -> list[dict]:
    return reports_on_available_ranks(_worker, request.param, request.param, timeout=120)


def _world(reports) -> int:
    return len(reports)


def test_reduce_matches_gloo_and_the_reference_for_every_dtype_op_and_root(reports):
    world = _world(reports)
    calls = sum(len(_ops(d)) for d in DTYPES)
    # Every call: on every rank the tensor returned and the result (the root's reduction, the
    # others' input unchanged); on the root gloo's result (avg: iris's sum over the world size).
    # Then every rank's reduce/completed.
    assert_rank_checks(reports, "reduce/", calls * (2 * world + 1) + world)
    roots = {part for k in reports[0] if k.startswith("reduce/") for part in k.split("/") if part.startswith("dst")}
    assert roots == {f"dst{r}" for r in range(world)}, roots


def _assert_every_root(reports, collective: str, key: str) -> None:
    """Every rank of the world was the root of some ``collective`` call."""
    roots = {part for k in reports[0] if k.startswith(f"{collective}/") for part in k.split("/")
             if part.startswith(key)}
    assert roots == {f"{key}{r}" for r in range(_world(reports))}, roots


def test_gather_matches_gloo_for_every_dtype_and_root(reports):
    world = _world(reports)
    turn = sum(len(_ops(d)) for d in DTYPES)  # the reduce calls take the turns before the gathers
    checks = world  # every rank's gather/completed
    for i, dtype in enumerate(DTYPES + FP8):
        for _ in _grid(world, i, world):
            turn += 1
            # On every rank: the output returned, the input unchanged. On the root: the output in
            # rank order, and gloo's (which has no fp8). On the others: their output unchanged,
            # where they pass one.
            checks += 2 * world + 1 + (dtype not in FP8) + (world - 1) * _others_pass_a_tensor(turn)
    assert_rank_checks(reports, "gather/", checks)
    _assert_every_root(reports, "gather", "dst")


def test_scatter_matches_gloo_for_every_dtype_and_root(reports):
    world = _world(reports)
    calls = [dtype for i, dtype in enumerate(DTYPES + FP8) for _ in _grid(world, i, world)]
    # On every rank: the output returned, this rank's segment, gloo's (which has no fp8). On the
    # root: its input unchanged. Then every rank's scatter/completed.
    checks = sum(2 * world + 1 + world * (dtype not in FP8) for dtype in calls) + world
    assert_rank_checks(reports, "scatter/", checks)
    _assert_every_root(reports, "scatter", "src")


def test_fp8_moves_bit_for_bit_through_every_data_movement_collective(reports):
    movements = ("all_gather", "all_to_all", "broadcast")
    assert_rank_checks(reports, "fp8/", len(movements) * len(FP8) * _world(reports))
    assert {k.split("/")[1] for k in reports[0] if k.startswith("fp8/")} == set(movements)


def test_prod_avg_and_8_bit_integers_through_every_all_reduce_algorithm(reports):
    world = _world(reports)
    pairs = list(_new_reductions())
    # Per rank: each algorithm's result and that it is the same on every rank, or the sentinel's
    # refusal of integers; the automatic choice's result; all_reduce/completed.
    per_rank = sum(1 if algorithm == "sentinel" and not dtype.is_floating_point else 2
                   for choice, algorithm in enumerate(ALL_REDUCE_ALGORITHMS) for p, (dtype, _) in enumerate(pairs)
                   if choice in _grid(world, p, len(ALL_REDUCE_CHOICES)))
    per_rank += sum(ALL_REDUCE_CHOICES.index(None) in _grid(world, p, len(ALL_REDUCE_CHOICES))
                    for p in range(len(pairs))) + 1
    assert_rank_checks(reports, "all_reduce/", per_rank * world)
    assert any(k.endswith("/refused") for k in reports[0])
    taken = {k.split("/")[1] for k in reports[0] if k.startswith("all_reduce/") and not k.endswith("/completed")}
    assert taken == {*ALL_REDUCE_ALGORITHMS, "auto"}, taken


def test_prod_avg_and_8_bit_integers_through_reduce_scatter(reports):
    # Per rank: one call of each pair, and reduce_scatter/completed.
    assert_rank_checks(reports, "reduce_scatter/", (len(list(_new_reductions())) + 1) * _world(reports))


def test_bad_roots_fp8_reductions_and_integer_averages_raise_on_every_rank(reports):
    world = _world(reports)
    reducing = ("reduce", "all_reduce", "reduce_scatter")
    assert_rank_checks(reports, "errors/", {f"errors/{call}/root_{root!r}" for root in _bad_roots(world)
                                            for call in ("reduce", "gather", "scatter")} | {
        f"errors/{call}/{_name(dtype)}" for dtype in FP8 for call in reducing} | {
        f"errors/{call}/avg_{_name(dtype)}" for dtype in AVG_REFUSED for call in reducing} | {
        "errors/then_a_call_succeeds", "errors/completed"})
    assert_rank_checks(reports, "no_wait_failed/", {"no_wait_failed/after_every_section"})


# -- single-rank checks (the session context: rank 0 is every call's root) -------------------------------------


def test_the_rooted_collectives_are_registered(ctx):
    for collective in ("reduce", "gather", "scatter"):
        assert ctx.ccl.algorithms(collective) == ["direct"]
        assert choose(collective, 1 << 20, 4, torch.bfloat16, "cuda", "triton").name == "direct"


def test_single_rank_rooted_collectives_are_identities(ctx):
    x = torch.randn(100, device=ctx.device)
    t = x.clone()
    for op in OPS:
        ctx.ccl.reduce(t, op=op)
        assert torch.equal(t, x), op
    out = torch.empty(1, 100, device=ctx.device)
    assert ctx.ccl.gather(out, x) is out and torch.equal(out[0], x)
    out = torch.empty(100, device=ctx.device)
    assert ctx.ccl.scatter(out, x) is out and torch.equal(out, x)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda c: c.ccl.gather(None, torch.ones(4, device=c.device)),
         "gather: rank 0 is the dst and must pass output, a tensor of world_size x input's elements (1 x 4); the "
         "other ranks pass output=None"),
        (lambda c: c.ccl.scatter(torch.ones(4, device=c.device), None),
         "scatter: rank 0 is the src and must pass input, a tensor of world_size x output's elements (1 x 4); the "
         "other ranks pass input=None"),
        (lambda c: c.ccl.gather(torch.ones(5, device=c.device), torch.ones(4, device=c.device)),
         "gather: output has 5 elements; it needs world_size x input = 1 x 4 = 4"),
        (lambda c: c.ccl.scatter(torch.ones(4, device=c.device), torch.ones(3, device=c.device)),
         "scatter: input has 3 elements; it needs world_size x output = 1 x 4 = 4"),
        (lambda c: c.ccl.gather(torch.ones(4, dtype=torch.int8, device=c.device), torch.ones(4, device=c.device)),
         "gather: output dtype torch.int8 differs from input dtype torch.float32"),
        (lambda c: c.ccl.scatter(torch.ones(4, device=c.device), torch.ones(4, dtype=torch.uint8, device=c.device)),
         "scatter: output dtype torch.float32 differs from input dtype torch.uint8"),
        (lambda c: (lambda t: c.ccl.gather(t[:4], t[2:6]))(torch.ones(8, device=c.device)),
         "gather: output and input overlap in memory"),
        (lambda c: c.ccl.reduce(torch.ones(4, dtype=torch.float64, device=c.device)),
         "reduce: tensor has dtype torch.float64; supported: torch.float32"),
        (lambda c: c.ccl.reduce(torch.ones(4, 4, device=c.device).t()), "reduce: tensor is not contiguous"),
        (lambda c: c.ccl.scatter(torch.ones(4, device=c.device), torch.ones(4, device=c.device), src=1),
         "scatter: src=1 is not a rank of this world (ranks 0..0)"),
        (lambda c: c.ccl.reduce(torch.ones(4, device=c.device), op="avg", algorithm="ring"),
         "unknown reduce algorithm 'ring'; installed: ['direct']"),
    ],
    ids=["gather_output_missing", "scatter_input_missing", "gather_size", "scatter_size", "gather_dtype",
         "scatter_dtype", "gather_overlap", "reduce_dtype", "reduce_contiguity", "scatter_src", "unknown_algorithm"],
)
def test_bad_rooted_calls_raise_clear_errors(ctx, call, message):
    with pytest.raises(IrisError) as raised:
        call(ctx)
    assert message in str(raised.value)


def test_an_unknown_reduction_lists_the_reductions(ctx):
    for op in ("band", dist.ReduceOp.BXOR):
        with pytest.raises(ValueError, match=r"op must be one of sum, prod, max, min, avg \(or "
                                             r"torch.distributed.ReduceOp.SUM, PRODUCT, MAX, MIN or AVG\)"):
            ctx.ccl.reduce(torch.ones(4, device=ctx.device), op=op)


def test_a_tensor_on_another_device_is_rejected_by_the_rooted_collectives(ctx):
    if ctx.device.type == "cpu":
        pytest.skip("needs a GPU context to have another device")
    with pytest.raises(IrisError, match="move it with"):
        ctx.ccl.reduce(torch.ones(4))
    with pytest.raises(IrisError, match="move it with"):
        ctx.ccl.gather(torch.ones(1, 4), torch.ones(4, device=ctx.device))


@contextmanager
def _registered(algorithm: Algorithm):
    with algorithm_registry(algorithm.collective).restored():
        register_algorithm(algorithm)
        yield algorithm


def test_an_algorithm_declaring_its_reductions_is_chosen_and_named_for_those_only(ctx):
    # A sum-only all_reduce of the highest priority: the automatic choice takes it for sums and
    # skips it for the other reductions; named for one of those, it is refused with the reason.
    seen = []
    sums = Algorithm(name="test_sums_only", collective="all_reduce", run=lambda call: seen.append(call.op),
                     languages=(), ops={"sum"}, priority=100)
    with _registered(sums):
        assert choose("all_reduce", 64, 2, torch.float32, "cuda", "triton", "sum").name == "test_sums_only"
        assert choose("all_reduce", 64, 2, torch.float32, "cuda", "triton", "prod").name == "low_latency"
        assert choose("all_reduce", 64, 2, torch.float32, "cuda", "triton").name == "test_sums_only"  # any op
        x = ctx.ones(16)
        ctx.ccl.all_reduce(x)
        ctx.ccl.all_reduce(x, op="max")
        assert seen == ["sum"]  # max ran a built-in
        assert "test_sums_only" not in ctx.ccl.algorithms("all_reduce", applying_to=x, op=dist.ReduceOp.AVG)
        assert "test_sums_only" in ctx.ccl.algorithms("all_reduce", applying_to=x, op="sum")
        with pytest.raises(IrisError, match=r"all_reduce: algorithm 'test_sums_only' cannot run this call: it takes "
                                            r"the reductions sum, this call has op='avg'; choose one of "
                                            r"\['low_latency', 'one_shot', 'sentinel', 'two_shot'\]"):
            ctx.ccl.all_reduce(x, op="avg", algorithm="test_sums_only")
        ctx.free(x)
    with pytest.raises(ValueError, match="'ops'"):
        Algorithm(name="test_bad", collective="all_reduce", run=lambda call: None, languages=(), ops={"mean"})


def test_the_built_in_reductions_take_every_reduction():
    for collective in ("all_reduce", "reduce_scatter", "reduce"):
        registry = algorithm_registry(collective)
        for name in registry.names():
            assert registry.get(name).ops is None, (collective, name)


class _World:
    def __init__(self, world_size: int):
        self.world_size = world_size


def test_the_signature_holds_the_root_and_what_every_rank_passes():
    world = _World(3)

    def call(collective, output, input, src, op="sum"):
        return CollectiveCall(context=world, collective=collective, output=output, input=input, op=op, src=src)

    x, out = torch.ones(8), torch.ones(24)
    for collective, root_call, other_call in (
            ("gather", call("gather", out, x, 1), call("gather", None, x, 1)),
            ("scatter", call("scatter", x, out, 1), call("scatter", x, None, 1)),
            ("reduce", call("reduce", x, x, 1), call("reduce", None, x, 1))):
        assert root_call.signature == other_call.signature, collective  # the root's tensors are no part of it
        assert root_call.nbytes == other_call.nbytes == (96 if collective == "scatter" else 32), collective
        assert call(collective, None if collective != "scatter" else x, x, 2).signature != other_call.signature
    assert call("reduce", None, x, 1, "sum").signature != call("reduce", None, x, 1, "prod").signature
    assert call("reduce", None, x, 1).signature != call("gather", None, x, 1).signature
