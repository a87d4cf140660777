"""CCLMixin: the ``ctx.ccl`` namespace of collectives.

``ctx.ccl`` checks a call (devices, dtypes, sizes, contiguity), then dispatches it to a
registered algorithm (:mod:`iris.collectives`): the one named, or the automatic choice (the
tuned one of :mod:`iris.tuning` where the tuning cache has one, else the built-in choice). The
algorithms keep their buffers in the context's workspaces (:mod:`iris.collectives.workspaces`), so calls
after the first of a given size and dtype allocate nothing and never wait on the host, and can
be captured in a CUDA graph.

A call identical to an earlier one (the same tensors by address, shape, layout and dtype, the
same options) skips the checks and the algorithm's preparation: the algorithm's *repeat* of the
earlier launch, which the earlier call offered, runs instead (:mod:`iris.calls.repeats`), which
keeps the host's cost per call low when calls are not captured in a graph.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Protocol

import torch

from iris.collectives import (COLLECTIVES, MOVED_ONLY_DTYPES, POINT_TO_POINT, REDUCING, ROOT_ONLY,
                               SUPPORTED_DTYPES, Algorithm, CallShape, CollectiveCall, algorithm_registry, choose,
                               reduce_op_name)
from iris.calls.handles import forget as forget_operator_handles
from iris.calls.handles import register as register_operator_handle
from iris.calls.repeats import Repeats, offer, taking_stream
from iris.calls.repeats import invalidate as invalidate_repeats
from iris.calls.routing import declared
from iris.errors import IrisError
from iris.collectives.groups import namespace_for
from iris.tuning import load as load_tuning
from iris.tuning import tune_collectives
from iris.collectives.uneven import SplitTensors, check_apart, check_counts, check_rows, same_on_every_rank, split_sizes

__all__ = ["CCLMixin", "Collectives"]

#: The world collectives a world of several nodes runs hierarchically (iris.collectives.hierarchical), as
#: ``(hierarchy, output, input, op, src) -> output``.
HIERARCHICAL = {
    "all_reduce": lambda h, output, input, op, src: h.all_reduce(output, op),
    "all_gather": lambda h, output, input, op, src: h.all_gather(output, input),
    "reduce_scatter": lambda h, output, input, op, src: h.reduce_scatter(output, input, op),
    "broadcast": lambda h, output, input, op, src: h.broadcast(output, src),
    "all_to_all": lambda h, output, input, op, src: h.all_to_all(output, input),
}

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
    """:func:`~iris.collectives.algorithms.reduce_op_name`, after refusing upstream's ``all_reduce(out, inp)``."""
    if isinstance(op, torch.Tensor):
        _refuse_upstream_call("all_reduce", "a second tensor (all_reduce(out, inp))", {})
    return reduce_op_name(op)


def _alike_on_every_rank(collective: str, output, input, world_size: int) -> tuple:
    """``(output, input)`` as every rank's call has them alike, for the automatic choice and the
    debug mode's comparison: what only the root of a rooted collective passes
    (:data:`~iris.collectives.ROOT_ONLY`) is, on every rank, a meta tensor of the size the call
    gives it (reduce: the tensor itself)."""
    root_only = ROOT_ONLY.get(collective)
    if root_only == "output" and isinstance(input, torch.Tensor):
        output = input if collective == "reduce" else input.new_empty(world_size * input.numel(), device="meta")
    elif root_only == "input" and isinstance(output, torch.Tensor):
        input = output.new_empty(world_size * output.numel(), device="meta")
    return output, input


def _describe_tensor(tensor) -> str:
    if isinstance(tensor, torch.Tensor):
        return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
    return type(tensor).__name__


def describe_call(collective: str, output, input, op: str, src: int, algorithm: str | None) -> str:
    """A call as errors name it, e.g. ``all_reduce(output (1000,) float32, input (1000,) float32,
    op=sum, src=0, algorithm=low_latency)``: ``output`` and ``input`` as every rank's identical
    call has them (:func:`_alike_on_every_rank`)."""
    return (f"{collective}(output {_describe_tensor(output)}, input {_describe_tensor(input)}, op={op}, src={src}, "
            f"algorithm={algorithm})")


class Collectives:
    """Device-side collectives of one context (``ctx.ccl``), with torch.distributed semantics.

    Every method but ``send``/``recv`` is a collective operation: all ranks (of the group, with
    ``group=``) call it in the same order with tensors of the same shape and dtype; ``send`` and
    ``recv`` are made by the two ranks of a pair, in the same order on both. Inputs may be heap
    tensors (used in place) or plain tensors on the context's device (staged through the heap
    workspace); results land in the tensors passed. Work is enqueued on the current stream;
    nothing waits on the host (but the host exchange of an eager ``all_to_all_single``).
    """

    #: Public methods without a custom operator (torch.ops.iris): they are not collectives.
    EAGER_ONLY = ("tune",)

    def __init__(self, context):
        self._context = context
        #: Repeats of earlier calls, by everything the calls' checks and launches depend on.
        self._repeats = Repeats(context)
        #: This object's handle for the custom operators (torch.ops.iris.*, iris.calls.handles).
        self._iris_handle = register_operator_handle(self)

    def _for_group(self, group) -> "Collectives":
        """The collectives that run calls with ``group=group`` (:mod:`iris.collectives.groups`)."""
        return namespace_for(self, group)

    # -- discovery ------------------------------------------------------------------------------

    def algorithms(self, collective: str, *, applying_to: torch.Tensor | None = None,
                   op: str | None = None) -> list[str]:
        """Names of the algorithms registered for ``collective``; with ``applying_to``, only those
        that can run a call of this context with that input (and, for a collective that reduces,
        the reduction ``op``: None for any)."""
        names = algorithm_registry(collective).names()
        if applying_to is None:
            return names
        shape = self._shape(collective, applying_to, None if op is None else _reduce_op_name(op))
        return [name for name in names if algorithm_registry(collective).get(name).refusal(shape) is None]

    def _shape(self, collective: str, input: torch.Tensor, op: str | None) -> CallShape:
        ctx = self._context
        return CallShape(collective=collective, nbytes=input.numel() * input.element_size(),
                         world_size=ctx.world_size, dtype=input.dtype, device_type=ctx.kernel_device_type,
                         language=ctx.kernel_language, op=op if collective in REDUCING else None)

    def tune(self, collectives=None, dtypes=None, sizes=None, *, repeats: int | None = None, save: bool = True,
             timer=None):
        """Time the algorithms of ``collectives`` on this machine, for each of ``dtypes`` and size
        buckets, and make the automatic choice take the fastest on the slowest rank (saved in
        the tuning cache if ``save``); returns the :class:`iris.tuning.TuningTable` of the
        decisions. Collective: every rank calls it with the same arguments (docs/tuning.md)."""
        return tune_collectives(self, collectives, dtypes, sizes, repeats=repeats, save=save, timer=timer)

    def _algorithm(self, collective: str, name: str | None, input: torch.Tensor,
                   op: str) -> tuple[Algorithm, str | None]:
        """The algorithm that runs a call, and the name of the launch shape it runs with (None:
        its own choice): ``name`` (``"algorithm"`` or ``"algorithm/shape"``), else the tuned
        choice, else the built-in one."""
        ctx = self._context
        if name is None:
            tuned = ctx.tuning.choice(self._shape(collective, input, op)) if ctx.tuning.entries else None
            if tuned is not None:
                return tuned
            return choose(collective, input.numel() * input.element_size(), ctx.world_size, input.dtype,
                          ctx.kernel_device_type, ctx.kernel_language, op if collective in REDUCING else None), None
        name, _, launch_shape = name.partition("/")
        shape = self._shape(collective, input, op)
        registry = algorithm_registry(collective)
        algorithm = registry.get(name)
        refusal = algorithm.refusal(shape)
        if refusal is not None:
            runs = self.algorithms(collective, applying_to=input, op=shape.op)
            raise IrisError(f"{collective}: algorithm {name!r} cannot run this call: {refusal}; choose one of "
                            f"{runs} or None (the automatic choice)")
        shapes = algorithm.launch_shapes.get(ctx.kernel_device_type, {})
        if launch_shape and launch_shape not in shapes:
            raise IrisError(f"{collective}: algorithm {name!r} has no launch shape {launch_shape!r} on "
                            f"{ctx.kernel_device_type} ranks; its shapes: {sorted(shapes) or 'none to choose from'}")
        return algorithm, launch_shape or None

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

    def _check_reduction(self, collective: str, tensor: torch.Tensor, op: str) -> None:
        """``op`` can reduce tensors of ``tensor``'s dtype (checked after :meth:`_check_tensor`)."""
        if tensor.dtype in MOVED_ONLY_DTYPES:
            raise IrisError(f"{collective}: {tensor.dtype} tensors are moved, not reduced; cast to torch.bfloat16, "
                            f"torch.float16 or torch.float32 first and back after (reductions of 16-bit floats "
                            f"accumulate in float32)")
        if op == "avg" and not tensor.dtype.is_floating_point:
            raise IrisError(f"{collective}: op='avg' takes floating-point tensors, this one is {tensor.dtype}; reduce "
                            f"with op='sum' and divide the result by the world size ({self._context.world_size})")

    def _check_root(self, collective: str, name: str, root) -> None:
        """``root`` (the ``src`` or ``dst`` of a rooted collective, or a pair's peer) is a rank of
        this context."""
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._context.world_size:
            raise IrisError(f"{collective}: {name}={root!r} is not a rank of {self._context.describe_ranks()}")

    def _check_root_passes(self, collective: str, name: str, root: int, what: str, tensor, needs: str) -> None:
        """On the root: it passed ``what`` (the tensor only the root passes, ``needs`` says which)."""
        if tensor is None:
            raise IrisError(f"{collective}: rank {root} is the {name} and must pass {what}, {needs}; the other ranks "
                            f"pass {what}=None")

    def _check_whole_on_root(self, collective: str, name: str, root: int, whole: tuple, part: tuple) -> None:
        """On the root of gather (scatter): it passed the tensor of every rank's part, ``whole``
        (name, tensor), of world_size x the elements of ``part`` (name, tensor), alike."""
        world = self._context.world_size
        (whole_name, whole_tensor), (part_name, part_tensor) = whole, part
        needs = f"a tensor of world_size x {part_name}'s elements ({world} x {part_tensor.numel()})"
        self._check_root_passes(collective, name, root, whole_name, whole_tensor, needs)
        output, input = (whole_tensor, part_tensor) if whole_name == "output" else (part_tensor, whole_tensor)
        self._check_pair(collective, output, input)
        if whole_tensor.numel() != world * part_tensor.numel():
            raise IrisError(f"{collective}: {whole_name} has {whole_tensor.numel()} elements; it needs world_size x "
                            f"{part_name} = {world} x {part_tensor.numel()} = {world * part_tensor.numel()}")

    def _divisible(self, collective: str, what: str, numel: int) -> int:
        world = self._context.world_size
        if numel % world:
            raise IrisError(f"{collective}: {what} has {numel} elements, not divisible by the world size {world}; "
                            f"pad it to a multiple of {world}")
        return numel // world

    def _run(self, collective: str, algorithm: str | None, output, input, validate: Callable[[], None], *,
             op: str = "sum", src: int = 0, splits: tuple = ()) -> None:
        """Run one call: ``validate()`` it and hand it to its algorithm, offering the launch's
        repeat (:mod:`iris.calls.repeats`). ``splits``: the uneven collectives' (input_splits,
        output_splits) device tensors (:mod:`iris.collectives.uneven`)."""
        if algorithm is not None and not isinstance(algorithm, str):
            raise TypeError(f"{collective}: algorithm must be a name (str) or None, got {type(algorithm).__name__}")
        ctx = self._context
        if ctx._spans_nodes():
            if algorithm is None and collective in HIERARCHICAL:
                validate()
                return HIERARCHICAL[collective](ctx.hierarchy, output, input, op, src)
            ctx._refuse_across_nodes(f"ccl.{collective}" + ("" if algorithm is None else f"(algorithm={algorithm!r})"))
        with self._context._call(f"ccl.{collective}", (output,) if isinstance(output, torch.Tensor) else ()):
            self._dispatch(collective, algorithm, output, input, validate, op, src, splits)

    def _dispatch(self, collective: str, algorithm: str | None, output, input, validate: Callable[[], None], op: str,
                  src: int, splits: tuple = ()) -> None:
        debug = self._context.config.debug
        if splits:
            same = same_on_every_rank(collective, output, input)
        else:
            same = _alike_on_every_rank(collective, output, input, self._context.world_size)
        if debug and collective not in POINT_TO_POINT:  # a pair's call: the other ranks make none to compare
            self._check_same_call_on_every_rank(collective, algorithm, op, src, *same)
        validate()
        chosen, launch_shape = self._algorithm(collective, algorithm, same[1], op)
        if same[1].numel() == 0 and not splits:  # uneven: a rank may send nothing and still receive
            return
        call = CollectiveCall(context=self._context, collective=collective, output=output, input=input, op=op,
                              src=src, launch_shape=launch_shape, algorithm=chosen.name,
                              **dict(zip(("input_splits", "output_splits"), splits)))
        if collective in POINT_TO_POINT:  # a pair's call: no header, no collective exchange to name it in
            repeat = chosen.run(call)
        else:
            name = chosen.name if launch_shape is None else f"{chosen.name}/{launch_shape}"
            outer = self._context._describe_call(f"ccl.{collective}", call.signature,
                                                 describe_call(collective, *same, op, src, name))
            try:
                repeat = chosen.run(call)
            finally:
                self._context._end_call(outer)
        offer(self._context, taking_stream(repeat))

    def _check_same_call_on_every_rank(self, collective, algorithm, op, src, output, input) -> None:
        """Debug mode: every rank makes the same call (collective, options, shapes, dtypes), or
        every rank raises, naming what differs; a host exchange per call."""

        mine = describe_call(collective, output, input, op, src, algorithm)
        calls = self._context.comm.all_gather_object(mine)
        if any(call != calls[0] for call in calls):
            listing = "; ".join(f"rank {rank}: {call}" for rank, call in enumerate(calls))
            raise IrisError(f"{collective}: the ranks made different calls (IRIS_DEBUG check): {listing}; every "
                            f"rank must call the same collective with tensors of the same shape and dtype")

    # -- the collectives ------------------------------------------------------------------------

    @declared
    def all_reduce(self, tensor: torch.Tensor, op="sum", *, algorithm: str | None = None,
                   **upstream_keywords) -> torch.Tensor:
        """Reduce ``tensor`` across ranks (sum, prod, max, min or avg) in place; every rank gets the
        same result. ``algorithm``: any registered one (:meth:`algorithms`; the Triton backend has
        ``"low_latency"``, ``"sentinel"`` (floats), ``"one_shot"`` and ``"two_shot"``); by default
        chosen by size, world size and dtype (:func:`iris.collectives.choose`)."""
        _refuse_upstream_keywords("all_reduce", upstream_keywords)
        op = _reduce_op_name(op)

        def validate():
            self._check_tensor("tensor", "all_reduce", tensor)
            self._check_reduction("all_reduce", tensor, op)

        self._run("all_reduce", algorithm, tensor, tensor, validate, op=op)
        return tensor

    @declared
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

    @declared
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum", *,
                       algorithm: str | None = None, **upstream_keywords) -> torch.Tensor:
        """``output`` := the reduction across ranks of this rank's share of ``input``: rank r gets
        segment r of the ``world_size`` equal segments (torch's ``reduce_scatter_tensor``)."""

        _refuse_upstream_keywords("reduce_scatter", upstream_keywords)
        op = _reduce_op_name(op)

        def validate():
            self._check_pair("reduce_scatter", output, input)
            self._check_reduction("reduce_scatter", input, op)
            if output.numel() == input.numel() and self._context.world_size > 1:
                _refuse_upstream_call("reduce_scatter", "an output of the input's size (the full-shape "
                                      "reduce_scatter)", {})
            share = self._divisible("reduce_scatter", "input", input.numel())
            if output.numel() != share:
                raise IrisError(f"reduce_scatter: output has {output.numel()} elements; it needs input / world_size "
                                f"= {share}")

        self._run("reduce_scatter", algorithm, output, input, validate, op=op)
        return output

    @declared
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

    @declared
    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, algorithm: str | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` := rank ``src``'s, in place."""
        self._check_root("broadcast", "src", src)
        self._run("broadcast", algorithm, tensor, tensor, lambda: self._check_tensor("tensor", "broadcast", tensor),
                  src=src)
        return tensor

    @declared
    def reduce(self, tensor: torch.Tensor, dst: int = 0, op="sum", *, algorithm: str | None = None) -> torch.Tensor:
        """Rank ``dst``'s ``tensor`` := every rank's ``tensor`` reduced (sum, prod, max, min or
        avg), in place; the other ranks' tensors are left unchanged (torch's ``reduce``)."""
        self._check_root("reduce", "dst", dst)
        op = _reduce_op_name(op)

        def validate():
            self._check_tensor("tensor", "reduce", tensor)
            self._check_reduction("reduce", tensor, op)

        on_root = self._context.rank == dst
        self._run("reduce", algorithm, tensor if on_root else None, tensor, validate, op=op, src=dst)
        return tensor

    @declared
    def gather(self, output: torch.Tensor | None, input: torch.Tensor, dst: int = 0, *,
               algorithm: str | None = None) -> torch.Tensor | None:
        """On rank ``dst``, ``output`` (world_size x input's elements, e.g. shape
        ``[world_size, *input.shape]``) := every rank's ``input``, in rank order (torch's
        ``gather``, into one tensor). The other ranks pass ``output=None`` (a tensor there is left
        unchanged)."""
        self._check_root("gather", "dst", dst)
        on_root = self._context.rank == dst

        def validate():
            self._check_tensor("input", "gather", input)
            if on_root:
                self._check_whole_on_root("gather", "dst", dst, ("output", output), ("input", input))

        self._run("gather", algorithm, output if on_root else None, input, validate, src=dst)
        return output

    @declared
    def scatter(self, output: torch.Tensor, input: torch.Tensor | None, src: int = 0, *,
                algorithm: str | None = None) -> torch.Tensor:
        """Rank r's ``output`` := segment r of rank ``src``'s ``input`` (``world_size`` equal
        segments, e.g. shape ``[world_size, *output.shape]``; torch's ``scatter``, from one
        tensor). The other ranks pass ``input=None`` (a tensor there is not read)."""
        self._check_root("scatter", "src", src)
        on_root = self._context.rank == src

        def validate():
            self._check_tensor("output", "scatter", output)
            if on_root:
                self._check_whole_on_root("scatter", "src", src, ("input", input), ("output", output))

        self._run("scatter", algorithm, output, input if on_root else None, validate, src=src)
        return output

    @declared
    def barrier(self) -> None:
        """Wait until every rank's earlier device work is complete and every rank arrived."""
        self._context.barrier()

    # -- point to point --

    @declared
    def send(self, tensor: torch.Tensor, dst: int, *, algorithm: str | None = None) -> None:
        """Send ``tensor`` to rank ``dst``, which receives it with ``recv(t, src=<this rank>)``
        into a tensor of the same number of elements and dtype (a mismatch fails the call).
        Only the two ranks take part; messages between them arrive in the order they were sent.
        Blocking as torch.distributed's ``send`` is, from the program's view: enqueued on the
        current stream, which reaches the work after it once the message is out of ``tensor``
        (a small one may not wait for its recv: never count on either)."""
        self._check_peer("send", "dst", dst)
        self._run("send", algorithm, None, tensor, lambda: self._check_tensor("tensor", "send", tensor), src=dst)

    @declared
    def recv(self, tensor: torch.Tensor, src: int, *, algorithm: str | None = None) -> torch.Tensor:
        """Receive into ``tensor`` the next message rank ``src`` sends to this rank (``send``),
        of the same number of elements and dtype; returns ``tensor``. Only the two ranks take
        part. Enqueued on the current stream: the data are in ``tensor`` when the stream gets
        past the call. A message of another size or dtype fails the call (IrisTimeoutError,
        ``tensor`` filled with NaN, integers -1)."""
        self._check_peer("recv", "src", src)
        self._run("recv", algorithm, tensor, tensor, lambda: self._check_tensor("tensor", "recv", tensor), src=src)
        return tensor

    def _check_peer(self, collective: str, name: str, peer) -> None:
        """``peer`` (the ``dst`` or ``src`` of a pair's call) is another rank of this context."""
        self._check_root(collective, name, peer)
        if peer == self._context.rank:
            raise IrisError(f"{collective}: {name}={peer} is this rank; send and recv move data between two ranks "
                            f"(copy within a rank with tensor.copy_)")

    # -- uneven all-to-all --

    @declared
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                          input_split_sizes=None, *, algorithm: str | None = None) -> torch.Tensor:
        """torch.distributed's ``all_to_all_single``: rows of ``input`` (along dim 0; a row is the
        product of the other dims, the same for ``output``) go to each rank in turn,
        ``input_split_sizes[j]`` of them to rank j, and ``output`` receives
        ``output_split_sizes[i]`` rows from rank i, packed in rank order. The sizes are host
        lists of ints; None splits that side equally (None for both is :meth:`all_to_all`'s
        call, ``algorithm`` then naming one of its algorithms). ``output_split_sizes[i]`` must
        equal rank i's ``input_split_sizes[this rank]``: a call where they differ fails on the
        device (outputs NaN, integers -1; IrisTimeoutError as for any failed call).

        Every eager call makes one small host exchange (the most bytes a rank receives, which
        sizes the receive workspace alike on every rank). A call captured in a CUDA graph makes
        none: it uses the workspace as earlier calls left it, and fails on the device if its
        rows do not fit; make an eager call of the largest size, and one with each split tuple
        a graph uses, before capturing."""
        collective = "all_to_all_single"
        if output_split_sizes is None and input_split_sizes is None:
            if isinstance(input, torch.Tensor) and input.dim() > 0:
                split_sizes(collective, "input_split_sizes", None, input, self._context.world_size)
            return self.all_to_all(output, input, algorithm=algorithm)
        world = self._context.world_size
        self._check_pair(collective, output, input)
        check_rows(collective, output, input)
        sizes_in = split_sizes(collective, "input_split_sizes", input_split_sizes, input, world)
        sizes_out = split_sizes(collective, "output_split_sizes", output_split_sizes, output, world)
        splits = self._split_tensors().get(collective, sizes_in, sizes_out)
        self._run(collective, algorithm, output, input, lambda: None, splits=splits)
        return output

    @declared
    def all_to_all_vdev(self, output: torch.Tensor, input: torch.Tensor, input_splits: torch.Tensor,
                        output_splits: torch.Tensor, *, algorithm: str | None = None) -> torch.Tensor:
        """All-to-all with split counts known only on the device (MoE routing), with no host
        synchronisation: ``input_splits`` (int64 [world_size], on the device) are the rows of
        ``input`` for each rank, in rank order, packed from row 0; ``output``'s rows are an
        upper bound, the same on every rank, of the rows any rank receives. Fills ``output``
        with the rows received, packed in source-rank order from row 0 (the rows after them are
        left as they were), and ``output_splits`` (int64 [world_size], on the device) with the
        rows received from each rank; returns ``output_splits``.

        Every rank sees every rank's counts on the device before any row moves: counts that are
        negative or exceed their input, a rank that would receive more rows than the bound, or
        ranks with different bounds fail the call on every rank (``output`` NaN, integers -1,
        ``output_splits`` -1; IrisTimeoutError at this call on CPU ranks, at the next iris call on
        GPUs, naming what was too large). Nothing is written out of bounds. The receive
        workspace is sized by the bound: a call of a new largest bound grows it collectively,
        so make one before capturing a CUDA graph."""
        collective = "all_to_all_vdev"
        ctx = self._context

        def validate():
            self._check_pair(collective, output, input)
            check_rows(collective, output, input)
            check_counts(collective, "input_splits", input_splits, ctx.device, ctx.world_size)
            check_counts(collective, "output_splits", output_splits, ctx.device, ctx.world_size)
            check_apart(collective, {"output": output, "output_splits": output_splits},
                        {"input": input, "input_splits": input_splits})

        self._run(collective, algorithm, output, input, validate, splits=(input_splits, output_splits))
        return output_splits

    def _split_tensors(self) -> SplitTensors:
        """The device copies of :meth:`all_to_all_single`'s host split sizes (made on first use,
        without the lock a cached_property takes)."""
        kept = self.__dict__.get("_kept_split_tensors")
        if kept is None:
            kept = self.__dict__["_kept_split_tensors"] = SplitTensors(self._context)
        return kept


class CCLHost(Protocol):
    """What CCLMixin needs from the context it is part of (checked when a context is made)."""

    barrier: Callable[[], None]
    comm: Any
    config: Any
    device: torch.device
    rank: int
    world_size: int
    _call: Callable
    workspaces: Any
    kernel_language: str | None


class CCLMixin:
    """Adds ``ccl``, the collectives bound to this context (:class:`Collectives`, or the namespace
    of upstream's conventions for contexts of that kind), and checks at
    set-up that every rank has the same collective algorithms installed (the automatic choice
    must be the same everywhere), then loads the tuned automatic choices (``tuning``,
    :mod:`iris.tuning`)."""

    needs = CCLHost

    def _setup(self) -> None:
        super()._setup()
        installed = {collective: algorithm_registry(collective).names() for collective in COLLECTIVES}
        everyone = self.comm.all_gather_object(installed)
        if any(other != everyone[0] for other in everyone):
            listing = "; ".join(f"rank {rank}: {algorithms}" for rank, algorithms in enumerate(everyone))
            raise IrisError(f"the ranks have different collective algorithms installed ({listing}); install the "
                            f"same iris plugins on every rank: each rank must choose the same algorithm for a call")
        #: The tuned automatic choices (iris.tuning), read by rank 0 and the same on every rank.
        self.tuning = load_tuning(self)
        # Made now rather than on first use: the first use may be inside torch.compile, which
        # cannot trace the lock functools.cached_property takes then (Python 3.11).
        for namespace in ("_torch_ccl", "ccl", "ops"):
            if hasattr(type(self), namespace):
                getattr(self, namespace)

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
        invalidate_repeats()
        forget_operator_handles(self)  # compiled code naming this context's objects raises from now on
        super()._teardown()

