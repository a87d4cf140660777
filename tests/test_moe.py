"""MoE token routing (``ctx.ops.moe_dispatch`` / ``ctx.ops.moe_combine``) across real CPU ranks,
against a reference built on ``torch.distributed.all_to_all_single`` (gloo) in the same workers.

One spawn per world size (2, 3) makes every check. Routings are drawn from seeds every rank
shares: random top-k (k = 1 and k > 1), every token to one expert (also naming it in every slot:
a duplicate goes once, both weights count), experts that get no token, a rank that sends nothing
(all its ids -1), only local experts, an explicit capacity that just fits, fp32 and fp16 tokens,
and fp8. For each, the received tokens of every local expert must be exactly the reference's, in
(source rank, source token index) order, with their counts, sources and zero / -1 after them;
combine's output, from the expert function ``f_e(x) = x * (e + 1)`` applied on the receiving
rank, must be exactly ``sum_j w[t, j] * f_{e(t, j)}(x_t)`` computed the same way at the source.
Then calls in a row (dispatches first, combines after, in another order), calls the host refuses,
and calls the device fails (an expert over capacity, ids out of range), each on a fresh context.
The GPU test captures dispatch and combine of one rank in a CUDA graph and replays it.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

import iris
from iris.errors import CallMismatchError, IrisError, IrisTimeoutError
from iris.testing import (RankReport, assert_rank_checks, interpreted_device, reports_on_available_ranks,
                          seeded_generator, spawn_reports)

HIDDEN = 8
TOKENS = 6
#: (name, topk, experts per rank, dtype, fp8); each case's routing is made by :func:`_routing`.
CASES = (("random", 2, 2, torch.bfloat16, False), ("random_k1", 1, 2, torch.bfloat16, False),
         ("one_expert", 1, 1, torch.bfloat16, False), ("one_expert_every_slot", 3, 2, torch.bfloat16, False),
         ("idle_experts", 2, 2, torch.float16, False), ("rank_sends_nothing", 2, 1, torch.bfloat16, False),
         ("local_only", 2, 2, torch.float32, False), ("tight_capacity", 2, 2, torch.bfloat16, False),
         ("fp8", 2, 2, torch.bfloat16, True))
#: Dispatches in flight at once: their results are views of receive buffers that alternate.
BACK_TO_BACK = 2
#: Rounds of dispatches of two shapes in a row (:func:`_check_back_to_back`).
ACROSS_SHAPES_ROUNDS = 4


def _routing(case: str, rank: int, world: int, k: int, experts: int, *seed) -> torch.Tensor:
    """This rank's topk_ids [TOKENS, k] (int64, -1: nowhere) for ``case``."""
    g = seeded_generator(case, rank, world, *seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(TOKENS)])
    if case == "one_expert":
        ids.fill_(experts - 1)
    elif case == "one_expert_every_slot":
        ids.fill_(1 % experts)
    elif case == "idle_experts":  # the odd experts get nothing
        ids = torch.stack([torch.randperm(experts // 2, generator=g)[:k] * 2 for _ in range(TOKENS)])
    elif case == "rank_sends_nothing" and rank == 0:
        ids.fill_(-1)
    elif case == "local_only":
        local = experts // world
        ids = torch.stack([torch.randperm(local, generator=g)[:k] + rank * local for _ in range(TOKENS)])
    if case in ("random", "fp8"):
        ids[0, -1] = -1  # one slot routed nowhere
    return ids


def _tokens(dtype: torch.dtype, rank: int, *seed) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=seeded_generator("tokens", rank, *seed)).to(dtype)


def _weights(k: int, rank: int, *seed) -> torch.Tensor:
    return torch.rand(TOKENS, k, generator=seeded_generator("weights", rank, *seed))


def _quantised(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float8_e4m3fn with a float32 scale: amax / 448 (1 for an all-zero token)."""
    amax = x.float().abs().amax(1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _reference_dispatch(x: torch.Tensor, ids: torch.Tensor, experts: int, world: int, rank: int, fp8: bool,
                        quantise_on: str = "cpu"):
    """Per local expert: the rows it receives (bits as int8 bytes), their source ranks and token
    indices, in (source rank, token) order; by gloo's all_to_all_single. ``quantise_on``: the
    device whose float8 conversion the rows are quantised with (CPU and GPU conversions may round
    a value at the edge of the range differently)."""
    local = experts // world
    data, scale = (t.cpu() for t in _quantised(x.to(quantise_on))) if fp8 else (x, torch.zeros(x.shape[0]))
    row_bytes = data.contiguous().view(torch.int8).shape[1]
    pairs = sorted({(int(e), t) for t in range(ids.shape[0]) for e in ids[t].tolist() if e >= 0})
    by_rank = [[(e, t) for e, t in pairs if e // local == d] for d in range(world)]
    sends = [len(p) for p in by_rank]
    receives = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(receives, torch.tensor(sends))
    order = [p for part in by_rank for p in part]
    meta = torch.tensor([[e, t] for e, t in order], dtype=torch.int64).view(-1, 2)
    rows = data.contiguous().view(torch.int8)[[t for _, t in order]].view(-1, row_bytes)
    scales = scale[[t for _, t in order]].view(-1, 1)
    got_meta = torch.empty(int(receives.sum()), 2, dtype=torch.int64)
    got_rows = torch.empty(int(receives.sum()), row_bytes, dtype=torch.int8)
    got_scales = torch.empty(int(receives.sum()), 1)
    for out, inp in ((got_meta, meta), (got_rows, rows), (got_scales, scales)):
        dist.all_to_all_single(out, inp, receives.tolist(), sends)
    source = torch.repeat_interleave(torch.arange(world), receives)
    experts_of = []
    for e in range(local):
        here = [i for i in range(len(source)) if got_meta[i, 0] == rank * local + e]
        here.sort(key=lambda i: (int(source[i]), int(got_meta[i, 1])))
        experts_of.append(dict(rows=got_rows[here], source=source[here], index=got_meta[here, 1],
                               scales=got_scales[here, 0]))
    return experts_of


def _expert_function(tokens: torch.Tensor, scales, first_expert: int, dtype: torch.dtype) -> torch.Tensor:
    """``f_e(x) = x * (e + 1)`` on the received tokens ``[L, capacity, hidden]`` (fp8: dequantised
    first), in ``dtype``."""
    x = tokens.float() if scales is None else tokens.float() * scales[..., None]
    factor = torch.arange(first_expert + 1, first_expert + 1 + tokens.shape[0], dtype=torch.float32,
                          device=tokens.device)
    return (x * factor.view(-1, 1, 1)).to(dtype)


def _reference_combine(x, ids, w, fp8, dtype) -> torch.Tensor:
    """``sum_j w[t, j] * f_{ids[t, j]}(x_t)`` in float32, slot by slot, as the expert saw x_t."""
    seen = x.float() if not fp8 else (lambda q, s: q.float() * s[:, None])(*_quantised(x))
    total = torch.zeros(TOKENS, HIDDEN)
    for j in range(ids.shape[1]):
        e = ids[:, j]
        rows = torch.where((e >= 0)[:, None], (seen * (e + 1).float()[:, None]).to(dtype), torch.zeros((), dtype=dtype))
        total.addcmul_(rows.float(), torch.where(e >= 0, w[:, j], 0.0)[:, None])
    return total.to(dtype)


def _check_result(report: RankReport, name: str, result, reference, capacity: int, fp8: bool, dtype) -> None:
    counts = [len(r["index"]) for r in reference]
    report.check(f"dispatch/{name}/counts", result.counts.tolist() == counts)
    ok = result.tokens.shape == (len(reference), capacity, HIDDEN)
    ok &= result.tokens.dtype == (torch.float8_e4m3fn if fp8 else dtype)
    for e, ref in enumerate(reference):
        n = counts[e]
        got = _bits(result.tokens[e]).contiguous().view(torch.int8).view(capacity, -1)
        ok &= torch.equal(got[:n], ref["rows"])
        ok &= result.source_rank[e, :n].tolist() == ref["source"].tolist()
        ok &= result.source_index[e, :n].tolist() == ref["index"].tolist()
        ok &= bool((result.source_rank[e, n:] == -1).all() and (result.source_index[e, n:] == -1).all())
        if fp8:
            ok &= torch.equal(result.scales[e, :n], ref["scales"])
    report.check(f"dispatch/{name}/tokens_in_source_order", ok)
    report.check(f"dispatch/{name}/scales", (result.scales is not None) == fp8)


def _check_cases(ctx, report: RankReport, cases=CASES) -> None:
    rank, world = ctx.rank, ctx.world_size
    for name, k, per_rank, dtype, fp8 in cases:
        experts = per_rank * world
        ids = _routing(name, rank, world, k, experts)
        x, w = _tokens(dtype, rank, name), _weights(k, rank, name)
        reference = _reference_dispatch(x, ids, experts, world, rank, fp8)
        capacity = None
        if name == "tight_capacity":  # the most any expert receives, the same on every rank
            most = torch.tensor([max(len(r["index"]) for r in reference)])
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            capacity = int(most)
        ids_in = ids.int() if k == 1 else ids
        result = ctx.ops.moe_dispatch(x, ids_in, w, experts, capacity=capacity, fp8=fp8)
        _check_result(report, name, result, reference, capacity or world * TOKENS, fp8, dtype)
        expert_out = _expert_function(result.tokens, result.scales, rank * per_rank,
                                      torch.bfloat16 if fp8 else dtype)
        y = ctx.ops.moe_combine(expert_out, result)
        report.check(f"combine/{name}", y.dtype == expert_out.dtype and torch.equal(
            y, _reference_combine(x, ids, w, fp8, expert_out.dtype)))
    report.check("combine/no_failure", not ctx.failed)


def _check_back_to_back(ctx, report: RankReport) -> None:
    """Dispatches in a row with new routings, then their combines in reverse order (a handle holds
    all its combine needs, whatever ran since)."""
    rank, world = ctx.rank, ctx.world_size
    experts, k = 2 * world, 2
    calls = []
    for i in range(BACK_TO_BACK):
        ids = _routing("random", rank, world, k, experts, "b2b", i)
        x, w = _tokens(torch.bfloat16, rank, "b2b", i), _weights(k, rank, "b2b", i)
        calls.append((x, ids, w, ctx.ops.moe_dispatch(x, ids, w, experts)))
    combine_plans = []
    for i, (x, ids, w, result) in reversed(list(enumerate(calls))):
        _check_result(report, f"back_to_back/{i}", result, _reference_dispatch(x, ids, experts, world, rank, False),
                      world * TOKENS, False, torch.bfloat16)
        y = ctx.ops.moe_combine(_expert_function(result.tokens, None, rank * 2, torch.bfloat16), result.handle)
        report.check(f"combine/back_to_back/{i}", torch.equal(y, _reference_combine(x, ids, w, False, torch.bfloat16)))
        combine_plans.append(dict(result.handle.plan.combines))
    # The first call of a shape leaves a plan (iris_triton.operations.moe_plans); the later ones,
    # of other tensors, run by it (their results checked above).
    plan = calls[0][3].handle.plan
    report.check("plans/dispatch", plan is not None and all(result.handle.plan is plan for *_, result in calls))
    report.check("plans/combine", all([len(plans) for plans in made.values()] == [1] for made in combine_plans))
    # Fewer tokens, with the same options and alignment: a plan of their own, never the other's;
    # then the first shape again by its plan.
    half = TOKENS // 2
    x, ids, w = calls[0][0][:half], calls[0][1][:half], calls[0][2][:half]
    fewer = [ctx.ops.moe_dispatch(x, ids, w, experts) for _ in range(2)][-1]
    _check_result(report, "plans/fewer_tokens", fewer, _reference_dispatch(x, ids, experts, world, rank, False),
                  world * half, False, torch.bfloat16)
    again = ctx.ops.moe_dispatch(*calls[0][:3], experts)
    report.check("plans/per_layout", fewer.handle.plan not in (None, plan) and again.handle.plan is plan)
    # Both shapes by their plans, each dispatch of all tokens combined after one of fewer: the
    # parities' buffers never overlap whatever the shapes, and a combine reads nothing that a
    # peer's next dispatch rewrites (a rank that runs ahead into it, in one of the rounds).
    exact, counted_in = [], set()
    for _ in range(ACROSS_SHAPES_ROUNDS):
        full = ctx.ops.moe_dispatch(*calls[0][:3], experts)
        ctx.ops.moe_dispatch(x, ids, w, experts)
        y = ctx.ops.moe_combine(_expert_function(full.tokens, None, rank * 2, torch.bfloat16), full.handle)
        exact.append(torch.equal(y, _reference_combine(*calls[0][:3], False, torch.bfloat16)))
        counted_in.add((full.counts.data_ptr(), full.counts._base is not None))  # a view, the same each time
    report.check("plans/across_shapes", all(exact))
    # A planned dispatch's counts are its parity's, in a workspace, as its tokens are: not allocated.
    report.check("plans/counts_in_workspace", len(counted_in) == 1 and next(iter(counted_in))[1])


#: The cases compiled with torch.compile (fullgraph): a 16-bit one and fp8.
COMPILED_CASES = ("random", "fp8")


def _written(tensor: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The bits of a dispatch result's rows each expert received (``counts``: the rows past them
    are not written in ``tokens``), or of all of ``counts`` itself."""
    if tensor.dim() == 1:
        return tensor
    return torch.cat([tensor[e, :int(c)].reshape(-1).view(torch.uint8) for e, c in enumerate(counts)])


def _check_compiled(ctx, report: RankReport) -> None:
    """Dispatch, the expert function and combine in one compiled graph (torch.compile, fullgraph,
    aot_eager): the operators torch.ops.iris.moe_dispatch / moe_combine give what the eager calls
    give, bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    rank, world = ctx.rank, ctx.world_size
    for name in COMPILED_CASES:
        _, k, per_rank, dtype, fp8 = next(case for case in CASES if case[0] == name)
        experts = per_rank * world
        ids = _routing(name, rank, world, k, experts, "compiled")
        x, w = _tokens(dtype, rank, name, "compiled"), _weights(k, rank, name, "compiled")
        eager = ctx.ops.moe_dispatch(x, ids, w, experts, fp8=fp8)
        fields = ("tokens", "scales", "counts", "source_rank", "source_index")
        expected = {f: getattr(eager, f).clone() for f in fields if getattr(eager, f) is not None}
        ctx.ops.moe_combine(_expert_function(eager.tokens, eager.scales, rank * per_rank,
                                             torch.bfloat16 if fp8 else dtype), eager)

        def step(x, ids, w):
            result = ctx.ops.moe_dispatch(x, ids, w, experts, fp8=fp8)
            expert_out = _expert_function(result.tokens, result.scales, rank * per_rank,
                                          torch.bfloat16 if fp8 else dtype)
            received = {f: getattr(result, f).clone() for f in fields if getattr(result, f) is not None}
            return received, ctx.ops.moe_combine(expert_out, result)

        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(step, fullgraph=True, backend=counter)
        compiled(x, ids, w)  # the compiled step again and again (its operator's dispatch then runs by plan)
        received, y = compiled(x, ids, w)
        report.check(f"compiled/{name}/dispatch", received.keys() == expected.keys() and all(
            torch.equal(_written(received[f], expected["counts"]), _written(expected[f], expected["counts"]))
            for f in expected))
        report.check(f"compiled/{name}/combine", torch.equal(
            y, _reference_combine(x, ids, w, fp8, torch.bfloat16 if fp8 else dtype)))
        report.check(f"compiled/{name}/one_graph", counter.frame_count == 1)


def _raises(call, *fragments, kind=IrisError) -> bool | str:
    try:
        call()
    except (kind, TypeError) as error:
        missing = [f for f in fragments if f not in str(error)]
        return True if not missing else f"message {str(error)!r} lacks {missing}"
    return "did not raise"


def _check_host_errors(ctx, report: RankReport) -> None:
    """Calls refused on the host, before any exchange (every rank refuses alike)."""
    world = ctx.world_size
    x, ids, w = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16), torch.zeros(TOKENS, 2, dtype=torch.int64), \
        torch.ones(TOKENS, 2)
    dispatch = ctx.ops.moe_dispatch
    cases = {
        "tokens_dims": (lambda: dispatch(x.view(-1), ids, w, world), "tokens must have 2 dimensions"),
        "tokens_dtype": (lambda: dispatch(x.int(), ids, w, world), "tokens has dtype torch.int32"),
        "ids_dtype": (lambda: dispatch(x, ids.float(), w, world), "topk_ids has dtype torch.float32"),
        "ids_rows": (lambda: dispatch(x, ids[1:], w[1:], world), "one row per token"),
        "weights_shape": (lambda: dispatch(x, ids, w[:, :1], world), "topk_weights has shape"),
        "weights_dtype": (lambda: dispatch(x, ids, w.double(), world), "topk_weights has dtype torch.float64"),
        "experts_not_divisible": (lambda: dispatch(x, ids, w, world + 1), "not divisible by the world size"),
        "capacity": (lambda: dispatch(x, ids, w, world, capacity=0), "capacity must be a positive int"),
        "no_tokens": (lambda: dispatch(x[:0], ids[:0], w[:0], world), "at least one token"),
        "handle": (lambda: ctx.ops.moe_combine(torch.zeros(1, 1, HIDDEN), "handle"), "must be the result"),
    }
    for name, (call, *fragments) in cases.items():
        report.check(f"host_errors/{name}", _raises(call, *fragments))
    result = dispatch(x, ids, w, world)
    report.check("host_errors/expert_out_shape", _raises(
        lambda: ctx.ops.moe_combine(torch.zeros(1, 2, HIDDEN, dtype=torch.bfloat16), result), "expert_out has shape"))
    ctx.ops.moe_combine(result.tokens, result)  # every rank combines the dispatch it made
    # Two dispatches later its receive buffers hold another call's rows: its combine is refused.
    later = [dispatch(x, ids, w, world) for _ in range(2)]
    report.check("host_errors/reused_buffers", _raises(
        lambda: ctx.ops.moe_combine(result.tokens, result), "receive buffers were reused by the dispatch two calls "
        "after it", "(dispatch ", "combine it before the dispatch after next"))
    for made in later:
        ctx.ops.moe_combine(made.tokens, made)
    # A dispatch of more tokens grows the receive buffers: the handles made before are refused.
    smaller = dispatch(x, ids, w, world)
    grown = ctx.workspaces.version("moe_slots")
    larger = dispatch(x.repeat(8, 1), ids.repeat(8, 1), w.repeat(8, 1), world)
    report.check("host_errors/buffers_grew", ctx.workspaces.version("moe_slots") > grown)
    report.check("host_errors/replaced_buffers", _raises(
        lambda: ctx.ops.moe_combine(smaller.tokens, smaller), "receive buffers were replaced since by larger ones"))
    ctx.ops.moe_combine(larger.tokens, larger)
    # More tokens at one capacity grow only the calls' state (a plan's handles', the routing's):
    # a handle made in full, whose state is tensors of its own, still combines.
    capacity = world * TOKENS * 16
    own = dispatch(x, ids, w, world, capacity=capacity)
    slots, state = ctx.workspaces.version("moe_slots"), ctx.workspaces.version("moe_state")
    more = dispatch(x.repeat(16, 1), ids.repeat(16, 1), w.repeat(16, 1), world, capacity=capacity)
    grew_state_only = ctx.workspaces.version("moe_slots") == slots and ctx.workspaces.version("moe_state") > state
    combined = ctx.ops.moe_combine(own.tokens, own)  # the tokens come back: x times both weights
    report.check("host_errors/state_grew_only", grew_state_only and torch.equal(combined, (x.float() * 2).to(x.dtype)))
    ctx.ops.moe_combine(more.tokens, more)
    # A handle made by its plan keeps its state in a workspace: once more tokens grew that, it is
    # refused, saying so (tokens sent nowhere: no expert's capacity matters).
    planned = [dispatch(x, ids, w, world, capacity=capacity) for _ in range(2)][-1]
    nowhere = torch.full((TOKENS * 32, 2), -1, dtype=ids.dtype)
    larger_state = dispatch(x.repeat(32, 1), nowhere, w.repeat(32, 1), world, capacity=capacity)
    report.check("host_errors/replaced_state", planned.handle.plan is not None and _raises(
        lambda: ctx.ops.moe_combine(planned.tokens, planned), "state (kept in a workspace by its plan) were replaced",
        "more tokens or experts"))
    ctx.ops.moe_combine(larger_state.tokens, larger_state)
    report.check("host_errors/context_still_usable", not ctx.failed)


def _check_device_errors(report: RankReport, rank: int) -> None:
    """Routings only the device can judge: every rank fails the call at once (the same verdict
    from the same table), the message naming the rank and the fix; a fresh context each."""
    world = dist.get_world_size()
    x, w = _tokens(torch.bfloat16, rank, "errors"), _weights(1, rank, "errors")
    ids = torch.zeros(TOKENS, 1, dtype=torch.int64)  # every token to expert 0: world * TOKENS rows on rank 0
    ctx = iris.create("triton", heap_size="8MiB", device="cpu", timeout=30)
    report.check("device_errors/over_capacity", _raises(
        lambda: ctx.ops.moe_dispatch(x, ids, w, 2 * world, capacity=world * TOKENS - 1), "moe_dispatch",
        "world rank(s) [0]", "than capacity holds", "pass a larger capacity", kind=IrisTimeoutError))
    report.check("device_errors/over_capacity/failed", ctx.failed)
    ctx.destroy()

    bad = ids.clone()
    if rank == world - 1:
        bad[2, 0] = 2 * world  # one id out of range, on the last rank only
    ctx = iris.create("triton", heap_size="8MiB", device="cpu", timeout=30)
    report.check("device_errors/ids_out_of_range", _raises(
        lambda: ctx.ops.moe_dispatch(x, bad, w, 2 * world), f"world rank(s) [{world - 1}]", "outside [-1, num_experts)",
        kind=IrisTimeoutError))
    ctx.destroy()

    # A combine whose dispatch's buffers were reused, where the host does not know the dispatch's
    # number (the operator, as compiled code calls it): the device refuses it on every rank.
    ctx = iris.create("triton", heap_size="8MiB", device="cpu", timeout=30)
    stale = ctx.ops.moe_dispatch(x, ids, w, 2 * world, capacity=world * TOKENS)
    for _ in range(2):
        made = ctx.ops.moe_dispatch(x, ids, w, 2 * world, capacity=world * TOKENS)
        ctx.ops.moe_combine(made.tokens, made)
    h = stale.handle
    report.check("device_errors/stale_dispatch", _raises(
        lambda: torch.ops.iris.moe_combine(stale.tokens, h.topk_ids, h.topk_weights, h.pair_slots, h.call, h.counts,
                                           h.slot, ctx.ops._iris_handle, h.num_experts, h.capacity),
        f"world rank(s) [{rank}]", "a later dispatch reused", "combine before then", kind=IrisTimeoutError))
    report.check("device_errors/stale_dispatch/failed", ctx.failed)
    ctx.destroy()

    # Combines of one dispatch whose expert outputs differ between ranks (hidden size): every rank
    # raises naming both calls, before any row lands in a peer's buffers (the workspace already fits
    # the larger call, so no growth is what notices).
    ctx = iris.create("triton", heap_size="8MiB", device="cpu", timeout=30)
    made = ctx.ops.moe_dispatch(x, ids, w, 2 * world)
    wide = torch.zeros(*made.tokens.shape[:2], 2 * HIDDEN, dtype=torch.bfloat16)
    ctx.ops.moe_combine(wide, made)
    made = ctx.ops.moe_dispatch(x, ids, w, 2 * world)
    report.check("device_errors/combine_mismatch", _raises(
        lambda: ctx.ops.moe_combine(wide if rank == world - 1 else made.tokens, made), "the ranks made different calls",
        f"moe_combine(({2}, {world * TOKENS}, {HIDDEN}) bfloat16", f"moe_combine(({2}, {world * TOKENS}, {2 * HIDDEN}) "
        "bfloat16", kind=CallMismatchError))
    ctx.destroy()

    ctx = iris.create("triton", heap_size="8MiB", device="cpu", timeout=30, debug=True)
    ctx.ops.moe_dispatch(x, ids, w, 2 * world)  # a call of the same shapes first: no plan skips the host check
    report.check("device_errors/ids_out_of_range_debug_mode_host_check", _raises(
        lambda: ctx.ops.moe_dispatch(x, bad, w, 2 * world), f"on world rank(s) [{world - 1}]",
        f"outside [-1, {2 * world})"))
    report.check("device_errors/debug_mode_host_check_leaves_the_context_usable", not ctx.failed)
    ctx.destroy()


def _worker(rank: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="16MiB", device="cpu")
    with report.section("cases"):
        _check_cases(ctx, report)
    with report.section("back_to_back"):
        _check_back_to_back(ctx, report)
    with report.section("host_errors"):
        _check_host_errors(ctx, report)
    with report.section("compiled"):
        _check_compiled(ctx, report)
    ctx.barrier()
    ctx.destroy()
    with report.section("device_errors"):
        _check_device_errors(report, rank)
    return report.packed()


#: The cases of the five-rank run (every routing kind of a larger world: remote and local pairs, a
#: duplicate, fp8), a few to keep five interpreted ranks quick.
FIVE_RANK_CASES = ("random", "one_expert_every_slot", "local_only", "fp8")


def _five_rank_worker(rank: int) -> bytes:
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="16MiB", device="cpu")
    with report.section("cases"):
        _check_cases(ctx, report, [case for case in CASES if case[0] in FIVE_RANK_CASES])
    with report.section("back_to_back"):
        _check_back_to_back(ctx, report)
    ctx.barrier()
    ctx.destroy()
    return report.packed()


#: The checks of the plans (:func:`_check_back_to_back`), other than their dispatches' results.
PLAN_CHECKS = {"plans/dispatch", "plans/combine", "plans/per_layout", "plans/across_shapes",
               "plans/counts_in_workspace"}


def test_world5_dispatch_and_combine_match_the_references():
    reports = spawn_reports(_five_rank_worker, 5, device=interpreted_device("triton"))
    calls = list(FIVE_RANK_CASES) + [f"back_to_back/{i}" for i in range(BACK_TO_BACK)]
    assert_rank_checks(reports, "dispatch/", _dispatch_names([*calls, "plans/fewer_tokens"]))
    assert_rank_checks(reports, "combine/", {f"combine/{name}" for name in calls} | {"combine/no_failure"})
    assert_rank_checks(reports, "plans/", PLAN_CHECKS)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda world: f"world{world}")
def reports(request) -> list[dict]:
    return spawn_reports(_worker, request.param, device=interpreted_device("triton"))


def _dispatch_names(cases) -> set[str]:
    """The checks of :func:`_check_result` for dispatches named ``cases``."""
    return {f"dispatch/{case}/{check}" for case in cases for check in ("counts", "tokens_in_source_order", "scales")}


def test_dispatch_matches_the_all_to_all_single_reference(reports):
    calls = [name for name, *_ in CASES] + [f"back_to_back/{i}" for i in range(BACK_TO_BACK)] + ["plans/fewer_tokens"]
    assert_rank_checks(reports, "dispatch/", _dispatch_names(calls))


def test_dispatch_and_combine_compile_into_one_graph_with_the_eager_results(reports):
    assert_rank_checks(reports, "compiled/", {f"compiled/{name}/{check}" for name in COMPILED_CASES
                                              for check in ("dispatch", "combine", "one_graph")} | {
        "compiled/completed"})


def test_combine_is_the_weighted_sum_of_the_expert_outputs(reports):
    assert_rank_checks(reports, "combine/", {f"combine/{name}" for name, *_ in CASES} | {
        f"combine/back_to_back/{i}" for i in range(BACK_TO_BACK)} | {"combine/no_failure"})


def test_calls_of_a_shape_made_before_run_by_their_plans(reports):
    assert_rank_checks(reports, "plans/", PLAN_CHECKS)


def test_bad_arguments_are_refused_on_the_host(reports):
    refused = ("tokens_dims", "tokens_dtype", "ids_dtype", "ids_rows", "weights_shape", "weights_dtype",
               "experts_not_divisible", "capacity", "no_tokens", "handle", "expert_out_shape", "reused_buffers",
               "replaced_buffers", "buffers_grew", "state_grew_only", "replaced_state")
    assert_rank_checks(reports, "host_errors/", {f"host_errors/{name}" for name in refused} | {
        "host_errors/context_still_usable", "host_errors/completed"})


def test_routings_that_do_not_fit_fail_the_call_on_every_rank(reports):
    assert_rank_checks(reports, "device_errors/", {f"device_errors/{name}" for name in (
        "over_capacity", "over_capacity/failed", "ids_out_of_range", "ids_out_of_range_debug_mode_host_check",
        "debug_mode_host_check_leaves_the_context_usable", "stale_dispatch", "stale_dispatch/failed",
        "combine_mismatch", "completed")})


def _cpu_copy(result):
    """The result's tensors on the host, as :func:`_check_result` reads them."""
    return types.SimpleNamespace(**{name: None if value is None else value.cpu() for name, value in (
        ("tokens", result.tokens), ("scales", result.scales), ("counts", result.counts),
        ("source_rank", result.source_rank), ("source_index", result.source_index))})


def _gpu_worker(rank: int, world: int) -> bytes:
    """Every case but the tight capacity on GPU ranks, checked as on CPU ranks."""
    report = RankReport(rank)
    with iris.create("triton", heap_size="256MiB") as ctx:
        for name, k, per_rank, dtype, fp8 in CASES:
            if name == "tight_capacity":
                continue
            experts = per_rank * world
            ids = _routing(name, rank, world, k, experts)
            x, w = _tokens(dtype, rank, name), _weights(k, rank, name)
            result = ctx.ops.moe_dispatch(x.to(ctx.device), (ids.int() if k == 1 else ids).to(ctx.device),
                                          w.to(ctx.device), experts, fp8=fp8)
            _check_result(report, name, _cpu_copy(result),
                          _reference_dispatch(x, ids, experts, world, rank, fp8, quantise_on=str(ctx.device)),
                          world * TOKENS, fp8, dtype)
            expert_out = _expert_function(result.tokens, result.scales, rank * per_rank,
                                          torch.bfloat16 if fp8 else dtype)
            y = ctx.ops.moe_combine(expert_out, result)
            ctx.check()
            # The GPU's float32 sums may contract into fused multiply-adds: within rounding, not bit for bit.
            reference = _reference_combine(x, ids, w, fp8, y.dtype).float()
            report.check(f"combine/{name}", torch.allclose(y.cpu().float(), reference, rtol=1e-2, atol=1e-2))
    return report.packed()


@pytest.mark.gpu
def test_dispatch_and_combine_on_two_gpu_ranks():
    reports = reports_on_available_ranks(_gpu_worker, 2, 2, timeout=120)
    cases = [name for name, *_ in CASES if name != "tight_capacity"]  # as _gpu_worker skips it
    assert_rank_checks(reports, "dispatch/", _dispatch_names(cases))
    assert_rank_checks(reports, "combine/", {f"combine/{name}" for name in cases})


@pytest.mark.gpu
def test_dispatch_and_combine_replay_in_a_cuda_graph(ctx):
    """One rank: an eager call sizes the workspaces, then dispatch + combine are captured and
    replayed with new tokens, routings and weights, against torch."""
    if ctx.world_size != 1:
        pytest.skip("the session context has more than one rank")
    device, experts, k, tokens, hidden = ctx.device, 8, 2, 64, 128
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16, device=device)
    ids = torch.zeros(tokens, k, dtype=torch.int64, device=device)
    w = torch.zeros(tokens, k, device=device)
    factor = torch.arange(1, experts + 1, device=device, dtype=torch.float32).view(-1, 1, 1)

    def step():
        result = ctx.ops.moe_dispatch(x, ids, w, experts)
        return result, ctx.ops.moe_combine((result.tokens.float() * factor).to(torch.bfloat16), result)

    step()
    torch.cuda.synchronize(device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        result, y = step()
    for replay in range(3):
        g = seeded_generator("graph", replay)
        xv = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        idv = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        wv = torch.rand(tokens, k, generator=g)
        x.copy_(xv)
        ids.copy_(idv)
        w.copy_(wv)
        graph.replay()
        torch.cuda.synchronize(device)
        for e in range(experts):
            mine = [t for t in range(tokens) if e in idv[t].tolist()]
            assert result.counts[e].item() == len(mine)
            assert torch.equal(result.tokens[e, :len(mine)].cpu(), xv[mine])
            assert result.source_index[e, :len(mine)].tolist() == mine
        expected = torch.zeros(tokens, hidden)
        for j in range(k):
            expected.addcmul_((xv.float() * (idv[:, j] + 1).float()[:, None]).to(torch.bfloat16).float(),
                              wv[:, j:j + 1])
        torch.testing.assert_close(y.float().cpu(), expected.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    ctx.check()


def _far_rows_worker(rank: int, world: int) -> bytes:
    """Rows routed to the last expert of a large capacity: their place in the receive buffer is
    past 2**31 elements, so every offset on the kernels' path must be 64-bit."""
    report = RankReport(rank)
    experts, hidden, capacity, tokens = 8, 4096, 80_000, 32
    assert (experts - 1) * capacity * hidden > 2**31
    with iris.create("triton", heap_size="11GiB") as ctx:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        ids = torch.tensor([[experts - 1, t % (experts - 1)] for t in range(tokens)])
        w = torch.rand(tokens, 2, generator=g)
        result = ctx.ops.moe_dispatch(x.to(ctx.device), ids.to(ctx.device), w.to(ctx.device), experts,
                                      capacity=capacity)
        report.check("far/dispatch/count", result.counts[experts - 1].item() == tokens)
        report.check("far/dispatch/rows", torch.equal(result.tokens[experts - 1, :tokens].cpu(), x))
        y = ctx.ops.moe_combine(result.tokens, result)
        ctx.check()
        report.check("far/combine", torch.allclose(y.cpu().float(), (x.float() * w.sum(1, keepdim=True)),
                                               rtol=1e-2, atol=1e-2))
    return report.packed()


@pytest.mark.gpu
def test_rows_past_two_to_the_31_elements_of_the_receive_buffer_land_and_return():
    reports = reports_on_available_ranks(_far_rows_worker, 1, 1, timeout=180)
    assert_rank_checks(reports, "far/", {"far/dispatch/count", "far/dispatch/rows", "far/combine"})
