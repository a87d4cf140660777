"""Exceptions raised by iris.

Every message says what failed, the values involved, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "IrisError",
    "BackendNotFoundError",
    "HeapExhaustedError",
    "NotOnHeapError",
    "AsymmetricHeapError",
    "IrisTimeoutError",
    "CallMismatchError",
    "RankFailedError",
]


class IrisError(Exception):
    """Base class of every error iris raises on purpose."""


class BackendNotFoundError(IrisError, LookupError):
    """A backend name is unknown, or names a backend whose distribution is not installed."""


class HeapExhaustedError(IrisError, MemoryError):
    """The symmetric heap has no free block large enough for an allocation."""

    def __reduce__(self):
        # Rebuilt from its fields, not its message: it crosses process boundaries (iris.spawn).
        return type(self), (self.requested, self.free, self.largest_block, self.heap_size)

    def __init__(self, requested: int, free: int, largest_block: int, heap_size: int):
        self.requested = requested
        self.free = free
        self.largest_block = largest_block
        self.heap_size = heap_size
        super().__init__(
            f"symmetric heap exhausted: asked {format_bytes(requested)}, "
            f"{format_bytes(free)} free of {format_bytes(heap_size)} "
            f"(largest block {format_bytes(largest_block)}); create the context with a larger "
            f"heap_size=... (or IRIS_HEAP_SIZE) or free tensors with ctx.free(t)"
        )


class NotOnHeapError(IrisError, ValueError):
    """A tensor that must live on the symmetric heap does not."""


class AsymmetricHeapError(IrisError):
    """Ranks made different allocation or free calls (found at every barrier; with IRIS_DEBUG=1
    at the call itself)."""


class IrisTimeoutError(IrisError, TimeoutError):
    """A wait on peers did not complete in time, or a peer made a different call: the call's
    outputs hold NaN and the context is failed."""


class CallMismatchError(IrisTimeoutError):
    """Ranks made different calls (another collective, size, dtype, op, root or algorithm) where
    they had to make the same one: found on the device, where a call's signature meets its peers',
    or at a host exchange of the call (a workspace growing). Every rank raises it, naming every
    rank's call; the call's outputs hold NaN and the context is failed, as after a timeout (it is
    an IrisTimeoutError, for code that handles both alike)."""


class RankFailedError(IrisError):
    """A rank of a launch ended without a result: its process exited or was killed, or it raised
    an exception that cannot be rebuilt here as its own type (the message has its traceback)."""

    def __init__(self, message: str, rank: int, exitcode: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode

    def __reduce__(self):
        return type(self), (str(self), self.rank, self.exitcode)


def format_bytes(n: int) -> str:
    """Human-readable size with binary units, e.g. ``1.5 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
