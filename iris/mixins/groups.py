"""GroupsMixin: sub-groups of a context's ranks (:mod:`iris.groups`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from iris.bootstrap import Communicator
from iris.errors import IrisError, format_bytes
from iris.groups import DEFAULT_ARENA_FRACTION, Group, GroupView, check_partition

__all__ = ["GroupsMixin"]


class GroupsMixin:
    """Adds ``new_group(ranks)``, ``new_subgroups(...)`` and, for the namespaces that take
    ``group=``, ``_view_of(group)``. Requires ``comm``, ``rank``, ``world_size``, ``heap_size``,
    ``empty`` and ``barrier``."""

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
