"""What a backend provides: its name, the device types it runs on, and its DeviceOps class."""

from __future__ import annotations

import attrs

__all__ = ["Backend", "DeviceOps"]


class DeviceOps:
    """Base of a backend's host side (building and launching its kernels).

    A backend subclasses it; the subclass goes leftmost in the assembled context class, so its
    ``_setup``/``_teardown`` hooks run last/first. It may use everything the other mixins add.
    """

    def _recorded_failure(self) -> str | None:
        """What a device-side wait of this rank recorded when it gave up, as a message for
        IrisTimeoutError, or None; read without waiting for the device (FailStopMixin)."""
        return None

    @classmethod
    def check_environment(cls, device) -> None:
        """Raise IrisError if this process cannot run the backend's kernels on ``device``;
        called by ``create`` before any collective set-up, so a bad environment fails fast."""


@attrs.frozen(kw_only=True)
class Backend:
    """A backend, as registered under the ``iris.backends`` entry-point group."""

    name: str
    """Name users select it by, e.g. ``"triton"``."""
    device_ops: type[DeviceOps]
    """Its host side, mixed into the context class."""
    device_types: frozenset[str] = attrs.field(default=frozenset({"cuda", "cpu"}), converter=frozenset)
    """Device types its kernels run on."""
    unsupported_device_hint: str = ""
    """Appended to the error for a device type it does not run on (what to use instead)."""
