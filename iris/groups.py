"""Sub-groups of a context's ranks: collectives and fused operations over part of the world.

A :class:`Group` is an ordered set of a context's (world) ranks, made collectively over the
whole world by ``ctx.new_group(ranks)`` or ``ctx.new_subgroups(...)``, as torch.distributed's
``new_group`` / ``new_subgroups`` are. Collectives and fused operations take it as ``group=``;
inside a group, ranks are numbered by their place in it (*group ranks*), as in
torch.distributed: ``src``/``dst`` arguments are group ranks, errors name world ranks.

The heap stays the world's: group members reach each other's heaps through the world's
mapping. What a group keeps of its own are its workspaces (data slots, call counts, flags),
which must grow collectively among the group's members only. They live in a *group arena*: one
block of the world heap, allocated by every world rank when the groups are made (so the world
heap stays symmetric), inside which each group allocates symmetrically among its members.
Groups made together by one ``new_subgroups`` call are disjoint, so they share one arena: every
rank uses the arena for the one group it belongs to.

Calls with ``group=`` run on a *group view* of the context: an object of the context's own class
whose rank, world size, heap (the arena), host communicator, device context (the members'
heap bases in group order) and fault words are the group's, and which shares everything else
(configuration, fail-stop state, kernels) with the context. iris's algorithms run on it
unchanged. A failure inside a group fails the whole context.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import torch
import torch.distributed as dist

from iris.bootstrap import Communicator
from iris.errors import IrisError
from iris.heap import SymmetricHeap
from iris.heap.mapping import HeapMapping

__all__ = ["DEFAULT_ARENA_FRACTION", "Group", "GroupView", "check_partition", "namespace_for", "view_class"]

#: A group arena's size, unless given, as a fraction of the heap.
DEFAULT_ARENA_FRACTION = 8


@attrs.frozen(eq=False, repr=False)
class Group:
    """An ordered set of world ranks of one context, for ``group=`` arguments. ``rank`` is this
    process's group rank (None when it is not a member, like torch's ``GroupMember.NON_GROUP_MEMBER``)."""

    ranks: tuple[int, ...]
    """The members' world ranks, in group-rank order."""
    process_group: dist.ProcessGroup | None
    """The torch.distributed process group (gloo) over the members; None on non-members."""
    world_rank: int
    """This process's world rank."""
    view: Any = None
    """The group view of the context (members only)."""

    @property
    def rank(self) -> int | None:
        return self.ranks.index(self.world_rank) if self.world_rank in self.ranks else None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __contains__(self, world_rank: int) -> bool:
        return world_rank in self.ranks

    def __repr__(self) -> str:
        member = f"group rank {self.rank}" if self.rank is not None else "not a member"
        return f"<iris.Group of world ranks {list(self.ranks)} ({member})>"


def check_partition(groups: list[list[int]], world_size: int) -> list[tuple[int, ...]]:
    """``groups`` as tuples, checked: disjoint, non-empty, without repeats, of ranks of the world."""
    seen: dict[int, int] = {}
    checked = []
    for index, ranks in enumerate(groups):
        ranks = tuple(ranks)
        if not ranks:
            raise IrisError(f"group {index} is empty; every group needs at least one rank")
        for rank in ranks:
            if not isinstance(rank, int) or not 0 <= rank < world_size:
                raise IrisError(f"group {list(ranks)} names {rank!r}, which is not a rank of this world "
                                f"(0..{world_size - 1})")
            if rank in seen:
                where = "twice" if seen[rank] == index else f"in groups {seen[rank]} and {index}"
                raise IrisError(f"world rank {rank} appears {where}; groups made together must be disjoint "
                                f"(make overlapping groups with separate new_group calls)")
            seen[rank] = index
        checked.append(ranks)
    return checked


class GroupView:
    """Put in front of a context's class to make a group view (:func:`view_class`); built by
    :meth:`of`, never by ``iris.create``."""

    #: Attributes of the context that a view computes for itself rather than sharing.
    OWN = frozenset({"rank", "world_size", "comm", "heap", "_device_context", "_heap_bases", "workspaces",
                     "_torch_ccl", "ccl", "ops", "_namespaces"})

    @classmethod
    def of(cls, context, ranks: tuple[int, ...], comm: Communicator, arena: torch.Tensor) -> "GroupView":
        """The view of ``context`` for the group of world ``ranks`` (this rank among them),
        over ``comm`` and allocating its workspaces in ``arena`` (a heap tensor of the world)."""
        view = object.__new__(view_class(type(context)))
        view.__dict__.update({k: v for k, v in context.__dict__.items() if k not in cls.OWN})
        view._world = context
        view._group_ranks = ranks
        view.rank, view.world_size, view.comm = comm.rank, comm.world_size, comm
        start = arena.data_ptr() - context.heap.local.data_ptr()
        peers = tuple(context.heap.mapping.peers[r][start:start + arena.numel()] for r in ranks)
        view.heap = SymmetricHeap(HeapMapping(size=arena.numel(), peers=peers), comm, debug=context.config.debug,
                                  allocation_map=False)
        bases = context.get_heap_bases().tolist()
        view._device_context = torch.tensor([view.rank, view.world_size, *(bases[r] for r in ranks),
                                             context.heap.size, 0, 0], dtype=torch.int64, device=context.device)
        context.tracing.attach(view._device_context)
        view._heap_bases = view._device_context[2:2 + view.world_size]
        view._namespaces = {}
        view._setup_group_view()
        # The group's objects of the context's namespaces that take group= (its collectives,
        # its fused operations), made now: a first call inside torch.compile could not make them.
        for namespace in context.__dict__.values():
            if hasattr(namespace, "_for_group"):
                view.namespace(type(namespace))
        return view

    # -- what differs from the context ----------------------------------------------------------

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The world ranks of this view's group, in group-rank order."""
        return self._group_ranks

    def world_rank_of(self, rank: int) -> int:
        return self._group_ranks[rank]

    def describe_ranks(self) -> str:
        return (f"this group of world ranks {list(self._group_ranks)} (group ranks 0..{self.world_size - 1}; "
                f"src/dst arguments are group ranks)")

    def namespace(self, kind: type):
        """The one object of class ``kind`` (Collectives, FusedOps, ...) bound to this view."""
        made = self._namespaces.get(kind)
        if made is None:
            made = self._namespaces[kind] = kind(self)
        return made

    def is_symmetric(self, tensor: torch.Tensor) -> bool:
        """Tensors on the world heap are symmetric for the group too (allocated alike on every rank)."""
        return self._world.is_symmetric(tensor)

    def barrier(self) -> None:
        """Host barrier of the group's members (after this rank's queued device work), and the
        check that they allocated alike in the group's arena."""
        with self._call("barrier"):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
                self._world._raise_if_failed("barrier")  # before the host barrier, as the context's
            self.comm.barrier()
            self.heap.check_symmetric()

    # -- what the context does for the view -----------------------------------------------------

    def _call(self, name: str, outputs: tuple = ()):
        return self._world._call(name, outputs)

    @property
    def failed(self) -> bool:
        return self._world.failed

    def _summary(self) -> dict[str, Any]:
        return {"group": list(self._group_ranks), **self._world._summary()}

    def destroy(self) -> None:
        raise IrisError("a group's view of a context is not destroyed by itself; destroy the context")


@functools.cache
def view_class(cls: type) -> type:
    """The class of group views of contexts of class ``cls``."""
    return type(f"{cls.__name__}GroupView", (GroupView, cls), {"__module__": cls.__module__})


def namespace_for(namespace, group):
    """The object of ``namespace``'s class (``ctx.ccl``'s Collectives, ``ctx.ops``' FusedOps, ...)
    that runs calls with ``group=group``: ``namespace`` itself for None or the whole world."""
    view = namespace._context._view_of(group)
    return namespace if view is namespace._context else view.namespace(type(namespace))
