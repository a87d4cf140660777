"""NodesMixin: the machines ("nodes") a context's world spans, and the node-local heap.

Remote loads and stores reach only memory mapped into the caller's process, which peer access
gives within one machine. So when the world spans nodes (:func:`iris.collectives.hierarchical.layout_for`:
``create(node_size=...)``, ``IRIS_LOCAL_WORLD_SIZE``, torchrun's ``LOCAL_WORLD_SIZE`` or the host
names), each rank's heap is shared with the ranks of its node only: the heap provider runs over
the node's ranks, and a rank on another node has no mapping (its heap base is 0). The world's
collectives then run hierarchically (:class:`iris.collectives.hierarchical.Hierarchy`, made once the context
is complete, :meth:`_join_nodes`); everything else that would reach another node's heap from the
world's context is refused on the host, naming the node group to use instead.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from iris.context.bootstrap import Communicator
from iris.errors import IrisError
from iris.heap.mapping import HeapMapping
from iris.collectives.hierarchical import Hierarchy, NodeLayout, layout_for

__all__ = ["NodesMixin"]


class NodesHost(Protocol):
    """What NodesMixin needs from the context it is part of (checked when a context is made)."""

    comm: Any
    config: Any
    world_size: int


class NodesMixin:
    """Adds ``node_layout`` (:class:`iris.collectives.hierarchical.NodeLayout`), ``node_comm`` (the host
    communicator of this rank's node, which the heap is made over) and, once the context is
    complete, ``hierarchy``, ``node_group`` and ``cross_group`` (None while the world is one
    node). Runs its set-up before the heap's."""

    needs = NodesHost

    node_layout: NodeLayout
    hierarchy: Hierarchy | None = None

    def _setup(self) -> None:
        super()._setup()
        self.node_layout = layout_for(self, self.config.node_size)
        self.node_comm = self.comm
        if self.node_layout.nodes > 1:  # made by its members only
            node = dist.new_group(list(self.node_layout.node_ranks(self.node_layout.node_of(self.rank))),
                                  use_local_synchronization=True)
            self.node_comm = Communicator(node, timeout=self.config.timeout)

    def _node_local_mapping(self, mapping: HeapMapping) -> HeapMapping:
        """The world's mapping of a heap made over ``node_comm``: this node's ranks' heaps in
        their world places, an empty tensor (base 0: not addressable) for every other rank."""
        if self.node_layout.nodes == 1:
            return mapping
        first = self.node_layout.node_ranks(self.node_layout.node_of(self.rank))[0]
        absent = torch.empty(0, dtype=torch.uint8, device=mapping.peers[0].device)
        peers = tuple(mapping.peers[r - first] if self.node_layout.node_of(r) == self.node_layout.node_of(self.rank)
                      else absent for r in range(self.world_size))
        return HeapMapping(size=mapping.size, peers=peers, importer=mapping.importer)

    def _join_nodes(self) -> None:
        """Make the hierarchy of a world that spans nodes (collective; the context is complete)."""
        if self.node_layout.nodes > 1:
            self.hierarchy = Hierarchy.of(self, self.node_layout)

    @property
    def node_group(self):
        """This rank's node as an iris group (``group=ctx.node_group``), or None on one node."""
        return None if self.hierarchy is None else self.hierarchy.node_group

    @property
    def cross_group(self) -> dist.ProcessGroup | None:
        """The torch.distributed group of the ranks with this rank's place in every node (the
        data-parallel group of a layer parallel inside each node), or None on one node."""
        return None if self.hierarchy is None else self.hierarchy.cross_group

    def _spans_nodes(self) -> bool:
        """Whether this is the context of a world that spans nodes (not a group view in it)."""
        return self.node_layout.nodes > 1 and getattr(self, "_world", None) is None

    def _refuse_across_nodes(self, what: str) -> None:
        """Raise if ``what`` would reach another node's heap: a call of the world's context (not
        of a group view) when the world spans nodes."""
        if self._spans_nodes():
            layout = self.node_layout
            raise IrisError(f"{what}: this context's world spans {layout.nodes} nodes of {layout.node_size} ranks, "
                            f"and a rank reaches only its own node's heaps; call it on the node "
                            f"(group=ctx.node_group), or use a world collective (all_reduce, all_gather, "
                            f"reduce_scatter, broadcast, all_to_all), which runs across nodes")
