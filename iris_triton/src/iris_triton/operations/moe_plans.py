"""Eager MoE calls by plan: a dispatch or combine of a shape made before costs its two launches
and little else.

A full ``ctx.ops.moe_dispatch`` checks its arguments, prepares its two launches for both parities
of the receive buffers (:class:`~iris_triton.operations.moe_kernels.DispatchLaunches`) and leaves
a :class:`DispatchPlan`, kept by the ``ctx.ops`` object for what the checks read of the
arguments: the options and the tensors' alignment (:func:`dispatch_key`), and their shapes,
strides, dtypes and devices, checked in one call (:func:`iris.calls.entries.layout_guard`); not
their addresses, which change from call to call. A later dispatch of the same arguments
allocates its own outputs, puts its tensors' addresses into the prepared arguments and
launches the compiled kernels directly, inside the least of the fail-stop guard
(``ctx._run_repeat``); its result is a handle as the full call makes. A combine of a planned
dispatch's handle is planned likewise (:class:`CombinePlan`, by ``expert_out``'s layout).

Plans are forgotten with the repeats of :mod:`iris.calls.repeats` (a workspace replaced, ...).
Under the interpreter kernels are launched through it with the same arguments, so the plans are
tested on CPU ranks as they run on GPUs.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from iris.calls import repeats
from iris.calls.entries import layout_guard
from iris_triton.device.frontend import tensor_passed
from iris_triton.operations.moe import MoeDispatch, MoeHandle, buffer_versions

__all__ = ["CombinePlan", "DispatchPlan", "combine_again", "dispatch_again", "dispatch_key"]

#: Plans a ``ctx.ops`` object keeps (the oldest is dropped first): a few shapes' worth.
MAX_PLANS = 64


def dispatch_key(tokens, topk_ids, topk_weights, num_experts, capacity, fp8) -> tuple:
    """A dispatch's key among the plans: its options and its tensors' 16-byte alignment (what the
    kernels were compiled for); the tensors' layouts are each plan's :attr:`DispatchPlan.check`.
    TypeError or AttributeError for arguments that cannot be planned (the full call then says
    what is wrong)."""
    return (tokens.data_ptr() % 16 == 0, topk_ids.data_ptr() % 16 == 0, topk_weights.data_ptr() % 16 == 0,
            num_experts.__class__, num_experts, capacity.__class__, capacity, fp8.__class__, fp8)


def _made(cls, **fields):
    """An instance of the frozen dataclass ``cls`` (:class:`MoeHandle`, :class:`MoeDispatch`) with
    every field in ``fields``, as its ``__init__`` makes it but without a call of
    ``object.__setattr__`` per field: what a planned call returns, made on every call."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made


def _kept_among(plans: list, plan) -> None:
    """Add ``plan`` to ``plans`` (of one key), dropping the oldest past :data:`MAX_PLANS`."""
    if len(plans) >= MAX_PLANS:
        del plans[0]
    plans.append(plan)


def _bound(cache, grid: tuple, arguments: tuple, constexprs: dict, per_call: tuple[str, ...]):
    """``(runner, values, indices)``: the launch of ``cache``'s kernel with ``arguments``
    (:meth:`LaunchCache.bound`) and where the runtime arguments named ``per_call`` lie in
    ``values``; None where no compiled kernel was kept."""
    bound = cache.bound(grid, *arguments, **constexprs)
    if bound is None:
        return None
    names = cache.jitted.arg_names
    return (*bound, tuple(names.index(name) for name in per_call))


def _launch(bound, values: tuple, stream: int) -> None:
    """Launch ``bound`` (:func:`_bound`) on ``stream`` with ``values``, tensors, for its per-call
    arguments (written into its arguments in place: a plan's calls never overlap, the guard lets
    one call run at a time)."""
    runner, arguments, indices = bound
    for index, value in zip(indices, values):
        arguments[index] = tensor_passed(value)
    runner(arguments, stream)


@attrs.define(eq=False)
class DispatchPlan:
    """A dispatch of one key, prepared: both launches for each parity, with the per-call
    arguments' places."""

    ops: Any
    launches: Any
    """The :class:`~iris_triton.operations.moe_kernels.DispatchLaunches`."""
    route: tuple
    """Per parity, the routing launch (:func:`_bound`), per call ``ids`` (the handle's state is
    the parity's :attr:`~iris_triton.operations.moe_kernels.DispatchLaunches.scratch`)."""
    push: tuple
    """Per parity, the pushing launch, per call ``tokens, ids`` (its counts are the parity's
    :attr:`~iris_triton.operations.moe_kernels.DispatchLaunches.scratch`)."""
    num_experts: int
    capacity: int
    fp8: bool
    check: Any = None
    """Whether a dispatch's ``tokens, topk_ids, topk_weights`` have the layouts of this plan's
    (:func:`iris.calls.entries.layout_guard`; set where the plan is kept)."""
    buffers: tuple = ()
    """The workspaces' versions its handles carry (:func:`iris_triton.operations.moe.buffer_versions`):
    constant while the plan is (a replaced workspace forgets every plan)."""
    generation: int = attrs.field(factory=repeats.generation)
    combines: dict = attrs.field(factory=dict)
    """Plans of combines of this plan's dispatches, by ``expert_out``'s 16-byte alignment: lists
    of :class:`CombinePlan`, each for its layout."""

    @classmethod
    def of(cls, ops, launches, parity: int, x, ids, num_experts: int, capacity: int,
           fp8: bool) -> "DispatchPlan | None":
        """The plan of a dispatch just launched with these tensors (None where it has none)."""
        from iris_triton.operations.moe_kernels import _PUSH, _ROUTE

        route, push = [], []
        for p in (parity, 1 - parity):
            pair_slots, call, counts = launches.scratch[p]
            route.append(_bound(_ROUTE, launches.route_grid, launches.route_arguments(p, ids, call),
                                launches.route_constexprs, ("ids",)))
            push.append(_bound(_PUSH, launches.push_grid, launches.push_arguments(p, x, None, ids, pair_slots, counts),
                               launches.push_constexprs, ("tokens", "ids")))
        if None in route or None in push:
            return None
        order = slice(None) if parity == 0 else slice(None, None, -1)
        return cls(ops=ops, launches=launches, route=tuple(route[order]), push=tuple(push[order]),
                   num_experts=num_experts, capacity=capacity, fp8=fp8, buffers=buffer_versions(ops._context))

    def keep_for(self, tokens, topk_ids, topk_weights, num_experts, capacity, fp8) -> None:
        """Keep this plan for dispatches of these arguments (:func:`dispatch_key`, and their layouts)."""
        self.check = layout_guard((tokens, topk_ids, topk_weights))
        key = dispatch_key(tokens, topk_ids, topk_weights, num_experts, capacity, fp8)
        kept = self.ops._moe_plans
        plans = kept.by_key.get(key)
        if plans is None:
            plans = []
            kept.keep(key, plans)
        _kept_among(plans, self)

    def keep_combine(self, expert_out, launches, handle: MoeHandle, out) -> None:
        """Keep the plan of a combine of one of this plan's dispatches, just launched with
        ``expert_out`` (contiguous) into ``out`` (:class:`CombinePlan`)."""
        plan = CombinePlan.of(self, launches, handle, out, expert_out)
        if plan is not None:
            _kept_among(self.combines.setdefault(expert_out.data_ptr() % 16 == 0, []), plan)

    def run(self, tokens, topk_ids, topk_weights, stream: int) -> MoeDispatch:
        """The dispatch of these arguments (of this plan's key), launched on ``stream``."""
        ops = self.ops
        sequence = ops._moe_calls
        ops._moe_calls = sequence + 1
        parity = sequence & 1
        pair_slots, call, counts = self.launches.scratch[parity]
        _launch(self.route[parity], (topk_ids,), stream)
        _launch(self.push[parity], (tokens, topk_ids), stream)
        buffers = self.launches.buffers[parity]
        handle = _made(MoeHandle, ops=ops, num_experts=self.num_experts, capacity=self.capacity, topk_ids=topk_ids,
                       topk_weights=topk_weights, pair_slots=pair_slots, call=call, counts=counts,
                       slot=self.launches.slots[parity], sequence=sequence, plan=self, buffers=self.buffers)
        return _made(MoeDispatch, tokens=buffers["data"], scales=buffers["scales"] if self.fp8 else None,
                     counts=counts, source_rank=buffers["source_rank"], source_index=buffers["source_index"],
                     handle=handle)


@attrs.define(eq=False)
class CombinePlan:
    """A combine of one planned dispatch's handles and one ``expert_out`` layout, prepared."""

    launches: Any
    """The :class:`~iris_triton.operations.moe_kernels.CombineLaunches`."""
    returns: tuple
    """Per parity of the dispatch, the returning launch (:func:`_bound`), per call
    ``expert_out, counts, call_in``."""
    reduce: tuple
    """The reducing launch (of either parity), per call ``out, expert_out, ids, pair_slots, weights, call_in``."""
    check: Any
    """Whether an ``expert_out`` has the layout of this plan's (:func:`iris.calls.entries.layout_guard`)."""

    @classmethod
    def of(cls, dispatch: DispatchPlan, launches, handle: MoeHandle, out, x) -> "CombinePlan | None":
        """The plan of a combine of ``handle`` (of ``dispatch``) just launched with these tensors."""
        from iris_triton.operations.moe_kernels import _REDUCE, _RETURN

        returns = tuple(_bound(_RETURN, launches.grid, launches.return_arguments(launches.sources(slot), x,
                                                                                  handle.counts, handle.call),
                               launches.return_constexprs, ("expert_out", "counts", "call_in"))
                        for slot in dispatch.launches.slots)
        reduce = _bound(_REDUCE, launches.grid,
                        launches.reduce_arguments(out, x, handle.topk_ids, handle.pair_slots, handle.topk_weights,
                                                  handle.call),
                        launches.reduce_constexprs, ("out", "expert_out", "ids", "pair_slots", "weights", "call_in"))
        if None in returns or reduce is None:
            return None
        return cls(launches=launches, returns=returns, reduce=reduce, check=layout_guard((x,)))

    def run(self, expert_out, handle: MoeHandle, stream: int) -> torch.Tensor:
        """The combine of ``expert_out`` for ``handle`` (of this plan's key), launched on ``stream``."""
        T, H = self.launches.shape[:2]
        out = torch.empty(T, H, dtype=expert_out.dtype, device=expert_out.device)
        _launch(self.returns[handle.sequence & 1], (expert_out, handle.counts, handle.call), stream)
        _launch(self.reduce, (out, expert_out, handle.topk_ids, handle.pair_slots, handle.topk_weights, handle.call),
                stream)
        return out


def _dispatch_outputs(made: MoeDispatch) -> tuple:
    """What a failed dispatch poisons: every tensor of its result (:func:`moe_kernels.dispatch`)."""
    return made.handle.plan.launches.outputs(made.handle.sequence & 1, made.counts)


def _by_plan(ops, find, name: str, outputs):
    """The call ``ctx.<name>`` made by ``find()`` (which gives a callable that makes it from its
    plan on the stream it is given; None: no plan), inside the least of the guard (``ctx._run_repeat``; ``outputs`` as
    there); None, having done nothing, where there is no plan, an argument is not what a plan
    takes (the full call then says what is wrong) or the call needs the full guard."""
    try:
        made_by_plan = find()
    except (AttributeError, TypeError):
        return None
    if made_by_plan is None:
        return None
    ran = ops._context._run_repeat(made_by_plan, name, outputs)
    return None if ran is None else ran[0]


def dispatch_again(ops, tokens, topk_ids, topk_weights, num_experts, *, capacity=None, fp8=False):
    """``ops.moe_dispatch(...)`` by its plan, or None (having done nothing: :func:`_by_plan`)."""
    plans = ops._moe_plans.by_key
    if not plans:
        return None

    def find():
        for plan in plans.get(dispatch_key(tokens, topk_ids, topk_weights, num_experts, capacity, fp8), ()):
            if plan.check(tokens, topk_ids, topk_weights):
                return lambda stream: plan.run(tokens, topk_ids, topk_weights, stream)
        return None

    return _by_plan(ops, find, "ops.moe_dispatch", _dispatch_outputs)


def combine_again(ops, expert_out, handle):
    """``ops.moe_combine(expert_out, handle)`` by its plan, or None (having done nothing:
    :func:`_by_plan`; also for a stale handle, which the full call refuses, saying so)."""
    if type(handle) is MoeDispatch:
        handle = handle.handle
    dispatch = getattr(handle, "plan", None)
    if dispatch is None or dispatch.ops is not ops or dispatch.generation != repeats.generation() or \
            ops._moe_calls - handle.sequence > 2:
        return None

    def find():
        for plan in dispatch.combines.get(expert_out.data_ptr() % 16 == 0, ()):
            if plan.check(expert_out):
                return lambda stream: plan.run(expert_out, handle, stream)
        return None

    return _by_plan(ops, find, "ops.moe_combine", lambda out: (out,))
