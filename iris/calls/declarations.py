"""Every public call of ``ctx.ccl`` and ``ctx.ops``, declared once.

A :class:`Declaration` says what a call takes, what it writes and what it is: its parameters
(with the types of PyTorch's operator schemas), the tensors it writes in place, how its
functional form makes them, the tensor the method returns, and, for a collective, what the
algorithms and checks need to know (whether it reduces, its root, what only the root passes).
From it iris derives, with no second spelling of the call anywhere:

- the custom operators ``torch.ops.iris.<name>_`` (in place) and ``torch.ops.iris.<name>``
  (functional), with their fake implementations (:mod:`iris.calls.operators`);
- what the method does with ``group=``, ``async_op=`` and under ``torch.compile``, and the check
  that its signature is the declared one (:func:`iris.calls.routing.declared`);
- ``iris.functional.<name>`` (:mod:`iris.functional`);
- the call's name in traces and errors (``ccl.all_reduce``) and the lists of collectives the
  algorithm registries and the tuning read (:mod:`iris.collectives.algorithms`).

What the method checks and runs is its implementation: ``ctx.ccl``'s in :mod:`iris.mixins.ccl`,
``ctx.ops``' in the backend. Adding a call is its declaration here, its method, and its kernels.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable

import attrs
import torch

from iris.errors import IrisError

__all__ = ["COPY", "DECLARATIONS", "LIKE", "REDUCE_OPS", "REQUIRED", "Declaration", "Made", "Output", "Param",
           "declaration", "dense", "reduce_op_name"]

#: The default of a parameter that has none.
REQUIRED = object()


@attrs.frozen
class Param:
    """One parameter of a call's method, as its operators take it."""

    name: str
    type: str
    """Its type in an operator schema: ``Tensor``, ``Tensor?``, ``int``, ``float``, ``bool``,
    ``str``, ``str?``, ``int[]?``."""
    default: Any = REQUIRED
    keyword_only: bool = False
    convert: Callable[[Any], Any] | None = None
    """What the method's argument becomes for the operators (a ``torch.distributed.ReduceOp`` its
    name, say); None: as it is."""


#: How a functional operator makes an output: a copy of the argument, which the call also reads
#: (``all_reduce``'s tensor) ...
COPY = "copy"
#: ... or a new tensor of the argument's shape, which the call only writes (``recv``'s tensor).
LIKE = "like"


@attrs.frozen
class Made:
    """... or a new tensor made from the call's other arguments: ``make(arguments, target)``, where
    ``arguments`` are the call's by name and ``target`` is the ``ctx.ccl`` / ``ctx.ops`` object it
    runs on (``target._context`` has the world size and rank). The functional form then has no
    such parameter. With ``optional``, it takes ``keep_<name>`` instead: the output is made when
    that is true and the in-place call gets None when it is false (an empty tensor is returned)."""

    make: Callable[[Mapping[str, Any], Any], torch.Tensor]
    optional: bool = False


@attrs.frozen
class Output:
    """A tensor a call writes in place, and how its functional form makes it (:data:`COPY`,
    :data:`LIKE` or :class:`Made`). A ``Made`` output that comes out empty (``gather`` off its
    root) reaches the in-place call as None."""

    name: str
    fresh: str | Made


@attrs.frozen
class Declaration:
    """One public call: ``ctx.<namespace>.<name>(...)``."""

    name: str
    namespace: str
    """``"ccl"`` or ``"ops"``."""
    params: tuple[Param, ...]
    outputs: tuple[Output, ...] = ()
    """What the call writes; none: it only has an effect (``send``, ``barrier``)."""
    returns: str | None = None
    """The parameter the method returns; None: it returns None."""
    summary: str = ""
    """What the functional form returns, one sentence (``iris.functional``'s docs)."""
    flattened: tuple[str, ...] = ()
    """Parameters the method's compiled form passes flattened (their sizes, not their shapes,
    are what the call relates: ``all_gather`` of any shapes with the right numbers of elements)."""
    algorithms: bool = False
    """A collective dispatched to the registered algorithms of its name (entry-point group
    ``iris.ccl.<name>``)."""
    reduces: bool = False
    """It takes ``op`` and reduces."""
    root: str | None = None
    """The name of its root parameter (``src`` or ``dst``), for a rooted collective."""
    root_only: str | None = None
    """What only the root passes (``"output"`` or ``"input"``: the other ranks pass None there)."""
    pair: bool = False
    """Made by the two ranks of a pair only (``send``/``recv``)."""
    uneven: bool = False
    """Its tensors' rows differ in number between ranks (the uneven all-to-alls)."""

    @property
    def trace_name(self) -> str:
        """The call's name in traces and errors: ``ccl.all_reduce``."""
        return f"{self.namespace}.{self.name}"

    @property
    def mutated(self) -> tuple[str, ...]:
        return tuple(output.name for output in self.outputs)


# -- what the functional forms make ----------------------------------------------------------------------


def _world(target) -> int:
    return target._context.world_size


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor like ``tensor`` (what a functional form returns for it)."""
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _gathered(arguments, target) -> torch.Tensor:
    """Every rank's ``input`` stacked along dim 0."""
    input = arguments["input"]
    world = _world(target)
    return input.new_empty((world * input.shape[0], *input.shape[1:]) if input.dim() else (world,))


def _gathered_on_root(arguments, target) -> torch.Tensor:
    """:func:`_gathered` on rank ``dst``, an empty tensor elsewhere."""
    if target._context.rank == arguments["dst"]:
        return _gathered(arguments, target)
    return arguments["input"].new_empty((0,))


def _scattered(arguments, target) -> torch.Tensor:
    """This rank's block of dim 0 of ``input``."""
    input, world = arguments["input"], _world(target)
    if input.dim() == 0 or input.shape[0] % world:
        raise IrisError(f"reduce_scatter: the functional form splits dim 0 among the ranks; input has shape "
                        f"{tuple(input.shape)}, whose dim 0 is not divisible by the world size {world}. Pad it, or "
                        f"call the in-place form with an output of input.numel() / world_size elements")
    return input.new_empty((input.shape[0] // world, *input.shape[1:]))


def _received(arguments, target) -> torch.Tensor:
    """The rows an ``all_to_all_single`` receives, in rank order."""
    input, sizes = arguments["input"], arguments["output_split_sizes"]
    return dense(input) if sizes is None else input.new_empty((sum(sizes), *input.shape[1:]))


def _dense_of(name: str) -> Made:
    """A new tensor like the argument ``name``."""
    return Made(lambda arguments, target: dense(arguments[name]))


def _product(rows: Callable[[int, int], int]) -> Made:
    """The output of a fused product of ``a`` (or ``a_shard``) and ``b``: ``rows(a's rows, world)``
    x b's columns, of a's dtype."""

    def make(arguments, target) -> torch.Tensor:
        a = arguments.get("a", arguments.get("a_shard"))
        b = arguments["b"]
        if a.dim() != 2 or b.dim() != 2:
            raise IrisError(f"a and b must be matrices (2-D), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
        return a.new_empty((rows(a.shape[0], _world(target)), b.shape[1]))

    return Made(make)


def _rows_of_share(rows: int, world: int) -> int:
    if rows % world:
        raise IrisError(f"matmul_reduce_scatter: a has {rows} rows, not divisible by the world size {world}; pad M "
                        f"to a multiple of {world}")
    return rows // world


# -- the declarations -------------------------------------------------------------------------------------

#: Reductions, by the names the kernels use. ``avg`` is the sum divided by the world size, for
#: floating-point types only.
REDUCE_OPS = ("sum", "prod", "max", "min", "avg")


def reduce_op_name(op) -> str:
    """One of :data:`REDUCE_OPS`, from a name (any case) or a ``torch.distributed.ReduceOp``."""
    if isinstance(op, str) and op.lower() in REDUCE_OPS:
        return op.lower()
    reduce_op = torch.distributed.ReduceOp
    # By identity, not a dict: some Dynamo versions cannot hash a ReduceOp.
    for member, name in ((reduce_op.SUM, "sum"), (reduce_op.PRODUCT, "prod"), (reduce_op.MAX, "max"),
                         (reduce_op.MIN, "min"), (reduce_op.AVG, "avg")):
        if op is member:
            return name
    raise ValueError(f"op must be one of {', '.join(REDUCE_OPS)} (or torch.distributed.ReduceOp.SUM, PRODUCT, MAX, "
                     f"MIN or AVG), got {op!r}")


def _split_list(sizes):
    return None if sizes is None else [int(size) for size in sizes]


def _tensor(name: str, optional: bool = False) -> Param:
    return Param(name, "Tensor?" if optional else "Tensor")


OP = Param("op", "str", "sum", convert=reduce_op_name)
ALGORITHM = Param("algorithm", "str?", None, keyword_only=True)
METHOD = Param("method", "str?", None, keyword_only=True)


def _collective(name: str, params: tuple, outputs: tuple = (), returns: str | None = None, **traits) -> Declaration:
    return Declaration(name=name, namespace="ccl", params=(*params, ALGORITHM), outputs=outputs, returns=returns,
                       algorithms=True, **traits)


def _product_operation(name: str, first: str, rows: Callable[[int, int], int], summary: str) -> Declaration:
    return Declaration(name=name, namespace="ops", params=(_tensor("out"), _tensor(first), _tensor("b"), METHOD),
                       outputs=(Output("out", _product(rows)),), returns="out", summary=summary)


_DECLARED = (
    _collective("all_reduce", (_tensor("tensor"), OP), (Output("tensor", COPY),), "tensor", reduces=True,
                summary="The reduction (sum, max, min, ...) of ``tensor`` over the ranks."),
    _collective("all_gather", (_tensor("output"), _tensor("input")), (Output("output", Made(_gathered)),), "output",
                flattened=("input",),
                summary="Every rank's ``input`` concatenated along dim 0, in rank order (``(world * d0, ...)``)."),
    _collective("reduce_scatter", (_tensor("output"), _tensor("input"), OP), (Output("output", Made(_scattered)),),
                "output", flattened=("input",), reduces=True,
                summary="This rank's block of dim 0 of the reduction of ``input`` over the ranks (``(d0 / world, "
                        "...)``; dim 0 must divide by the world size)."),
    _collective("all_to_all", (_tensor("output"), _tensor("input")), (Output("output", _dense_of("input")),),
                "output", summary="Segment j of ``input`` (``world`` equal segments of its elements) sent to rank j, "
                                  "which keeps it as its segment of this rank's number."),
    _collective("broadcast", (_tensor("tensor"), Param("src", "int", 0)), (Output("tensor", COPY),), "tensor",
                root="src", summary="Rank ``src``'s ``tensor``, on every rank."),
    _collective("reduce", (_tensor("tensor"), Param("dst", "int", 0), OP), (Output("tensor", COPY),), "tensor",
                reduces=True, root="dst", root_only="output",
                summary="On rank ``dst``, the reduction of ``tensor`` over the ranks; elsewhere a copy of "
                        "``tensor``."),
    _collective("gather", (_tensor("output", optional=True), _tensor("input"), Param("dst", "int", 0)),
                (Output("output", Made(_gathered_on_root)),), "output", flattened=("input",), root="dst",
                root_only="output",
                summary="On rank ``dst``, every rank's ``input`` stacked along dim 0; elsewhere an empty tensor."),
    _collective("scatter", (_tensor("output"), _tensor("input", optional=True), Param("src", "int", 0)),
                (Output("output", LIKE),), "output", root="src", root_only="input",
                summary="Segment r of rank ``src``'s ``input``, on rank r, in a tensor of ``output``'s shape."),
    _collective("send", (_tensor("tensor"), Param("dst", "int")), pair=True,
                summary="Nothing: ``tensor`` goes to rank ``dst``."),
    _collective("recv", (_tensor("tensor"), Param("src", "int")), (Output("tensor", LIKE),), "tensor", pair=True,
                summary="The next message rank ``src`` sends this rank, in a tensor of ``tensor``'s shape."),
    _collective("all_to_all_single", (_tensor("output"), _tensor("input"),
                                      Param("output_split_sizes", "int[]?", None, convert=_split_list),
                                      Param("input_split_sizes", "int[]?", None, convert=_split_list)),
                (Output("output", Made(_received)),), "output", uneven=True,
                summary="torch's ``all_to_all_single``: ``input_split_sizes[j]`` rows of ``input`` go to rank j; "
                        "the result holds ``output_split_sizes[i]`` rows from each rank i, in rank order (None: "
                        "equal splits)."),
    _collective("all_to_all_vdev", (_tensor("output"), _tensor("input"), _tensor("input_splits"),
                                    _tensor("output_splits")),
                (Output("output", COPY), Output("output_splits", _dense_of("input_splits"))), "output_splits",
                uneven=True,
                summary="``output`` with the rows received packed from row 0 in source-rank order, and the rows "
                        "received from each rank (split counts known only on the device)."),
    Declaration(name="barrier", namespace="ccl", params=(),
                summary="Nothing: every rank's earlier device work is complete and every rank arrived."),
    _product_operation("all_gather_matmul", "a_shard", lambda rows, world: world * rows,
                       "``all_gather(a_shard) @ b`` (``(world * m) x N``), the gather overlapped with the product."),
    _product_operation("matmul_reduce_scatter", "a", _rows_of_share,
                       "This rank's block of rows of ``a @ b`` summed over the ranks (``(M / world) x N``)."),
    _product_operation("matmul_all_reduce", "a", lambda rows, world: rows,
                       "``a @ b`` summed over the ranks (``M x N``)."),
    _product_operation("matmul_all_gather", "a", lambda rows, world: world * rows,
                       "Every rank's ``a @ b`` stacked in rank order (``(world * m) x N``)."),
    Declaration(name="all_reduce_rmsnorm", namespace="ops",
                params=(_tensor("out"), _tensor("x"), _tensor("residual"), _tensor("weight"),
                        Param("eps", "float", 1e-6, convert=float), Param("residual_out", "Tensor?", None), METHOD),
                outputs=(Output("out", _dense_of("x")),
                         Output("residual_out", Made(_dense_of("x").make, optional=True))),
                returns="out",
                summary="``rms_norm(all_reduce(x) + residual, (hidden,), weight, eps)`` and, with "
                        "``keep_residual_out``, ``all_reduce(x) + residual`` (else an empty tensor)."),
)

#: Every declared call, by name (the names are unique across ``ctx.ccl`` and ``ctx.ops``: they
#: name the operators of one namespace, ``torch.ops.iris``).
DECLARATIONS: Mapping[str, Declaration] = MappingProxyType({d.name: d for d in _DECLARED})


def declaration(name: str) -> Declaration:
    """The declaration of the call ``name``."""
    return DECLARATIONS[name]
