"""CCLMixin: the ``ctx.ccl`` namespace of collectives.

``ctx.ccl`` checks a call (devices, dtypes, sizes, contiguity), then dispatches it to a
registered algorithm (:mod:`iris.collectives`): the one named, or the automatic choice. The
algorithms keep their buffers in the context's workspaces (:mod:`iris.workspaces`), so calls
after the first of a given size and dtype allocate nothing and never wait on the host, and can
be captured in a CUDA graph.

A call identical to an earlier one (the same tensors by address, size, dtype and layout, the
same options) skips the checks and the algorithm's preparation: the algorithm's *repeat* of the
earlier launch runs instead, which keeps the host's cost per call low when calls are not
captured in a graph. Repeats are dropped whenever a workspace is replaced (they launch with its
address) or a registry of plugins changes (the automatic choice may then be another algorithm).
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable

import torch

from iris.collectives import (COLLECTIVES, REDUCE_OPS, SUPPORTED_DTYPES, Algorithm, CallShape, CollectiveCall,
                               algorithm_registry, choose)
from iris.errors import IrisError
from iris.groups import namespace_for
from iris.registry import PluginRegistry

__all__ = ["CCLMixin", "Collectives"]

#: Most repeats kept (the oldest is dropped first); each is a few addresses and a callable.
MAX_REPEATS = 256


def _identity(tensor) -> tuple | None:
    """What the checks of a call read from ``tensor`` (None for anything but a tensor)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device, tensor.is_contiguous()


#: Keywords of upstream iris's collectives that torch.distributed's do not take.
UPSTREAM_KEYWORDS = ("config", "workspace", "group", "async_op")


def _refuse_upstream_call(collective: str, spelling: str, keywords: dict) -> None:
    """Raise for a call spelled as upstream iris spells ``collective``: ``spelling`` describes
    what was recognised, ``keywords`` are the call's unexpected keywords."""
    unknown = sorted(set(keywords) - set(UPSTREAM_KEYWORDS))
    if unknown:
        raise TypeError(f"ctx.ccl.{collective}() got unexpected keyword argument(s) {', '.join(unknown)}")
    raise IrisError(f"ctx.ccl.{collective}: {spelling} is upstream iris's spelling; contexts from iris.create() "
                    f"follow torch.distributed (see help(ctx.ccl.{collective})). Make the context with iris.iris(...) "
                    f"for upstream iris's collectives")


def _refuse_upstream_keywords(collective: str, keywords: dict) -> None:
    """Raise when a call passed keywords (upstream's, or unknown ones)."""
    if keywords:
        _refuse_upstream_call(collective, ", ".join(f"{k}=" for k in keywords), keywords)


def _reduce_op_name(op) -> str:
    """``"sum"``/``"max"``/``"min"`` from a string or a ``torch.distributed.ReduceOp``."""
    if isinstance(op, torch.Tensor):
        _refuse_upstream_call("all_reduce", "a second tensor (all_reduce(out, inp))", {})
    if isinstance(op, str):
        name = op.lower()
    else:
        known = {torch.distributed.ReduceOp.SUM: "sum", torch.distributed.ReduceOp.MAX: "max",
                 torch.distributed.ReduceOp.MIN: "min"}
        name = known.get(op, repr(op))
    if name not in REDUCE_OPS:
        raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)} (or the torch.distributed.ReduceOp of that "
                         f"name), got {op!r}")
    return name


class Collectives:
    """Device-side collectives of one context (``ctx.ccl``), with torch.distributed semantics.

    Every method is a collective operation: all ranks call it in the same order with tensors
    of the same shape and dtype. Inputs may be heap tensors (used in place) or plain tensors on
    the context's device (staged through the heap workspace); results land in the tensors
    passed. Work is enqueued on the current stream; nothing waits on the host.
    """

    def __init__(self, context):
        self._context = context
        #: Repeats of earlier launches, by everything the call's checks and launch depend on.
        self._repeats: dict[tuple, Callable[[], None]] = {}
        #: (workspaces' generation, registries' changes) when the repeats were made.
        self._repeats_made_with = (0, PluginRegistry.changes)

    def _for_group(self, group) -> "Collectives":
        """The collectives that run calls with ``group=group`` (:mod:`iris.groups`)."""
        return namespace_for(self, group)

    # -- discovery ------------------------------------------------------------------------------

    def algorithms(self, collective: str, *, applying_to: torch.Tensor | None = None) -> list[str]:
        """Names of the algorithms registered for ``collective``; with ``applying_to``, only those
        that can run a call of this context with that input."""
        names = algorithm_registry(collective).names()
        if applying_to is None:
            return names
        shape = self._shape(collective, applying_to)
        return [name for name in names if algorithm_registry(collective).get(name).refusal(shape) is None]

    def _shape(self, collective: str, input: torch.Tensor) -> CallShape:
        ctx = self._context
        return CallShape(collective=collective, nbytes=input.numel() * input.element_size(),
                         world_size=ctx.world_size, dtype=input.dtype, device_type=ctx.device.type,
                         language=ctx.kernel_language)

    def _algorithm(self, collective: str, name: str | None, input: torch.Tensor) -> Algorithm:
        if name is None:
            ctx = self._context
            return choose(collective, input.numel() * input.element_size(), ctx.world_size, input.dtype,
                          ctx.device.type, ctx.kernel_language)
        shape = self._shape(collective, input)
        registry = algorithm_registry(collective)
        algorithm = registry.get(name)
        refusal = algorithm.refusal(shape)
        if refusal is not None:
            runs = self.algorithms(collective, applying_to=input)
            raise IrisError(f"{collective}: algorithm {name!r} cannot run this call: {refusal}; choose one of "
                            f"{runs} or None (the automatic choice)")
        return algorithm

    # -- checks ---------------------------------------------------------------------------------

    def _check_tensor(self, what: str, collective: str, tensor) -> None:
        ctx = self._context
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{collective}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device != ctx.device:
            raise IrisError(f"{collective}: {what} is on {tensor.device}, but this context runs on {ctx.device}; "
                            f"move it with .to({str(ctx.device)!r})")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise IrisError(f"{collective}: {what} has dtype {tensor.dtype}; supported: "
                            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
        if not tensor.is_contiguous():
            raise IrisError(f"{collective}: {what} is not contiguous; pass tensor.contiguous()")

    def _check_pair(self, collective: str, output, input) -> None:
        self._check_tensor("output", collective, output)
        self._check_tensor("input", collective, input)
        if output.dtype != input.dtype:
            raise IrisError(f"{collective}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        out_start, in_start = output.data_ptr(), input.data_ptr()
        out_end = out_start + output.numel() * output.element_size()
        in_end = in_start + input.numel() * input.element_size()
        if out_start < in_end and in_start < out_end:
            raise IrisError(f"{collective}: output and input overlap in memory; pass separate tensors")

    def _divisible(self, collective: str, what: str, numel: int) -> int:
        world = self._context.world_size
        if numel % world:
            raise IrisError(f"{collective}: {what} has {numel} elements, not divisible by the world size {world}; "
                            f"pad it to a multiple of {world}")
        return numel // world

    def _run(self, collective: str, algorithm: str | None, output, input, validate: Callable[[], None], *,
             op: str = "sum", src: int = 0) -> None:
        """Run one call: the repeat of an identical earlier call, or else ``validate()`` it and
        hand it to its algorithm (keeping the launch's repeat)."""
        if algorithm is not None and not isinstance(algorithm, str):
            raise TypeError(f"{collective}: algorithm must be a name (str) or None, got {type(algorithm).__name__}")
        with self._context._call(f"ccl.{collective}", (output,) if isinstance(output, torch.Tensor) else ()):
            self._dispatch(collective, algorithm, output, input, validate, op, src)

    def _dispatch(self, collective: str, algorithm: str | None, output, input, validate: Callable[[], None], op: str,
                  src: int) -> None:
        output_identity = _identity(output)
        key = (collective, algorithm, op, src, output_identity,
               output_identity if input is output else _identity(input))
        debug = self._context.config.debug
        workspaces = self._context.workspaces
        workspaces.note_capture()  # a repeat asks for no workspace: a capture is noticed here
        self._forget_outdated_repeats()
        repeat = None if debug else self._repeats.get(key)
        if repeat is not None:
            repeat()
            return
        if debug:
            self._check_same_call_on_every_rank(collective, algorithm, op, src, output, input)
        validate()
        chosen = self._algorithm(collective, algorithm, input)
        if input.numel() == 0:
            return
        repeat = chosen.run(CollectiveCall(context=self._context, collective=collective, output=output, input=input,
                                           op=op, src=src))
        if repeat is not None:
            self._forget_outdated_repeats()  # the call may have grown a workspace
            if len(self._repeats) >= MAX_REPEATS:
                del self._repeats[next(iter(self._repeats))]
            self._repeats[key] = repeat

    def _forget_outdated_repeats(self) -> None:
        """Drop the repeats if a workspace was replaced since they were launched (they hold its
        address) or a registry changed (the automatic choice may now be another algorithm)."""
        now = (self._context.workspaces.generation, PluginRegistry.changes)
        if self._repeats_made_with != now:
            self._repeats.clear()
            self._repeats_made_with = now

    def _check_same_call_on_every_rank(self, collective, algorithm, op, src, output, input) -> None:
        """Debug mode: every rank makes the same call (collective, options, shapes, dtypes), or
        every rank raises, naming what differs; a host exchange per call."""

        def describe(tensor):
            if isinstance(tensor, torch.Tensor):
                return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
            return type(tensor).__name__

        mine = (collective, algorithm, op, src, describe(output), describe(input))
        calls = self._context.comm.all_gather_object(mine)
        if any(call != calls[0] for call in calls):
            listing = "; ".join(f"rank {rank}: {call[0]}(output {call[4]}, input {call[5]}, op={call[2]}, "
                                f"src={call[3]}, algorithm={call[1]})" for rank, call in enumerate(calls))
            raise IrisError(f"{collective}: the ranks made different calls (IRIS_DEBUG check): {listing}; every "
                            f"rank must call the same collective with tensors of the same shape and dtype")

    # -- the collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op="sum", *, algorithm: str | None = None,
                   **upstream_keywords) -> torch.Tensor:
        """Reduce ``tensor`` across ranks (sum, max or min) in place; every rank gets the same
        result. ``algorithm``: any registered one (:meth:`algorithms`; the Triton backend has
        ``"low_latency"``, ``"sentinel"`` (floats), ``"one_shot"`` and ``"two_shot"``); by default
        chosen by size, world size and dtype (:func:`iris.collectives.choose`)."""
        _refuse_upstream_keywords("all_reduce", upstream_keywords)
        self._run("all_reduce", algorithm, tensor, tensor, lambda: self._check_tensor("tensor", "all_reduce", tensor),
                  op=_reduce_op_name(op))
        return tensor

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, algorithm: str | None = None,
                   **upstream_keywords) -> torch.Tensor:
        """``output`` (world_size x input's elements, e.g. shape ``[world_size, *input.shape]``)
        := every rank's ``input``, in rank order (torch's ``all_gather_into_tensor``)."""

        _refuse_upstream_keywords("all_gather", upstream_keywords)

        def validate():
            self._check_pair("all_gather", output, input)
            world = self._context.world_size
            if output.numel() != world * input.numel():
                raise IrisError(f"all_gather: output has {output.numel()} elements; it needs world_size x input = "
                                f"{world} x {input.numel()} = {world * input.numel()}")

        self._run("all_gather", algorithm, output, input, validate)
        return output

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum", *,
                       algorithm: str | None = None, **upstream_keywords) -> torch.Tensor:
        """``output`` := the reduction across ranks of this rank's share of ``input``: rank r gets
        segment r of the ``world_size`` equal segments (torch's ``reduce_scatter_tensor``)."""

        _refuse_upstream_keywords("reduce_scatter", upstream_keywords)

        def validate():
            self._check_pair("reduce_scatter", output, input)
            if output.numel() == input.numel() and self._context.world_size > 1:
                _refuse_upstream_call("reduce_scatter", "an output of the input's size (the full-shape "
                                      "reduce_scatter)", {})
            share = self._divisible("reduce_scatter", "input", input.numel())
            if output.numel() != share:
                raise IrisError(f"reduce_scatter: output has {output.numel()} elements; it needs input / world_size "
                                f"= {share}")

        self._run("reduce_scatter", algorithm, output, input, validate, op=_reduce_op_name(op))
        return output

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, algorithm: str | None = None,
                   **upstream_keywords) -> torch.Tensor:
        """Segment j of this rank's ``input`` goes to rank j, which stores it as its segment r
        (``world_size`` equal segments; torch's ``all_to_all_single`` without split sizes)."""

        _refuse_upstream_keywords("all_to_all", upstream_keywords)

        def validate():
            self._check_pair("all_to_all", output, input)
            self._divisible("all_to_all", "input", input.numel())
            if output.numel() != input.numel():
                raise IrisError(f"all_to_all: output has {output.numel()} elements, input {input.numel()}; they "
                                f"must match")

        self._run("all_to_all", algorithm, output, input, validate)
        return output

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, algorithm: str | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` := rank ``src``'s, in place."""
        world = self._context.world_size
        if not isinstance(src, int) or not 0 <= src < world:
            raise IrisError(f"broadcast: src={src!r} is not a rank of {self._context.describe_ranks()}")
        self._run("broadcast", algorithm, tensor, tensor, lambda: self._check_tensor("tensor", "broadcast", tensor),
                  src=src)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank's earlier device work is complete and every rank arrived."""
        self._context.barrier()


class CCLMixin:
    """Adds ``ccl``, the collectives bound to this context (:class:`Collectives`, or the namespace
    of upstream's conventions for contexts of that kind), and checks at
    set-up that every rank has the same collective algorithms installed (the automatic choice
    must be the same everywhere). Requires ``barrier()``, ``comm``, ``config``, ``device``,
    ``rank``, ``world_size``, ``_call`` (FailStopMixin), ``workspaces`` (WorkspacesMixin) and
    ``kernel_language`` (the backend's DeviceOps)."""

    def _setup(self) -> None:
        super()._setup()
        installed = {collective: algorithm_registry(collective).names() for collective in COLLECTIVES}
        everyone = self.comm.all_gather_object(installed)
        if any(other != everyone[0] for other in everyone):
            listing = "; ".join(f"rank {rank}: {algorithms}" for rank, algorithms in enumerate(everyone))
            raise IrisError(f"the ranks have different collective algorithms installed ({listing}); install the "
                            f"same iris plugins on every rank: each rank must choose the same algorithm for a call")

    @cached_property
    def _torch_ccl(self) -> Collectives:
        """The collectives with torch.distributed's conventions, whatever ``ccl`` is."""
        return Collectives(self)

    @cached_property
    def ccl(self):
        """The collectives, with the conventions of this kind of context (``_ccl_namespace``)."""
        return self._ccl_namespace()

    def _teardown(self) -> None:
        # Repeats launch with heap addresses that are about to be released; a call made through
        # a Collectives object kept from before then goes through the checks, which raise.
        if "_torch_ccl" in self.__dict__:
            self.__dict__["_torch_ccl"]._repeats.clear()
        super()._teardown()

