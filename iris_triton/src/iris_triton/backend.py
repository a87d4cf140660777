"""The Triton backend's registration and host side."""

from __future__ import annotations

import os
from functools import cached_property

import torch

from iris.backend import Backend, DeviceOps
from iris.errors import IrisError, IrisTimeoutError
from iris_triton.frontend import TRITON

__all__ = ["TritonBackend", "TritonDeviceOps"]

#: Rough flag reads per second of a spinning wait: an acquire read at system scope over NVLink
#: takes about a microsecond; the interpreter is far slower. Turns ``timeout`` into a spin bound.
SPINS_PER_SECOND = {"cuda": 1_000_000, "cpu": 5_000}


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
        self.max_spins = int(self.config.timeout * SPINS_PER_SECOND[self.device.type])

    @cached_property
    def ops(self):
        """Matrix products fused with their communication (:class:`iris_triton.ops.FusedOps`)."""
        from iris_triton.ops import FusedOps

        return FusedOps(self)

    @property
    def wait_failures(self) -> torch.Tensor:
        """int32 per peer, set by any device-side wait of this rank (the device barrier, the
        collectives) that gave up on that peer; ``barrier()`` reports and clears it."""
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
        super().barrier()
        missing = self.wait_failures.nonzero().flatten().tolist()
        if missing:
            self.wait_failures.zero_()
            raise IrisTimeoutError(
                f"a device-side wait (device_barrier or a collective) on rank {self.rank} timed out after "
                f"{self.config.timeout:g} s waiting for rank(s) {missing}; check that every rank calls "
                f"device_barrier() and the same collectives equally often, or raise the timeout with "
                f"create(timeout=...) / IRIS_TIMEOUT"
            )


TritonBackend = Backend(name="triton", device_ops=TritonDeviceOps, device_types={"cuda", "cpu"})
