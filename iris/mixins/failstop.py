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
"""

from __future__ import annotations

import threading

import torch

from iris.collectives import SAME_SIZE_INTEGER
from iris.errors import IrisError, IrisTimeoutError

__all__ = ["FailStopMixin"]

#: Errors after which the ranks' protocol states may disagree: the context is failed. (An
#: asymmetric heap is reported by every later barrier until the ranks' heaps agree again.)
FAILING_ERRORS = (IrisTimeoutError,)


class FailStopMixin:
    """Adds ``check()``, ``failed`` and, for the other mixins, ``_call(name)``: the guard every
    iris call runs inside. Requires ``_recorded_failure()`` (the backend's DeviceOps: what its
    kernels recorded, as a message, or None), ``device`` and ``rank``."""

    def _setup(self) -> None:
        super()._setup()
        self._failure: IrisError | None = None
        self._in_use = threading.RLock()

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

    def _raise_if_failed(self, name: str) -> None:
        if self._failure is not None:
            raise type(self._failure)(
                f"ctx.{name} on rank {self.rank}: this context failed earlier and cannot be used again; destroy it "
                f"with ctx.destroy() and create a new one. The failure: {self._failure}") from self._failure
        message = self._recorded_failure()
        if message is not None:
            self._failure = IrisTimeoutError(f"ctx.{name}: {message}")
            raise self._failure

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
