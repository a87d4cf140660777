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

Calls with ``group=`` run on a *group view* of the context (:class:`GroupView`): an object of the
context's own class whose rank, world size, heap (the arena), host communicator, device context
(the members' heap bases in group order), workspaces and fault words are the group's, and which
reads everything else (configuration, fail-stop state, kernels) from the context. iris's
algorithms run on it unchanged. A failure inside a group fails the whole context.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import attrs
import torch
import torch.distributed as dist

from iris.context.bootstrap import Communicator
from iris.errors import IrisError, format_bytes
from iris.heap import SymmetricHeap
from iris.heap.device_context import make_device_context
from iris.heap.mapping import HeapMapping

__all__ = ["DEFAULT_ARENA_FRACTION", "Group", "GroupView", "GroupsMixin", "check_partition", "namespace_for",
           "view_class"]

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
    """Put in front of a context's class to make a group view (:func:`view_class`); made by
    :meth:`of`, never by ``iris.create``.

    A view owns what makes it the group's: its rank, world size and host communicator, its heap
    (the group's arena of the world heap), its device context (the members' heap bases in group
    order), its workspaces and the backend's per-group state (fault words, barrier state:
    ``_setup_group_view``), and its namespaces (``ccl``, ``ops``). It holds references to the
    context's facts that every call reads (:attr:`SHARED`), and reads everything else (fail-stop
    state, say) from the context at each access (:meth:`__getattr__`), so it never holds a stale
    copy of the context's state."""

    #: The context's attributes a view refers to as its own: each is set once, when the context is
    #: made, and never rebound, so the reference stays the context's; every call reads some of them.
    #: (The tuned choices are not among them: tuning (``ctx.ccl.tune``, ...) puts a new table in force.)
    SHARED = ("config", "backend_spec", "device", "kernel_device_type", "programs", "timeout_ns", "tracing",
              "node_layout", "logger")

    @classmethod
    def of(cls, context, ranks: tuple[int, ...], comm: Communicator, arena: torch.Tensor) -> "GroupView":
        """The view of ``context`` for the group of world ``ranks`` (this rank among them),
        over ``comm`` and allocating its workspaces in ``arena`` (a heap tensor of the world)."""
        view = object.__new__(view_class(type(context)))
        view._world = context
        view._group_ranks = ranks
        view.__dict__.update({name: getattr(context, name) for name in cls.SHARED})
        view.rank, view.world_size, view.comm = comm.rank, comm.world_size, comm
        start = arena.data_ptr() - context.heap.local.data_ptr()
        peers = tuple(context.heap.mapping.peers[r][start:start + arena.numel()] for r in ranks)
        view.heap = SymmetricHeap(HeapMapping(size=arena.numel(), peers=peers), comm, debug=context.config.debug,
                                  allocation_map=False)
        bases = context.get_heap_bases().tolist()
        view._device_context = make_device_context(view.rank, view.world_size, [bases[r] for r in ranks],
                                                   context.heap.size, context.device)
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

    def __getattr__(self, name: str):
        """What the view does not own: its world context's (called only where the view has no
        attribute ``name`` of its own)."""
        world = self.__dict__.get("_world")
        if world is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(world, name)

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

    def _describe_call(self, name: str, signature: int, description: str) -> tuple | None:
        return self._world._describe_call(name, signature, description)

    def _end_call(self, outer: tuple | None) -> None:
        self._world._end_call(outer)

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


class GroupsHost(Protocol):
    """What GroupsMixin needs from the context it is part of (checked when a context is made)."""

    comm: Any
    rank: int
    world_size: int
    heap_size: int
    empty: Callable
    barrier: Callable[[], None]


class GroupsMixin:
    """Adds ``new_group(ranks)``, ``new_subgroups(...)`` and, for the namespaces that take
    ``group=``, ``_view_of(group)``."""

    needs = GroupsHost

    def _setup(self) -> None:
        super()._setup()
        #: The groups made on this context, by the torch process group they were made from or
        #: over (so ``group=`` also takes those).
        self._groups_by_process_group: dict[dist.ProcessGroup, Group] = {}

    def new_group(self, ranks=None, *, workspace_size: int | None = None) -> Group:
        """A group of the world ranks ``ranks`` (a list in group-rank order, or a
        torch.distributed process group whose ranks are taken; None: every rank), for
        ``group=`` arguments. Collective over the whole world, as ``torch.distributed.new_group``:
        every rank calls it, members or not, with the same ranks (or what the same
        ``dist.new_group`` call returned it: non-members pass its non-member value). ``workspace_size``: bytes of
        heap for the group's workspaces (default a eighth of the heap), taken on every rank."""
        made_from = ranks if isinstance(ranks, dist.ProcessGroup) else None
        if made_from is not None or ranks is dist.GroupMember.NON_GROUP_MEMBER:
            # What dist.new_group returned: its non-members do not know its ranks; its members tell.
            known = self.comm.all_gather_object(None if made_from is None else
                                                dist.get_process_group_ranks(made_from))
            members = {tuple(k) for k in known if k is not None}
            if len(members) != 1:
                raise IrisError(f"new_group: the ranks passed different process groups ({sorted(members)}); every "
                                f"rank passes what the same dist.new_group(...) call returned it")
            ranks = list(members.pop())
        elif ranks is None:
            ranks = list(range(self.world_size))
        if isinstance(ranks, int) or not all(isinstance(r, int) for r in ranks):
            raise IrisError(f"new_group: ranks must be a list of world ranks or a torch.distributed process group, "
                            f"got {ranks!r}")
        groups = self._make_groups([list(ranks)], workspace_size, "new_group")
        if made_from is not None:
            self._groups_by_process_group[made_from] = groups[0]
        return groups[0]

    def new_subgroups(self, group_size: int | None = None, *, ranks_per_subgroup: list[list[int]] | None = None,
                      workspace_size: int | None = None) -> tuple[Group, list[Group]]:
        """Disjoint groups covering the world, as ``torch.distributed.new_subgroups``: of
        ``group_size`` consecutive ranks each, or the ``ranks_per_subgroup`` lists (e.g. strided
        tensor-parallel groups ``[[0, 2], [1, 3]]``). Returns (this rank's group, every group).
        They share one arena of ``workspace_size`` bytes per rank. Collective over the world."""
        if (group_size is None) == (ranks_per_subgroup is None):
            raise IrisError("new_subgroups: pass either group_size or ranks_per_subgroup")
        if ranks_per_subgroup is None:
            if not isinstance(group_size, int) or group_size < 1 or self.world_size % group_size:
                raise IrisError(f"new_subgroups: group_size={group_size!r} must be a positive divisor of the world "
                                f"size {self.world_size}")
            ranks_per_subgroup = [list(range(start, start + group_size))
                                  for start in range(0, self.world_size, group_size)]
        groups = self._make_groups(ranks_per_subgroup, workspace_size, "new_subgroups")
        mine = [g for g in groups if self.rank in g]
        if not mine:
            raise IrisError(f"new_subgroups: world rank {self.rank} is in none of {ranks_per_subgroup}; subgroups "
                            f"must cover every rank (use new_group for a group of some ranks)")
        return mine[0], groups

    def _make_groups(self, ranks_per_group: list[list[int]], workspace_size: int | None, what: str) -> list[Group]:
        """Disjoint groups over one arena: made alike on every rank (the same calls in the same
        order), checked to be the same on every rank."""
        partition = check_partition(ranks_per_group, self.world_size)
        everyone = self.comm.all_gather_object((partition, workspace_size))
        if any(other != everyone[0] for other in everyone):
            listing = "; ".join(f"rank {r}: {p}, workspace_size={w}" for r, (p, w) in enumerate(everyone))
            raise IrisError(f"{what}: the ranks asked for different groups ({listing}); every rank of the world "
                            f"must make the same groups in the same order")
        layout = self.node_layout
        across = [ranks for ranks in ranks_per_group if len({layout.node_of(r) for r in ranks}) > 1]
        if across:
            raise IrisError(f"{what}: group {across[0]} spans nodes ({layout.nodes} nodes of {layout.node_size} "
                            f"ranks), and a rank reaches only its own node's heaps; make groups inside a node, and "
                            f"go across nodes with torch.distributed (ctx.cross_group) or the world collectives")
        size = workspace_size if workspace_size is not None else self.heap_size // DEFAULT_ARENA_FRACTION
        if not isinstance(size, int) or size <= 0:
            raise IrisError(f"{what}: workspace_size must be a positive number of bytes, got {workspace_size!r}")
        arena = self.empty(size, dtype=torch.uint8)
        self.barrier()  # the arena exists on every rank before a member writes into a peer's
        groups = []
        for ranks in partition:
            # Every world rank takes part in making each torch process group, as torch asks.
            process_group = dist.new_group(list(ranks), backend="gloo")
            member = self.rank in ranks
            view = None
            if member:
                comm = Communicator(process_group, timeout=self.comm.timeout)
                view = GroupView.of(self, ranks, comm, arena)
            groups.append(Group(ranks, process_group if member else None, self.rank, view))
            if member:
                self._groups_by_process_group[process_group] = groups[-1]
        self.debug(f"{what}: groups {[list(g.ranks) for g in groups]}, {format_bytes(size)} of workspace each")
        return groups

    def _view_of(self, group):
        """The context (``group`` None or the whole world) or the group view that a call with
        ``group=group`` runs on; IrisError when this rank is not a member or the group is not
        one of this context's."""
        if group is None or group is dist.group.WORLD:
            return self
        if isinstance(self, GroupView):
            raise IrisError("group=: this call already runs on a group; pass group= to the context's own "
                            "ctx.ccl / ctx.ops")
        if isinstance(group, dist.ProcessGroup):
            found = self._groups_by_process_group.get(group)
            if found is None:
                raise IrisError(f"group=: the process group of world ranks {dist.get_process_group_ranks(group)} "
                                f"is not known to this context; make an iris group from it once, on every rank: "
                                f"group = ctx.new_group(process_group)")
            group = found
        if not isinstance(group, Group):
            raise TypeError(f"group= must be an iris.Group (ctx.new_group / ctx.new_subgroups), a torch process group "
                            f"made into one, or None, got {type(group).__name__}")
        if group.view is None:
            raise IrisError(f"group=: world rank {self.rank} is not a member of the group of world ranks "
                            f"{list(group.ranks)}; only its members call collectives on it")
        if group.view._world is not self:
            raise IrisError(f"group=: the group of world ranks {list(group.ranks)} belongs to another context")
        return group.view
