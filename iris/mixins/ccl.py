"""CCLMixin: the ``ctx.ccl`` namespace of collectives.

``ctx.ccl`` checks a call (devices, dtypes, sizes, contiguity), then dispatches it to a
registered algorithm (:mod:`iris.collectives`). The namespace owns what algorithms share: the
synchronisation words on the heap and named workspaces on the heap (one per protocol, e.g. the
collectives' data workspace), each growing, collectively, to the largest call seen. Calls after
the first of a given size and dtype allocate nothing and never wait on the host, so they can be
captured in a CUDA graph (make one call of each size and dtype before capturing: a call that
would grow a workspace during a capture raises). A workspace that grows after a capture stays
allocated on every rank, unused by new calls, for the graphs captured with its address.

A call identical to an earlier one (the same tensors by address, size, dtype and layout, the
same options) skips the checks and the algorithm's preparation: the algorithm's *repeat* of the
earlier launch runs instead, which keeps the host's cost per call low when calls are not
captured in a graph.
"""

from __future__ import annotations

from functools import cached_property
from typing import Callable

import torch

from iris.collectives import REDUCE_OPS, Algorithm, CollectiveCall, algorithm_registry, choose
from iris.errors import IrisError

__all__ = ["CCLMixin", "Collectives", "SUPPORTED_DTYPES"]

#: Element types every collective accepts.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
#: Programs (thread blocks) per collective kernel on CPU ranks, where Triton's interpreter runs
#: them one after another.
CPU_PROGRAMS = 2
#: Most repeats kept (the oldest is dropped first); each is a few addresses and a callable.
MAX_REPEATS = 256
#: Byte alignment of the regions of :meth:`Collectives.slot_regions`.
REGION_ALIGNMENT = 256


def _capturing(device: torch.device) -> bool:
    """Whether work enqueued now on ``device`` is being captured into a CUDA graph (read from the
    current device's current stream: iris launches on the current device, the context's)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _identity(tensor) -> tuple | None:
    """What the checks of a call read from ``tensor`` (None for anything but a tensor)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    return tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.device, tensor.is_contiguous()


def _reduce_op_name(op) -> str:
    """``"sum"``/``"max"``/``"min"`` from a string or a ``torch.distributed.ReduceOp``."""
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
        device = context.device
        #: Most programs (thread blocks) of a collective kernel; the sync words hold this many
        #: programs' counters and flags. Program ``p`` of a rank synchronises only with program
        #: ``p`` of its peers; a small call launches fewer.
        self.programs = context.get_cu_count() if device.type == "cuda" else CPU_PROGRAMS
        self._sync: torch.Tensor | None = None
        self._workspaces: dict[str, torch.Tensor] = {}
        #: Repeats of earlier launches, by everything the call's checks and launch depend on.
        self._repeats: dict[tuple, Callable[[], None]] = {}
        #: Whether a call was captured into a CUDA graph: graphs may then hold workspace addresses.
        self._graph_captured = False
        #: Buffers outgrown after a capture, kept allocated for the graphs that use them: heap
        #: workspaces by name, other buffers (:meth:`keep_for_graphs`) with the name None.
        self._kept_for_graphs: list[tuple[str | None, torch.Tensor]] = []

    # -- what algorithms share ----------------------------------------------------------------

    def sync_state(self) -> torch.Tensor:
        """int32 words on the heap: per program, its call count and its signal count, then one
        flag per program and peer (written by that peer), then two slots (by call parity) of one
        header per program and peer, where that peer announces its call (its number and
        signature). Zeroed once, never reset."""
        if self._sync is None:
            words = self.programs * (2 + 3 * self._context.world_size)
            self._sync = self._context.zeros(words, dtype=torch.int32)
            self._context.barrier()  # every peer's flags exist and are zero before anyone signals
        return self._sync

    def workspace(self, nbytes: int, *, name: str = "data", fill: int | None = None) -> torch.Tensor:
        """At least ``nbytes`` of heap (uint8), the same on every rank: the workspace ``name``
        (algorithms with their own protocol keep their own). ``fill``: the value of every byte
        when allocated (None: left as allocated). Grows collectively, with a host barrier, the
        first time a call needs more than before (an IrisError during a CUDA graph capture);
        otherwise allocates nothing. The outgrown workspace is freed, or, once a call was
        captured, kept for the graphs that launch with its address."""
        capturing = _capturing(self._context.device)
        self._graph_captured |= capturing  # e.g. fused operations, which ask for their buffers per call
        current = self._workspaces.get(name)
        if current is None or current.numel() < nbytes:
            ctx = self._context
            if capturing:
                raise IrisError(f"workspace {name!r} must grow to {nbytes} bytes, which takes a host barrier and an "
                                f"allocation on every rank and cannot happen inside a CUDA graph capture; before "
                                f"capturing, make one call of each size and dtype (which can change the algorithm)")
            ctx.barrier()  # no peer is still writing into the old workspace
            if current is not None:
                self._repeats.clear()  # they launch with the old workspace's address
                del self._workspaces[name]
                # Kept or freed alike on every rank, or the ranks' heaps would no longer match.
                self._graph_captured = any(ctx.comm.all_gather_object(self._graph_captured))
                if self._graph_captured:
                    self._kept_for_graphs.append((name, current))
                    ctx.info(f"workspace {name!r} grew after a CUDA graph capture; its old {current.numel()} bytes "
                             f"stay allocated for the graphs captured with them")
                else:
                    ctx.free(current)
            self._workspaces[name] = ctx.empty(nbytes, dtype=torch.uint8)
            if fill is not None:
                self._workspaces[name].fill_(fill)
            ctx.barrier()  # every rank's new workspace is there, filled, before anyone writes into it
        return self._workspaces[name]

    def slot_regions(self, nbytes: int, *, name: str, fill: int) -> tuple[torch.Tensor, int]:
        """The workspace ``name`` laid out as two slots (for alternate calls) of one region per
        rank, each region at least ``nbytes`` and a multiple of ``REGION_ALIGNMENT`` bytes (which
        keeps every region's vectors aligned): the workspace (uint8) and its regions' bytes. The
        layout follows the workspace's size, not the call's, so calls of any size and dtype use
        the same slots; it changes only when the workspace grows, collectively. ``fill`` as for
        :meth:`workspace`."""
        regions = 2 * self._context.world_size
        aligned = -(-nbytes // REGION_ALIGNMENT) * REGION_ALIGNMENT
        space = self.workspace(regions * aligned, name=name, fill=fill)
        return space, space.numel() // regions // REGION_ALIGNMENT * REGION_ALIGNMENT

    @property
    def graph_captured(self) -> bool:
        """Whether a call was captured into a CUDA graph, which may hold buffer addresses since:
        outgrown buffers are then kept, not freed."""
        return self._graph_captured

    def keep_for_graphs(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (outside the heap, outgrown after a capture) allocated for the graphs
        that use it, until :meth:`release_graph_buffers`."""
        self._kept_for_graphs.append((None, buffer))

    def release_graph_buffers(self) -> None:
        """Free the buffers kept for CUDA graphs captured before they were outgrown, and forget
        those captures: outgrown buffers are freed again until the next capture. Collective;
        call it once no graph captured so far will be replayed."""
        ctx = self._context
        ctx.barrier()  # no rank still replays into them
        for name, buffer in self._kept_for_graphs:
            if name is not None:
                ctx.free(buffer)
        self._kept_for_graphs.clear()
        self._graph_captured = False

    # -- discovery ------------------------------------------------------------------------------

    def algorithms(self, collective: str) -> list[str]:
        """Names of the algorithms registered for ``collective``."""
        return algorithm_registry(collective).names()

    def _algorithm(self, collective: str, name: str | None, input: torch.Tensor) -> Algorithm:
        name = name or choose(collective, input.numel() * input.element_size(), self._context.world_size, input.dtype)
        registry = algorithm_registry(collective)
        algorithm = registry.get(name)
        frontend = getattr(self._context, "frontend", None)
        if frontend is not None and frontend.name not in algorithm.frontends:
            raise IrisError(f"{collective} algorithm {name!r} is implemented for {sorted(algorithm.frontends)} "
                            f"kernels, but this context's backend compiles {frontend.name} kernels; choose one of "
                            f"{registry.names()}")
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
        if not self._graph_captured and _capturing(self._context.device):
            self._graph_captured = True  # a repeat asks for no workspace: noticed here
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
            if len(self._repeats) >= MAX_REPEATS:
                del self._repeats[next(iter(self._repeats))]
            self._repeats[key] = repeat

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

    def all_reduce(self, tensor: torch.Tensor, op="sum", *, algorithm: str | None = None) -> torch.Tensor:
        """Reduce ``tensor`` across ranks (sum, max or min) in place; every rank gets the same
        result. ``algorithm``: ``"low_latency"``, ``"sentinel"`` (floats), ``"one_shot"``,
        ``"two_shot"`` or any registered one; by default chosen by size, world size and dtype
        (:func:`iris.collectives.choose`)."""
        self._run("all_reduce", algorithm, tensor, tensor, lambda: self._check_tensor("tensor", "all_reduce", tensor),
                  op=_reduce_op_name(op))
        return tensor

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, algorithm: str | None = None) -> torch.Tensor:
        """``output`` (world_size x input's elements, e.g. shape ``[world_size, *input.shape]``)
        := every rank's ``input``, in rank order (torch's ``all_gather_into_tensor``)."""

        def validate():
            self._check_pair("all_gather", output, input)
            world = self._context.world_size
            if output.numel() != world * input.numel():
                raise IrisError(f"all_gather: output has {output.numel()} elements; it needs world_size x input = "
                                f"{world} x {input.numel()} = {world * input.numel()}")

        self._run("all_gather", algorithm, output, input, validate)
        return output

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum", *,
                       algorithm: str | None = None) -> torch.Tensor:
        """``output`` := the reduction across ranks of this rank's share of ``input``: rank r gets
        segment r of the ``world_size`` equal segments (torch's ``reduce_scatter_tensor``)."""

        def validate():
            self._check_pair("reduce_scatter", output, input)
            share = self._divisible("reduce_scatter", "input", input.numel())
            if output.numel() != share:
                raise IrisError(f"reduce_scatter: output has {output.numel()} elements; it needs input / world_size "
                                f"= {share}")

        self._run("reduce_scatter", algorithm, output, input, validate, op=_reduce_op_name(op))
        return output

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, *, algorithm: str | None = None) -> torch.Tensor:
        """Segment j of this rank's ``input`` goes to rank j, which stores it as its segment r
        (``world_size`` equal segments; torch's ``all_to_all_single`` without split sizes)."""

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
            raise IrisError(f"broadcast: src={src!r} is not a rank of this world (0..{world - 1})")
        self._run("broadcast", algorithm, tensor, tensor, lambda: self._check_tensor("tensor", "broadcast", tensor),
                  src=src)
        return tensor

    def barrier(self) -> None:
        """Wait until every rank's earlier device work is complete and every rank arrived."""
        self._context.barrier()


class CCLMixin:
    """Adds ``ccl``, the :class:`Collectives` namespace bound to this context. Requires
    ``barrier()`` (ContextBase) and the heap's constructors (TensorMixin)."""

    @cached_property
    def ccl(self) -> Collectives:
        return Collectives(self)

    def _teardown(self) -> None:
        # Repeats launch with heap addresses that are about to be released; a call made through
        # a Collectives object kept from before then goes through the checks, which raise.
        if "ccl" in self.__dict__:
            self.__dict__["ccl"]._repeats.clear()
        super()._teardown()

