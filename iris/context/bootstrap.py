"""Process-group bootstrap on ``torch.distributed`` and host-side exchange between ranks.

A context uses the default process group when one exists; otherwise it initializes one from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when present,
and else a world of one held in an in-memory store (nothing listens on any port).
"""

from __future__ import annotations

import atexit
import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from iris.config import DEFAULT_TIMEOUT
from iris.errors import IrisTimeoutError

__all__ = ["default_device_type", "ensure_process_group", "Communicator", "local_rank"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Bytes of one rank's part of :meth:`Communicator.exchange_calls`: a value and a call's description.
CALL_EXCHANGE_BYTES = 1024
#: Seconds :meth:`Communicator.exchange_calls` waits for every rank before it calls its ``on_slow``.
CALL_EXCHANGE_GRACE = 0.05
#: How torch's monitored barrier names the ranks that did not arrive ("Ranks 1, 2 failed to pass").
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def default_device_type() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def process_group_backend(device_type: str) -> str:
    """gloo for CPU ranks; on GPUs nccl for device tensors and gloo for host objects."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def local_rank() -> int:
    """This process's index among the ranks of its node."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def ensure_process_group(device_type: str, timeout: float) -> None:
    """Initialize the default process group unless the caller already did: from torchrun's
    environment (which ``iris.spawn`` and ``iris run`` also set), else a world of one."""
    if dist.is_initialized():
        return
    backend = process_group_backend(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    if all(v in os.environ for v in _TORCHRUN_VARS):
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
        # gloo connects every pair of ranks inside init_process_group, and a rank can return from it
        # before its peers have finished connecting: one that then leaves at once (a short job) closes
        # a connection a peer is still completing, and that peer's init fails. Every rank waits here
        # until all are connected (a one-element all_reduce on the gloo part of the group).
        dist.all_reduce(torch.zeros(1))
    else:
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout)
        )
    if backend == "gloo":
        # A gloo group left alive at interpreter exit can abort the process while its threads are
        # torn down ("terminate called without an active exception"): the group iris made, iris
        # destroys. Not NCCL's: destroying it waits for peers, which may be gone.
        atexit.register(_destroy_process_group, dist.group.WORLD)


def _destroy_process_group(group: dist.ProcessGroup) -> None:
    """Destroy the default group at exit if it is still ``group`` (the user may have replaced it)."""
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


class Communicator:
    """Host-side collectives over one process group (the default unless given), numbering ranks
    within it. Collective to construct (over the group's members): on GPU ranks it makes a gloo
    group beside the given one, for the barrier."""

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = timeout
        # The barrier is torch's monitored barrier, which names the ranks that did not arrive;
        # it runs over gloo only. A sub-group's is made by its members alone.
        if dist.get_backend(group) == "gloo":
            self._barrier_group = group
        elif group is None:
            self._barrier_group = dist.new_group(backend="gloo")
        else:
            self._barrier_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                                 use_local_synchronization=True)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it."""
        holder = [obj]
        dist.broadcast_object_list(holder, group=self.group, group_src=src)
        return holder[0]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` with rank ``src``'s values, in place."""
        dist.broadcast(tensor, group=self.group, group_src=src)
        return tensor

    def host_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's ``values`` (int64), over the host group
        (gloo on every device, as for the barrier): one small exchange, bounded by the timeout
        (IrisTimeoutError when a peer does not take part in time or is gone)."""
        extremes = torch.tensor(values, dtype=torch.int64)
        try:
            work = dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self._barrier_group, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise self._exchange_failed(error) from error
        return extremes.tolist()

    def exchange_calls(self, value: int, description: str, on_slow: Callable[[], None] | None = None,
                       grace: float = CALL_EXCHANGE_GRACE) -> list[tuple[int, str]]:
        """Every rank's ``(value, description)``, in rank order: one all-gather of
        :data:`CALL_EXCHANGE_BYTES` per rank (an int64 and the description in UTF-8, cut to fit)
        over the host group, bounded by the timeout (IrisTimeoutError when a peer does not take
        part in time or is gone). ``on_slow`` is called once when not every rank took part within
        ``grace`` seconds; the exchange goes on."""
        mine = torch.zeros(CALL_EXCHANGE_BYTES, dtype=torch.uint8)
        mine[:8] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)
        text = description.encode()[:CALL_EXCHANGE_BYTES - 8]
        if text:
            mine[8:8 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            work = dist.all_gather(everyone, mine, group=self._barrier_group, async_op=True)
            if on_slow is not None:
                deadline = time.monotonic() + grace
                while not work.is_completed() and time.monotonic() < deadline:
                    time.sleep(0.001)
                if not work.is_completed():
                    on_slow()
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as error:
            raise self._exchange_failed(error) from error
        return [(int(part[:8].view(torch.int64)), bytes(part[8:].tolist()).rstrip(b"\0").decode(errors="replace"))
                for part in everyone]

    def _exchange_failed(self, error: RuntimeError) -> IrisTimeoutError:
        """What a host exchange that not every rank took part in within the timeout raises."""
        return IrisTimeoutError(
            f"host exchange on rank {self.rank}: not every rank took part within {self.timeout:g} s "
            f"({str(error).splitlines()[0][:200]}). Check that every rank is alive and makes the same iris "
            f"calls, or raise the timeout with create(timeout=...) / IRIS_TIMEOUT")

    def barrier(self) -> None:
        """Wait until every rank arrives (host side); IrisTimeoutError naming the ranks that did
        not arrive within the timeout (rank 0 knows them; the others learn that it failed)."""
        try:
            dist.monitored_barrier(group=self._barrier_group, timeout=timedelta(seconds=self.timeout),
                                   wait_all_ranks=True)
        except RuntimeError as error:
            found = _MISSING_RANKS.search(str(error))
            what = (f"rank(s) {[int(r) for r in found.group(1).split(',')]} did not arrive within {self.timeout:g} s"
                    if found else f"it did not complete within {self.timeout:g} s ({str(error).splitlines()[0][:200]})")
            raise IrisTimeoutError(
                f"host barrier on rank {self.rank}: {what}. Check that every rank is alive and reaches the same "
                f"barriers, or raise the timeout with create(timeout=...) / IRIS_TIMEOUT"
            ) from error
