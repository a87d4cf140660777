"""The Triton backend's registration and host side."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from functools import cached_property

import torch

from iris.backend import Backend, DeviceOps
from iris.context import Context
from iris.errors import IrisError
from iris.heap.device_context import set_trailer
from iris_triton.device.frontend import TRITON
from iris_triton.collectives.p2p import PeerRegions
from iris_triton.tuning import COMPILE_ONLY_PROGRAMS, CPU_PROGRAMS
from iris_triton.protocol.waits import ARGUMENT_FAILURES, LOCAL_FAILURES, MISMATCHES, describe_failure, fault_words

__all__ = ["TritonBackend", "TritonContext", "TritonDeviceOps", "interpreter_runs_kernel_loops"]


def interpreter_runs_kernel_loops() -> bool:
    """Whether Triton's interpreter can run loops with runtime bounds here: Triton 3.6's fails
    under numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars")."""
    import numpy
    from packaging.version import Version

    triton_version = Version(importlib.metadata.version("triton"))
    return triton_version >= Version("3.9") or Version(numpy.__version__) < Version("2.4")


class _MappedHostMemory:
    """Pinned host memory seen as CUDA memory (``__cuda_array_interface__``): kernels write it,
    the host reads it without a synchronisation. Keeps the pinned tensor alive."""

    def __init__(self, pinned: torch.Tensor):
        self.pinned = pinned

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": tuple(self.pinned.shape), "typestr": "<i4", "data": (self.pinned.data_ptr(), False),
                "version": 3}


class TritonDeviceOps(DeviceOps):
    """Host side of the Triton backend: ``device_barrier()``, the fused operations ``ops``, the
    collectives' protocol state (``programs``, :meth:`collective_sync`), and the fault words its
    kernels record give-ups in (:mod:`iris_triton.protocol.waits`). On CPU ranks, kernels run in Triton's
    interpreter. Uses what the core provides to a backend (:mod:`iris.backend`).
    """

    #: The front end this backend compiles iris's kernel sources with (:mod:`iris_triton.device.frontend`).
    frontend = TRITON
    kernel_language = TRITON.name

    @classmethod
    def check_environment(cls, device: torch.device) -> None:
        from iris_triton.device.compiled import INTERPRETING

        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise IrisError(
                "CPU ranks run Triton kernels in Triton's interpreter, which needs TRITON_INTERPRET=1 "
                "set before Triton is imported; launch with iris.spawn(...) or `iris run`, or export "
                "TRITON_INTERPRET=1"
            )
        if device.type == "cpu" and not INTERPRETING:
            raise IrisError(
                "CPU ranks run Triton kernels in Triton's interpreter, but this process imported Triton "
                "before TRITON_INTERPRET=1 was set, so its kernels would be compiled for a GPU; set it before "
                "anything imports Triton or iris_triton (or create the CPU context in ranks started by "
                "iris.spawn(...) or `iris run`)"
            )

    @classmethod
    def accept_upstream_launch_options(cls, device: torch.device) -> None:
        if device.type == "cuda":
            from iris_triton.device.launch_options import accept_amd_launch_options

            accept_amd_launch_options()

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        if device_type == "cpu" and not interpreter_runs_kernel_loops():
            return "this Triton's interpreter cannot run runtime-bounded loops with this numpy; pin numpy<2.4"
        return None

    @classmethod
    def rank_environment(cls, device_type: str) -> Mapping[str, str]:
        return {"TRITON_INTERPRET": "1"} if device_type == "cpu" else {}

    def _setup(self) -> None:
        super()._setup()
        #: Nanoseconds a device-side wait may last (wall-clock) before it gives up.
        self.timeout_ns = int(self.config.timeout * 1e9)
        #: Every set of fault words this context's kernels record in, with the world ranks of
        #: their peers and the host communicator over them: the context's own, then its groups'
        #: (:meth:`_setup_group_view`).
        self._fault_word_sets: list[tuple] = []
        #: The flag words of every tile sync made (``tile_sync``), kept while the context lives.
        self._tile_flags: list[torch.Tensor] = []
        self._setup_peer_state(tuple(range(self.world_size)))
        #: Most programs (thread blocks) of a collective kernel; the sync words hold this many
        #: programs' counters and flags. Program ``p`` of a rank synchronises only with program
        #: ``p`` of its peers; a small call launches fewer.
        self.programs = (self.get_cu_count() if self.device.type == "cuda" else
                         CPU_PROGRAMS if self.kernel_device_type == "cpu" else COMPILE_ONLY_PROGRAMS)

    def tile_sync(self, num_tiles: int) -> torch.Tensor:
        """The synchronisation state of the tile collectives (:mod:`iris_triton.tiles.collectives`,
        ``iris_triton.tiles``) for tile numbers ``[0, num_tiles)``: a small int64 tensor to pass to the kernel
        and on to the collectives as ``sync``. It counts calls per tile on the device, so one
        sync serves every launch of a kernel, CUDA-graph replays included; kernels that may run at
        the same time need one each. Collective (it allocates on the heap)."""
        from iris_triton.tiles.collectives import allocate_tile_sync

        self._refuse_across_nodes("tile_sync")
        with self._call("tile_sync"):
            return allocate_tile_sync(self, num_tiles)

    def _setup_peer_state(self, peers: tuple[int, ...]) -> None:
        """What this context's (or group view's) kernels keep per peer, for kernels numbering
        ``peers`` (world ranks) by their place in it: the fault words (kept where
        :meth:`_recorded_failure` reads them), the device barrier's state and the fixed per-peer
        regions of send/recv (:mod:`iris_triton.collectives.p2p`: a pair cannot grow the symmetric heap, so
        every rank allocates them here). Heap state goes on this context's heap (a group view's
        arena)."""
        from iris_triton.protocol.barrier import state_words

        # First failure, one per peer, trap on failure, the headers of a different call (iris_triton.protocol.waits).
        words = fault_words(len(peers))
        #: The fault words kernels record give-ups in, on the device (:mod:`iris_triton.protocol.waits`).
        self.faults = torch.zeros(words, dtype=torch.int32, device=self.device)
        self.faults[1 + len(peers)] = int(self.config.on_timeout == "trap")
        if self.device.type == "cuda":
            pinned = torch.zeros(words, dtype=torch.int32, pin_memory=True)
            #: Their copy the host reads without a synchronisation.
            self.host_faults = torch.as_tensor(_MappedHostMemory(pinned), device=self.device)
            host_words = pinned.numpy()
        else:
            self.host_faults = self.faults
            host_words = self.faults.numpy()
        # A memoryview reads a word as a Python int, the cheapest read for the check every call makes.
        self._fault_word_sets.append((memoryview(host_words), peers, self.comm))
        # Where kernels find them, and the timeout: the device context's trailer (iris_triton.device.failstop).
        set_trailer(self._device_context, timeout_ns=self.timeout_ns, faults=self.faults.data_ptr(),
                    host_faults=self.host_faults.data_ptr())
        self._barrier_state = self.zeros(state_words(self.world_size), dtype=torch.int32)
        self.p2p_regions = PeerRegions.allocate(self)

    def _setup_group_view(self) -> None:
        super()._setup_group_view()
        self._setup_peer_state(self.group_ranks)  # the fault-word list is the context's: it reads the group's too

    def collective_sync(self) -> torch.Tensor:
        """The collectives' int32 sync words on the heap (a workspace): per program, its call count
        and its signal count, then one flag per program and peer (written by that peer), then two
        rows (by call parity) of one header per peer, where that peer announces its call (its number
        and signature), then one announcement per peer, of a call waiting on the host
        (:mod:`iris_triton.protocol.calls`). Zeroed once, never reset."""
        words = self.programs * (2 + self.world_size) + 3 * self.world_size
        return self.workspaces.get("collective_sync", 4 * words, fill=0).view(torch.int32)

    def _recorded_failure(self) -> str | None:
        """A give-up recorded by this rank's kernels, as a message (None when there is none)."""
        for host_words, _, _ in self._fault_word_sets:
            if host_words[0]:
                return self._describe_recorded_failure()
        return None

    def _describe_recorded_failure(self) -> str | None:
        """:meth:`_recorded_failure`'s message, once a first word is set."""
        by_failure: dict[tuple[str, str], list[int]] = {}
        for host_words, peers, _ in self._fault_word_sets:
            if host_words[0]:
                for peer, code in zip(peers, host_words[1:1 + len(peers)].tolist()):
                    if code:
                        by_failure.setdefault(describe_failure(code), []).append(peer)
        if not by_failure:
            return None
        what = "; ".join(
            f"{operation} gave up after {self.config.timeout:g} s waiting for world rank(s) {peers}"
            if kind == "timeout"
            else f"{operation} gave up after {self.config.timeout:g} s {LOCAL_FAILURES[kind]}"
            if kind in LOCAL_FAILURES
            else f"{operation}: world rank(s) {peers} {ARGUMENT_FAILURES[kind]}" if kind in ARGUMENT_FAILURES
            else f"{operation}: world rank(s) {peers} "
                 f"{MISMATCHES.get(operation, 'made a different call (another collective, size, dtype, op or root)')}"
            for (operation, kind), peers in by_failure.items())
        if all(kind in ARGUMENT_FAILURES for _, kind in by_failure):  # the call's arguments, seen on the device
            return (f"on rank {self.rank}, a device-side check of the call failed: {what}. The failed call's "
                    f"outputs hold NaN (integers: -1)")
        advice = ("Raise the timeout with create(timeout=...) / IRIS_TIMEOUT if this GPU runs other work that long"
                  if all(kind in LOCAL_FAILURES for _, kind in by_failure) else
                  "Check that every rank is alive and makes the same iris calls in the same order, or raise the "
                  "timeout with create(timeout=...) / IRIS_TIMEOUT")
        return (f"on rank {self.rank}, a device-side wait failed: {what}. The failed call's outputs hold NaN "
                f"(integers: -1). {advice}")

    def _recorded_call_mismatch(self):
        """The different call a kernel of this rank found, where it recorded the headers of both
        (:func:`iris_triton.protocol.waits.record_mismatch`); None when there is none (a timeout, say)."""
        for host_words, peers, comm in self._fault_word_sets:
            world = len(peers)
            if not host_words[0]:
                continue
            seen = {peer: int(host_words[2 + world + q]) & 0xFFFF for q, peer in enumerate(peers)
                    if host_words[2 + world + q] and describe_failure(int(host_words[1 + q]))[1] == "mismatch"}
            if seen:
                return comm, peers, int(host_words[2 + 2 * world]) & 0xFFFF, seen
        return None

    def _announce_call(self, signature: int) -> None:
        """Announce this rank's next call with ``signature`` (0: take the announcement back) where
        the collectives' kernels read their peers' calls (:func:`iris_triton.protocol.calls.announce_kernel`);
        nothing before their sync words exist (no peer is in a collective then)."""
        from iris_triton.protocol.calls import announce_kernel

        sync = self.workspaces.existing("collective_sync")
        if sync is None or self.world_size == 1:
            return
        announce_kernel[(1,)](sync.view(torch.int32), self.programs, self.get_heap_bases(), signature,
                              RANK=self.rank, WORLD=self.world_size, num_warps=1)

    @cached_property
    def ops(self):
        """Matrix products fused with their communication (:class:`iris_triton.operations.fused_ops.FusedOps`)."""
        from iris_triton.operations.fused_ops import FusedOps

        return self._ops_namespace(FusedOps(self))

    def device_barrier(self) -> None:
        """Device-side barrier: returns at once on the host; kernels queued after it on this
        rank's stream start only once every rank has reached its own ``device_barrier``.
        Writes made before it (at system scope) are visible to every rank after it. It can be
        captured in a CUDA graph. A peer that does not arrive within the context's timeout fails
        the context: this call (CPU ranks) or the next iris call raises IrisTimeoutError naming
        it. Collective."""
        from iris_triton.protocol.barrier import device_barrier_kernel

        self._refuse_across_nodes("device_barrier")
        with self._call("device_barrier"):
            device_barrier_kernel[(1,)](self.get_device_context(), self._barrier_state, RANK=self.rank,
                                        WORLD=self.world_size, TRACING=self.tracing.enabled, num_warps=1)

    def _trace_event_names(self) -> dict[int, str]:
        """Every operation whose kernels wait on peers, by its code (:mod:`iris_triton.protocol.waits`)."""
        from iris.tracing import OPERATION_EVENTS
        from iris_triton.protocol.waits import WAIT_SITES, site_code

        return {OPERATION_EVENTS + site_code(name): name for name in WAIT_SITES}

    def _device_clock_ns(self) -> int | None:
        if self.device.type != "cuda":
            return None  # the interpreter's clock is the host's
        from iris_triton.device.clock import read_device_clock

        return read_device_clock(torch.empty(1, dtype=torch.int64, device=self.device))

    def _compile_check_calls(self, full: bool):
        """The tile collectives inside :mod:`iris_triton.tiles.kernel`'s kernels (each, with each
        reduction in the full calls, with tracing as the context has it; upstream's forms too, in
        bfloat16, and in the full calls every float type), the device clock's read, the demo's
        ring store and the announcement of a call that waits on the host (and its taking back)."""
        from iris_triton.device.clock import read_device_clock
        from iris_triton.demo import ring_store_step
        from iris_triton.tiles.kernel import (COLLECTIVES, UPSTREAM_COLLECTIVES, launch_tile_collective,
                                              launch_upstream_tile_collective)

        world = self.world_size
        sync = self.tile_sync(16)
        for collective in COLLECTIVES:
            for op in ("sum", "max", "min", "prod") if full and "reduce" in collective else ("sum",):
                def call(collective=collective, op=op):
                    src = self.zeros(32, 32 * world)
                    dst = self.zeros(32 * world, 32 * world)
                    launch_tile_collective(self, collective, src, dst, sync, op=op, chunk=32)
                yield f"tile collective {collective}(op={op})", call
        for collective in UPSTREAM_COLLECTIVES:
            for dtype in (torch.float32, torch.float16, torch.bfloat16) if full else (torch.bfloat16,):
                def upstream_call(collective=collective, dtype=dtype):
                    src = self.zeros(32, 32 * world, dtype=dtype)
                    dst = self.zeros(32 * world, 32 * world, dtype=dtype)
                    launch_upstream_tile_collective(self, collective, src, dst)
                yield f"upstream tile collective {collective}({dtype})", upstream_call
        yield "device clock", lambda: read_device_clock(torch.zeros(1, dtype=torch.int64, device=self.device))
        yield "demo ring store", lambda: ring_store_step(self, [torch.zeros(1000)] * world)

        def announcement():
            self.collective_sync()  # the words it writes
            self._announce_call(1)
            self._announce_call(0)
        yield "call announcement", announcement

    def _demo_steps(self, inputs: list) -> dict:
        from iris_triton.demo import ring_store_step

        return {"remote store into the next rank": lambda: ring_store_step(self, inputs)}


class TritonContext(TritonDeviceOps, Context):
    """iris context of the ``"triton"`` backend."""


TritonBackend = Backend(name="triton", device_ops=TritonDeviceOps, device_types={"cuda", "cpu"},
                        context_class=TritonContext, device_api="iris_triton.device.kernel_api",
                        device_modules={"x": "iris_triton.x", "device_utils": "iris_triton.device.utils"})
