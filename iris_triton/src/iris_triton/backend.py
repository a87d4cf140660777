"""The Triton backend's registration and host side."""

from __future__ import annotations

import os
import time
from functools import cached_property

import torch

from iris.backend import Backend, DeviceOps
from iris.errors import IrisError, IrisTimeoutError
from iris_triton.frontend import TRITON
from iris_triton.waits import site_name

__all__ = ["TritonBackend", "TritonDeviceOps"]

#: Flag reads timed at set-up to measure how fast a wait spins here (a GPU reads a flag in about
#: a microsecond; the interpreter is thousands of times slower, more so on a loaded machine).
SPIN_PROBE_READS = {"cuda": 20_000, "cpu": 150}
#: Fewest reads a wait may make, whatever the measurement.
MIN_SPINS = 1000


class TritonDeviceOps(DeviceOps):
    """Host side of the Triton backend: ``device_barrier()``, the fused operations ``ops``, and the
    timeout check that ``barrier()`` adds. On CPU ranks, kernels run in Triton's interpreter.

    Requires ``device``, ``config``, ``rank``, ``world_size``, ``zeros`` and ``get_heap_bases``.
    """

    #: The language this backend compiles iris's kernels in.
    frontend = TRITON

    @classmethod
    def check_environment(cls, device: torch.device) -> None:
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise IrisError(
                "CPU ranks run Triton kernels in Triton's interpreter, which needs TRITON_INTERPRET=1 "
                "set before Triton is imported; launch with iris.spawn(...) or `iris run`, or export "
                "TRITON_INTERPRET=1"
            )

    def _setup(self) -> None:
        super()._setup()
        from iris_triton.barrier import state_words

        self._barrier_state = self.zeros(state_words(self.world_size), dtype=torch.int32)
        #: Flag reads a device-side wait makes before it gives up: the context's timeout at the
        #: spin rate measured here. The ranks measure one after another (no rank competes with
        #: another for the CPU of the interpreter) and the fastest rate counts, so that no wait
        #: gives up before the timeout.
        flag = self.zeros(1, dtype=torch.int32)  # collective, as every heap allocation
        rate = 0.0
        for turn in range(self.world_size):
            if turn == self.rank:
                rate = self._spins_per_second(flag)
            self.comm.barrier()
        self.free(flag)
        self.max_spins = max(MIN_SPINS, int(self.config.timeout * max(self.comm.all_gather_object(rate))))

    def _spins_per_second(self, flag: torch.Tensor) -> float:
        """Reads per second of a wait on ``flag`` (a heap word that stays 0)."""
        from iris_triton.waits import spin_probe_kernel

        reads = SPIN_PROBE_READS[self.device.type]
        warm_up = max(2, reads // 8)
        spin_probe_kernel[(1,)](flag, self.get_heap_bases(), self.rank, warm_up, num_warps=1)  # compiled, warm
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        spin_probe_kernel[(1,)](flag, self.get_heap_bases(), self.rank, reads, num_warps=1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return reads / (time.perf_counter() - start)

    @cached_property
    def ops(self):
        """Matrix products fused with their communication (:class:`iris_triton.ops.FusedOps`)."""
        from iris_triton.ops import FusedOps

        return FusedOps(self)

    @property
    def wait_failures(self) -> torch.Tensor:
        """int32 per peer: the code (:mod:`iris_triton.waits`) of the operation whose device-side
        wait last gave up on that peer, 0 if none; ``barrier()`` reports and clears it."""
        return self._barrier_state[self.world_size : 2 * self.world_size]

    def device_barrier(self) -> None:
        """Device-side barrier: returns at once on the host; kernels queued after it on this
        rank's stream start only once every rank has reached its own ``device_barrier``.
        Writes made before it (at system scope) are visible to every rank after it. It can be
        captured in a CUDA graph. A peer that does not arrive within the context's timeout is
        recorded, and the next ``barrier()`` raises IrisTimeoutError naming it. Collective."""
        from iris_triton.barrier import device_barrier_kernel

        device_barrier_kernel[(1,)](
            self._barrier_state, self.get_heap_bases(), self.rank, self.world_size, self.max_spins, num_warps=1
        )

    def barrier(self) -> None:
        """Host barrier, then IrisTimeoutError if a device-side wait of this rank gave up on a
        peer since the last barrier (naming the operation and the peers). When the host barrier
        itself fails (a peer is gone), that report is raised in its place if there is one."""
        try:
            super().barrier()
        except IrisTimeoutError as host_error:
            report = self._wait_failure_report()
            if report:
                raise IrisTimeoutError(report) from host_error
            raise
        if self.ccl.has_workspaces_to_refill:
            self._refill_if_any_wait_gave_up()
        report = self._wait_failure_report()
        if report:
            raise IrisTimeoutError(report)

    def _refill_if_any_wait_gave_up(self) -> None:
        """After the host barrier (every rank's device work done): if any rank's wait gave up,
        every rank refills the workspaces that ask for it, before any rank goes on. Every rank
        reads every rank's failure words, then meets the others before anyone clears its own."""
        gave_up = any(self.heap.peer_view(self.wait_failures, q).any().item() for q in range(self.world_size))
        super().barrier()
        if gave_up:
            self.ccl.refill_after_timeout()
            super().barrier()  # no peer pushes into a workspace still being refilled

    def _wait_failure_report(self) -> str:
        """What ``wait_failures`` records (then cleared), as a message; empty when nothing."""
        codes = self.wait_failures.tolist()
        if not any(codes):
            return ""
        self.wait_failures.zero_()
        by_operation: dict[str, list[int]] = {}
        for peer, code in enumerate(codes):
            if code:
                by_operation.setdefault(site_name(code), []).append(peer)
        what = "; ".join(f"{name} waiting for rank(s) {peers}" for name, peers in by_operation.items())
        return (f"on rank {self.rank}, a device-side wait timed out after {self.config.timeout:g} s: {what}. Check "
                f"that every rank is alive and calls the same collectives and device_barrier() equally often, or "
                f"raise the timeout with create(timeout=...) / IRIS_TIMEOUT")


TritonBackend = Backend(name="triton", device_ops=TritonDeviceOps, device_types={"cuda", "cpu"})
