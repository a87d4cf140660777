"""Hierarchical collectives: iris inside each node, torch.distributed between nodes.

A job of ``W`` ranks on ``N`` nodes of ``L`` ranks each is laid out as torchrun lays it out:
world rank ``r = n * L + l`` runs on node ``n`` as its local rank ``l`` (:class:`NodeLayout`).
iris's heap is mapped between the ranks of one node only, so a collective over the whole job is
composed of collectives over two kinds of groups (:class:`Hierarchy`):

- the *node group* of each node (its ``L`` ranks, an iris group made by ``ctx.new_subgroups``):
  its steps run on iris's kernels (``ctx.ccl.<op>(..., group=node_group)``);
- the *cross group* of each local rank ``l`` (the ``N`` ranks ``l, L + l, 2L + l, ...``, one
  per node, a torch.distributed process group: NCCL for GPU tensors, gloo on CPU ranks): its
  steps run on torch.distributed, ``L`` of them side by side, one per local rank.

Every step is enqueued on the current stream, and nothing waits on the host beyond what
torch.distributed's own calls do. The costs below are per rank, for a tensor of ``B`` bytes
(all_reduce, broadcast: the tensor; all_gather: the input; reduce_scatter, all_to_all: the input):

- ``all_reduce(tensor, op)``: reduce_scatter inside the node (each rank sends ``(L-1)/L B`` to
  its node peers and keeps a reduced shard of ``B/L``), all_reduce of that shard over the cross
  group (torch's all_reduce of ``B/L``: a ring sends about ``2 (N-1)/N B/L`` between nodes), then
  all_gather of the shards inside the node (``(L-1)/L B`` again). Every rank's cross-node traffic
  is a ``1/L`` share of the tensor, and the ``L`` cross groups run in parallel. A tensor whose
  element count ``L`` does not divide is copied into a zero-padded workspace of the next multiple
  of ``L`` elements, and copied back. ``avg`` sums and divides the shard by ``W`` once (the mean
  over every rank of the world). 16-bit floats are rounded to their type after the node step
  and by torch's cross step.
- ``all_gather(output, input)``: all_gather inside the node (``(L-1) B`` received into a
  workspace of ``L B``), then all_gather of that node block over the cross group (``(N-1) L B``
  received between nodes) straight into ``output``, which is node-major, hence world rank order.
- ``reduce_scatter(output, input, op)``: the input's ``W`` segments are copied (``B``, locally) into
  the order ``[l][n]``, so that the node's reduce_scatter (sends ``(L-1)/L B`` inside the node)
  leaves local rank ``l`` the node's sum of the ``N`` segments destined to the ranks
  ``n * L + l``; a reduce_scatter of those ``B/L`` over the cross group (about ``(N-1)/N B/L``
  sent between nodes) leaves every rank its own segment. ``avg`` divides the result by ``W``.
- ``broadcast(tensor, src)``: broadcast over the cross group of ``src``'s local rank from
  ``src``'s node (``B`` to each of the other ``N-1`` nodes; the other local ranks take no part),
  then broadcast inside every node from that local rank (``B`` to each of ``L-1`` peers).
- ``all_to_all(output, input)``: the ``L`` segments for this node's ranks go on iris's all_to_all
  over the node (``(L-1)/W B`` sent inside the node, straight into the peers' outputs); the
  ``W - L`` for other nodes (``(W-L)/W B``) through torch.distributed's ``all_to_all_single``
  with this node's splits 0, gathered into one buffer and spread back out (a copy of that part
  each way).

Reductions are those of both sides: ``sum``, ``avg`` (floating point only), ``max``, ``min`` and
``prod``; element types those that iris's collectives and the torch backend both take.

:func:`node_size_from` decides the node size from the environment (``IRIS_LOCAL_WORLD_SIZE``,
torchrun's ``LOCAL_WORLD_SIZE``) or the ranks' host names; :func:`layout_for` does so for a context.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import attrs
import torch
import torch.distributed as dist

from iris.collectives.algorithms import reduce_op_name
from iris.errors import IrisError
from iris.collectives.groups import Group

__all__ = ["Hierarchy", "NodeLayout", "layout_for", "node_size_from"]

#: Environment variable that sets the node size: simulates nodes on one machine.
NODE_SIZE_VARIABLE = "IRIS_LOCAL_WORLD_SIZE"
#: torchrun's number of ranks on this node.
TORCHRUN_NODE_SIZE_VARIABLE = "LOCAL_WORLD_SIZE"

#: torch.distributed's reduction of each iris reduction; avg sums, then divides once by the world size.
_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
#: torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (the old names warn there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _positive_int(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise IrisError(f"NodeLayout: {attribute.name} must be a positive int, got {value!r}")


def _divides_world(instance, attribute, value) -> None:
    if instance.world_size % value:
        raise IrisError(f"NodeLayout: node_size={value} does not divide the world size {instance.world_size}; "
                        f"every node must run the same number of ranks (a divisor of {instance.world_size})")


@attrs.frozen
class NodeLayout:
    """Which node each world rank runs on: consecutive blocks of ``node_size`` ranks (torchrun's
    layout: world rank = node * node_size + local rank)."""

    world_size: int = attrs.field(validator=_positive_int)
    node_size: int = attrs.field(validator=[_positive_int, _divides_world])

    @property
    def nodes(self) -> int:
        return self.world_size // self.node_size

    def node_of(self, rank: int) -> int:
        """The node world rank ``rank`` runs on."""
        return self._checked("rank", rank, self.world_size) // self.node_size

    def local_rank(self, rank: int) -> int:
        """World rank ``rank``'s index among the ranks of its node."""
        return self._checked("rank", rank, self.world_size) % self.node_size

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """The world ranks of node ``node``, by local rank."""
        start = self._checked("node", node, self.nodes) * self.node_size
        return tuple(range(start, start + self.node_size))

    def cross_ranks(self, local: int) -> tuple[int, ...]:
        """The world ranks of local rank ``local`` on every node, by node."""
        return tuple(range(self._checked("local rank", local, self.node_size), self.world_size, self.node_size))

    def _checked(self, what: str, value, bound: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
            raise IrisError(f"NodeLayout: {what} {value!r} is out of range 0..{bound - 1} ({self.nodes} nodes of "
                            f"{self.node_size} ranks)")
        return value


def node_size_from(environ: Mapping[str, str], world_size: int, hostnames: Sequence[str] | None = None) -> int:
    """The number of ranks per node of a world of ``world_size``: ``IRIS_LOCAL_WORLD_SIZE`` if set
    (to simulate nodes on one machine), else torchrun's ``LOCAL_WORLD_SIZE`` where it is smaller
    than the world, else the ranks per host of ``hostnames`` (every rank's host name, in world
    rank order; each host's ranks must be consecutive), else the whole world (one node). The
    result is checked to make a :class:`NodeLayout`."""
    for variable in (NODE_SIZE_VARIABLE, TORCHRUN_NODE_SIZE_VARIABLE):
        text = environ.get(variable)
        if text is None:
            continue
        try:
            size = int(text)
        except ValueError:
            raise IrisError(f"{variable}={text!r} is not a number of ranks per node") from None
        if variable == NODE_SIZE_VARIABLE or size < world_size:
            return _checked_node_size(size, world_size, f"{variable}={text}")
    if hostnames is None:
        return world_size
    return _checked_node_size(_ranks_per_host(list(hostnames), world_size), world_size, "the ranks' host names")


def _checked_node_size(size: int, world_size: int, source: str) -> int:
    try:
        NodeLayout(world_size, size)
    except IrisError as error:
        raise IrisError(f"{source}: {error}") from None
    return size


def _ranks_per_host(hostnames: list[str], world_size: int) -> int:
    if len(hostnames) != world_size:
        raise IrisError(f"node_size_from: {len(hostnames)} host names for a world of {world_size} ranks; pass one "
                        f"per rank, in world rank order")
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hostnames):
        ranks.setdefault(host, []).append(rank)
    for host, mine in ranks.items():
        if mine != list(range(mine[0], mine[0] + len(mine))):
            raise IrisError(f"node_size_from: the ranks of host {host!r} are {mine}, not consecutive; launch so that "
                            f"each node's ranks are consecutive (torchrun does), or set {NODE_SIZE_VARIABLE}")
    sizes = {host: len(mine) for host, mine in ranks.items()}
    if len(set(sizes.values())) > 1:
        raise IrisError(f"node_size_from: the hosts run different numbers of ranks ({sizes}); every node must run "
                        f"the same number")
    return len(hostnames) // len(ranks)


def layout_for(ctx, node_size: int | None = None, environ: Mapping[str, str] | None = None) -> NodeLayout:
    """The :class:`NodeLayout` of ``ctx``'s world: ``node_size`` ranks per node if given, else
    :func:`node_size_from` with every rank's host name (``environ``: default ``os.environ``).
    Collective (one exchange of host names); the ranks must see the same node-size variables."""
    if node_size is not None:
        return NodeLayout(ctx.world_size, node_size)
    environ = os.environ if environ is None else environ
    mine = {v: environ[v] for v in (NODE_SIZE_VARIABLE, TORCHRUN_NODE_SIZE_VARIABLE) if v in environ}
    everyone = ctx.comm.all_gather_object((socket.gethostname(), mine))
    variables = [seen for _, seen in everyone]
    if any(seen != variables[0] for seen in variables):
        listing = "; ".join(f"rank {rank}: {seen}" for rank, seen in enumerate(variables))
        raise IrisError(f"layout_for: the ranks see different node sizes ({listing}); set the same "
                        f"{NODE_SIZE_VARIABLE} on every rank")
    return NodeLayout(ctx.world_size, node_size_from(mine, ctx.world_size, [host for host, _ in everyone]))


@attrs.frozen(eq=False)
class Hierarchy:
    """The groups of a :class:`NodeLayout` over a context, and the world's collectives composed
    of iris's collectives inside each node and torch.distributed's between nodes (module
    docstring). Make it with :meth:`of`, once per context and layout. Every method is collective
    over the world and follows torch.distributed's conventions, returning its output tensor."""

    context: object
    layout: NodeLayout
    node_group: Group
    """This rank's node: an iris group of its node's ranks, by local rank."""
    cross_group: dist.ProcessGroup
    """The torch.distributed group of this rank's local rank on every node, by node."""

    @classmethod
    def of(cls, ctx, layout: NodeLayout, *, workspace_size: int | None = None) -> "Hierarchy":
        """The hierarchy of ``layout`` over ``ctx`` (a context over the whole torch.distributed
        world). Collective over the world: makes the node groups (``ctx.new_subgroups``, with
        ``workspace_size`` bytes of heap for their workspaces) and one torch process group per
        local rank (every rank takes part in making each, as torch asks)."""
        if not isinstance(layout, NodeLayout):
            raise TypeError(f"Hierarchy.of: layout must be an iris.collectives.hierarchical.NodeLayout, got "
                            f"{type(layout).__name__}")
        if layout.world_size != ctx.world_size or ctx.world_size != dist.get_world_size():
            raise IrisError(f"Hierarchy.of: the layout is of {layout.world_size} ranks, the context of "
                            f"{ctx.world_size}, torch.distributed's world of {dist.get_world_size()}; make the layout "
                            f"of the context's world, over a context of the whole world (iris.create() without group=)")
        node_group, _ = ctx.new_subgroups(ranks_per_subgroup=[list(layout.node_ranks(n)) for n in range(layout.nodes)],
                                          workspace_size=workspace_size)
        cross_groups = [dist.new_group(list(layout.cross_ranks(local))) for local in range(layout.node_size)]
        cross_group = cross_groups[layout.local_rank(ctx.rank)]
        return cls(ctx, layout, node_group, cross_group)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def node(self) -> int:
        return self.layout.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.layout.local_rank(self.rank)

    # -- the collectives ------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op="sum") -> torch.Tensor:
        """Reduce ``tensor`` over the world in place (sum, avg, max, min or prod)."""
        self._check("all_reduce", tensor=tensor)
        op = self._reduction("all_reduce", tensor, op)
        flat = tensor.view(-1)
        size = self.layout.node_size
        padded = -flat.numel() % size
        work = torch.cat([flat, flat.new_zeros(padded)]) if padded else flat
        shard = work.new_empty(work.numel() // size)
        ccl = self.context.ccl
        ccl.reduce_scatter(shard, work, op="sum" if op == "avg" else op, group=self.node_group)
        dist.all_reduce(shard, op=_TORCH_OPS[op], group=self.cross_group)
        if op == "avg":
            shard.div_(self.layout.world_size)
        ccl.all_gather(work, shard, group=self.node_group)
        if padded:
            flat.copy_(work[:flat.numel()])
        return tensor

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """``output`` (world_size x input's elements) := every rank's ``input``, in world rank
        order (torch's ``all_gather_into_tensor``)."""
        self._check("all_gather", output=output, input=input)
        self._sized("all_gather", "output", output, "world_size x input", self.layout.world_size * input.numel())
        node_block = input.new_empty(self.layout.node_size * input.numel())
        self.context.ccl.all_gather(node_block, input, group=self.node_group)
        _all_gather_single(output.view(-1), node_block, group=self.cross_group)
        return output

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op="sum") -> torch.Tensor:
        """``output`` := the reduction over the world of segment ``rank`` of the ``world_size``
        equal segments of ``input`` (torch's ``reduce_scatter_tensor``)."""
        self._check("reduce_scatter", output=output, input=input)
        op = self._reduction("reduce_scatter", input, op)
        layout = self.layout
        self._sized("reduce_scatter", "input", input, "world_size x output", layout.world_size * output.numel())
        # Segment n * L + l moves to place l * N + n: the node's reduce_scatter then leaves local rank l
        # the N segments of the ranks n * L + l, in node order, as the cross reduce_scatter takes them.
        by_local_rank = input.view(layout.nodes, layout.node_size, output.numel()).transpose(0, 1).contiguous()
        shard = input.new_empty(layout.nodes * output.numel())
        self.context.ccl.reduce_scatter(shard, by_local_rank.view(-1), op="sum" if op == "avg" else op,
                                        group=self.node_group)
        _reduce_scatter_single(output.view(-1), shard, op=_TORCH_OPS[op], group=self.cross_group)
        if op == "avg":
            output.div_(layout.world_size)
        return output

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` := world rank ``src``'s, in place."""
        self._check("broadcast", tensor=tensor)
        layout = self.layout
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < layout.world_size:
            raise IrisError(f"broadcast: src={src!r} is not a world rank (0..{layout.world_size - 1})")
        local = layout.local_rank(src)
        if self.local_rank == local:
            dist.broadcast(tensor, group=self.cross_group, group_src=layout.node_of(src))
        self.context.ccl.broadcast(tensor, src=local, group=self.node_group)
        return tensor

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
        """Segment j of this rank's ``input`` goes to world rank j, which stores it as its
        segment ``rank`` (torch's ``all_to_all_single`` without split sizes)."""
        self._check("all_to_all", output=output, input=input)
        self._sized("all_to_all", "output", output, "as many as the input", input.numel())
        world = self.layout.world_size
        if input.numel() % world:
            raise IrisError(f"all_to_all: input has {input.numel()} elements, not divisible by the world size "
                            f"{world}; pad it to a multiple of {world}")
        layout, m = self.layout, input.numel() // world
        inp, out = input.view(world, m), output.view(world, m)
        mine = slice(layout.node_ranks(self.node)[0], layout.node_ranks(self.node)[-1] + 1)
        # This node's segments move on iris, each rank's straight into its peers' outputs.
        self.context.ccl.all_to_all(out[mine], inp[mine].contiguous(), group=self.node_group)
        if layout.nodes > 1:  # the other nodes' segments through torch.distributed, node segments left out
            away = [r for r in range(world) if layout.node_of(r) != self.node]
            splits = [0 if layout.node_of(r) == self.node else m for r in range(world)]
            received = torch.empty(len(away), m, dtype=output.dtype, device=output.device)
            dist.all_to_all_single(received.view(-1), inp[away].reshape(-1), splits, splits)
            out[away] = received
        return output

    # -- checks ---------------------------------------------------------------------------------

    def _check(self, collective: str, **tensors: torch.Tensor) -> None:
        device = self.context.device
        for what, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{collective}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.device != device:
                raise IrisError(f"{collective}: {what} is on {tensor.device}, but this context runs on {device}; "
                                f"move it with .to({str(device)!r})")
            if not tensor.is_contiguous():
                raise IrisError(f"{collective}: {what} is not contiguous; pass {what}.contiguous()")
        dtypes = [str(tensor.dtype) for tensor in tensors.values()]
        if len(set(dtypes)) > 1:
            raise IrisError(f"{collective}: the tensors' dtypes differ ({', '.join(dtypes)}); pass one dtype")

    def _reduction(self, collective: str, tensor: torch.Tensor, op) -> str:
        """``op`` (a name or a ``torch.distributed.ReduceOp``) as iris names it, checked to reduce
        ``tensor``."""
        op = reduce_op_name(op)
        if op == "avg" and not tensor.dtype.is_floating_point:
            raise IrisError(f"{collective}: op='avg' takes floating-point tensors, this one is {tensor.dtype}; reduce "
                            f"with op='sum' and divide the result by the world size ({self.layout.world_size})")
        return op

    @staticmethod
    def _sized(collective: str, what: str, tensor: torch.Tensor, needs: str, numel: int) -> None:
        if tensor.numel() != numel:
            raise IrisError(f"{collective}: {what} has {tensor.numel()} elements; it needs {needs} = {numel}")
