"""FailStopMixin: no iris call returns normally after a failure it could see, and a context is
used from one thread at a time.

A device-side wait that gives up (a peer dead, late by more than the timeout, or making a
different call) is recorded by the kernel where the host sees it without a synchronisation; the
kernel fills the call's outputs with NaN (integers: -1). The host checks the record before and
after every iris call: on CPU ranks, where a kernel has finished when its launch returns, the
failing call itself raises; on GPUs the next iris call does (or :meth:`check`, which waits for the
stream first). A host barrier that times out fails the context the same way.

A failed context stays failed: every later call raises, naming the first failure, because its
peers' protocol state (call counts, workspaces) no longer agrees with its own. What remains
possible is ``destroy()``, which then releases this rank's resources without waiting for peers.

Ranks that made different calls raise :class:`~iris.errors.CallMismatchError` naming every rank's
call. The device compares 16-bit signatures only (:attr:`iris.collectives.CollectiveCall.signature`):
each call's namespace describes the call to the context first (:meth:`FailStopMixin._describe_call`,
kept by signature), and once a kernel recorded that a peer announced another signature, the host
exchanges its call's description with its peers (one bounded all-gather over the host group, which
every rank that found the mismatch makes) before it raises. A host exchange inside a call (a
workspace growing, :meth:`FailStopMixin._agree_on_call`) carries the call's description too, so
ranks whose different calls grow different workspaces, or only one of them, meet there.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Protocol

import torch

from iris.calls.repeats import invalidate as invalidate_repeats
from iris.collectives import SAME_SIZE_INTEGER
from iris.errors import CallMismatchError, IrisError, IrisTimeoutError

__all__ = ["FailStopMixin"]

#: Most call descriptions a context keeps by signature (the oldest are dropped first).
MAX_DESCRIPTIONS = 4096
#: What every rank must do alike, said by every error that names the ranks' different calls.
SAME_CALLS = ("every rank must make the same iris calls in the same order, with tensors of the same shapes and "
              "dtypes and the same options (IRIS_DEBUG=1 compares every call on the host before it runs)")

#: Errors after which the ranks' protocol states may disagree: the context is failed. (An
#: asymmetric heap is reported by every later barrier until the ranks' heaps agree again.)
FAILING_ERRORS = (IrisTimeoutError,)


class FailStopHost(Protocol):
    """What FailStopMixin needs from the context it is part of (checked when a context is made)."""

    _recorded_failure: Callable[[], str | None]
    device: Any
    rank: int


class FailStopMixin:
    """Adds ``check()``, ``failed`` and, for the other mixins, ``_call(name)``: the guard every
    iris call runs inside."""

    needs = FailStopHost

    def _setup(self) -> None:
        super()._setup()
        self._failure: IrisError | None = None
        self._in_use = threading.RLock()
        #: Descriptions of this rank's calls by their signatures (its group views share them).
        self._call_descriptions: dict[int, str] = {}
        #: ``(name, signature, description)`` of the call in progress (:meth:`_describe_call`).
        self._current_call: tuple[str, int, str] | None = None
        #: What each public call in progress offers to repeat, innermost last (:mod:`iris.calls.repeats`).
        self._calls_offering: list = []
        #: Whether kernels have finished when their launch returns (CPU ranks' interpreter).
        self._kernels_finish_in_call = self.device.type != "cuda"
        #: The raw handle of the device's current stream, where a repeat launches (CPU ranks: 0).
        self._current_stream = (functools.partial(torch._C._cuda_getCurrentRawStream, self.device.index)
                                if self.device.type == "cuda" else lambda: 0)

    @property
    def failed(self) -> bool:
        """Whether this context failed (a wait gave up or a host barrier timed out): every call but
        ``destroy()`` raises from then on."""
        return self._failure is not None or self._recorded_failure() is not None

    def _call(self, name: str, outputs: tuple = ()) -> "_Call":
        """The guard of one iris call (``with ctx._call("ccl.all_reduce", (out,)): ...``): it
        raises if another thread is inside a call on this context, or if the context failed
        before or during the call; a failing error raised inside fails the context. When the
        call fails during it, ``outputs`` are filled with all-ones bits (:func:`poison`)."""
        return _Call(self, name, outputs)

    def _run_repeat(self, repeat: Callable[[int], Any], name: str,
                    outputs: Callable[[Any], tuple] = lambda result: ()) -> tuple | None:
        """Run ``repeat``, which enqueues the launches of an earlier call made again on the raw
        stream it is given (:mod:`iris.calls.repeats`), as the call ``ctx.<name>`` inside the
        least of its guard: ``(its result,)``, or None, having done nothing, where the call needs
        the whole guard (:meth:`_call`): a failure to raise, a host range to record, another
        thread inside a call. On GPUs nothing is checked after the launch: its kernels have not
        run yet (they poison what they cannot verify), and the next call raises what they record.
        On CPU ranks the kernels ran within the call: what they recorded raises now, as the whole
        guard's check does, and ``outputs(result)`` are poisoned.

        The repeat launches on the context's device's current stream. A repeat asks for no
        workspace, but a CUDA graph being captured would now hold the workspaces' addresses: a
        capture in progress is noted (:meth:`iris.collectives.workspaces.Workspaces.note_capture`),
        asked only off the legacy default stream (handle 0), which no graph captures."""
        if self._failure is not None or self._recorded_failure() is not None or self.tracing.records_host_ranges:
            return None
        stream = self._current_stream()
        if stream and not self.workspaces.graph_captured:
            self.workspaces.note_capture()
        in_use = self._in_use
        if not in_use.acquire(False):
            return None
        try:
            result = repeat(stream)
        finally:
            in_use.release()
        if self._kernels_finish_in_call and self._recorded_failure() is not None:
            for tensor in outputs(result):
                poison(tensor)
            self._raise_if_failed(name)
        return (result,)

    def _raise_if_failed(self, name: str) -> None:
        if self._failure is not None:
            raise type(self._failure)(
                f"ctx.{name} on rank {self.rank}: this context failed earlier and cannot be used again; destroy it "
                f"with ctx.destroy() and create a new one. The failure: {self._failure}") from self._failure
        message = self._recorded_failure()
        if message is not None:
            self._failure = self._different_calls_found(name) or IrisTimeoutError(f"ctx.{name}: {message}")
            raise self._failure

    # -- calls that differ between ranks --

    def _describe_call(self, name: str, signature: int, description: str) -> tuple | None:
        """The call ``ctx.<name>`` now starting, of ``signature`` (what its kernels announce to
        their peers, 16 bits) and ``description`` (its arguments, as every rank's identical call
        has them): kept for naming it should a peer make another call. Returns the call it
        interrupts (a call made inside another), to give back to :meth:`_end_call`."""
        descriptions = self._call_descriptions
        if signature not in descriptions and len(descriptions) >= MAX_DESCRIPTIONS:
            del descriptions[next(iter(descriptions))]
            invalidate_repeats()  # a repeat of the call dropped would run with no description to name it
        descriptions[signature] = description
        outer, self._current_call = self._current_call, (name, signature, description)
        return outer

    def _end_call(self, outer: tuple | None) -> None:
        """The call :meth:`_describe_call` started has ended; ``outer`` is again in progress."""
        self._current_call = outer

    def _agree_on_call(self, value: int = 0, *, settle: bool = True) -> list[int]:
        """Every rank's ``value``, in rank order, from one host exchange that carries the call in
        progress (:meth:`_describe_call`): collective, made inside a call that must wait for its
        peers on the host (a workspace growing). Raises CallMismatchError, on every rank, when
        the ranks are not all in the same call: peers whose different calls need no exchange wait
        for this rank on the device, so when the exchange does not complete at once this rank
        first announces its call there (the backend's ``_announce_call``); they find the mismatch
        and come to the exchange (:meth:`_different_calls_found`). ``settle``: on GPUs, wait for
        the kernels queued before and raise what they recorded first (an earlier call's mismatch
        is then exchanged as that call's)."""
        name, signature, description = self._current_call or ("call", 0, "")
        if settle and self.device.type == "cuda":
            with self._call(name):
                torch.cuda.synchronize(self.device)
        announced = []

        def announce():
            self._announce_call(signature)
            announced.append(True)

        calls = self.comm.exchange_calls(value, description, on_slow=announce if signature else None)
        if any(call != calls[0][1] for _, call in calls):
            ranks = [self.world_rank_of(r) for r in range(len(calls))]
            raise CallMismatchError(_different_calls(name, self.rank, ranks, [call for _, call in calls],
                                                     "found at a host exchange of the call"))
        if announced:  # every rank is in this call: nobody needs it, and it may not reach its kernel
            self._announce_call(0)
        return [value for value, _ in calls]

    def _different_calls_found(self, name: str) -> CallMismatchError | None:
        """The error naming every rank's call where this rank's kernels found a peer in a
        different call (the backend's ``_recorded_call_mismatch``); None where they found none.
        Exchanges this rank's call's description with the ranks of that call (every rank that
        found the mismatch makes the exchange), within the timeout."""
        found = self._recorded_call_mismatch()
        if found is None:
            return None
        comm, ranks, signature, peers = found
        current = self._current_call
        mine = self._call_descriptions.get(signature) or (
            current[2] if current is not None and current[1] == signature else f"a call of signature {signature:#06x}")
        try:
            calls = [call for _, call in comm.exchange_calls(0, mine)]
        except IrisTimeoutError as error:
            others = "; ".join(f"rank {q}: a call of signature {s:#06x}" for q, s in sorted(peers.items()))
            return CallMismatchError(
                f"ctx.{name}: on rank {self.rank}, the ranks made different calls (world rank(s) {sorted(peers)} made "
                f"a different call from this rank's, found on the device): rank {self.rank}: {mine}; {others}; "
                f"their calls' descriptions could not be exchanged ({error}); {SAME_CALLS}. The failed call's "
                f"outputs hold NaN (integers: -1)")
        return CallMismatchError(_different_calls(name, self.rank, list(ranks), calls, "found on the device"))

    def check(self) -> None:
        """Wait for this rank's queued device work, then raise the failure a device-side wait
        recorded, if any (``IrisTimeoutError``). Without it, a failure on GPUs surfaces at the
        next iris call after the kernel gave up."""
        with self._call("check"):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Host barrier: waits for this rank's queued device work, then for every rank, and
        checks the heaps' symmetry; raises a failure recorded on this rank. This is a collective
        operation."""
        with self._call("barrier"):
            if self.device.type == "cuda":
                # What the kernels queued so far recorded raises before the host barrier: peers that
                # found a different call then meet this rank at their exchange, not at a barrier.
                torch.cuda.synchronize(self.device)
                self._raise_if_failed("barrier")
            super().barrier()

    def destroy(self) -> None:
        """Release the heap (collective, unless the context failed: then this rank's resources
        are released without waiting for peers). A failure recorded but not yet raised is raised
        once everything is released."""
        if self.destroyed:
            return
        unreported = None
        if self._failure is None and self._recorded_failure() is not None:
            try:
                self._raise_if_failed("destroy")
            except IrisTimeoutError as error:
                unreported = error
        super().destroy()
        if unreported is not None:
            raise unreported


def _different_calls(name: str, rank: int, ranks: list[int], calls: list[str], where: str) -> str:
    """The message of a CallMismatchError on ``rank`` (a world rank): ``calls`` are the
    descriptions of the calls of the world ranks ``ranks``."""
    mine = calls[ranks.index(rank)] if rank in ranks else None
    others = [q for q, call in zip(ranks, calls) if call != mine]
    listing = "; ".join(f"rank {q}: {call or 'no call described'}" for q, call in zip(ranks, calls))
    return (f"ctx.{name}: on rank {rank}, the ranks made different calls (world rank(s) {others} made a different "
            f"call from this rank's, {where}): {listing}; {SAME_CALLS}. The failed call's outputs hold NaN "
            f"(integers: -1)")


def poison(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with all-ones bits, as kernels do with what a failed wait left unverified:
    NaN for floating-point dtypes, -1 for integers."""
    tensor.view(SAME_SIZE_INTEGER[tensor.element_size()]).fill_(-1)



class _Call:
    """The guard of one call (a class rather than a generator: it runs on every call's path)."""

    __slots__ = ("context", "name", "outputs", "host_range")

    def __init__(self, context: FailStopMixin, name: str, outputs: tuple):
        self.context = context
        self.name = name
        self.outputs = outputs
        self.host_range = context.tracing.host_range(name)

    def __enter__(self) -> None:
        context = self.context
        if not context._in_use.acquire(blocking=False):
            raise IrisError(f"ctx.{self.name} on rank {context.rank}: another thread is inside a call on this context; "
                            f"a context is not thread-safe (its calls are collective and ordered): use it from one "
                            f"thread at a time, e.g. behind a lock")
        try:
            context._raise_if_failed(self.name)
        except BaseException:
            context._in_use.release()
            raise
        if self.host_range is not None:
            self.host_range.__enter__()

    def __exit__(self, kind, error, trace) -> None:
        context = self.context
        if self.host_range is not None:
            self.host_range.__exit__(kind, error, trace)
        try:
            if error is None:
                context._raise_if_failed(self.name)
            elif isinstance(error, FAILING_ERRORS) and context._failure is None:
                context._failure = error
        except FAILING_ERRORS:
            error = context._failure
            raise
        finally:
            if isinstance(error, FAILING_ERRORS):
                # Kernels poison only the blocks they could not verify (another program may still
                # have been sending from an in-place input); once the call is over, all of it.
                for tensor in self.outputs:
                    poison(tensor)
            context._in_use.release()
