"""The backend contract: what a backend provides to the core, and what the core provides to it.

A backend is an :class:`Backend` registered under the entry-point group ``iris.backends``. Its
host side is a :class:`DeviceOps` subclass, mixed leftmost into the context class
(:class:`iris.context.Context` holds the core's part), so it may use everything the core provides
and override the cooperative hooks.

What the core provides to a backend's DeviceOps (attributes of the context it is mixed into):

- identity: ``rank``, ``world_size``, ``device`` (a ``torch.device``), ``config``
  (:class:`iris.config.ContextConfig`: ``timeout``, ``on_timeout``, ``debug``, ...), ``comm``
  (:class:`iris.context.bootstrap.Communicator`: host collectives over torch.distributed);
- the heap: ``heap``, ``get_heap_bases()``, ``get_device_context()``, ``zeros``/``empty``/... (tensors
  on the heap), ``free``;
- ``workspaces`` (:class:`iris.collectives.workspaces.Workspaces`): named heap buffers grown collectively,
  CUDA-graph aware, for the backend's protocols;
- ``barrier()`` (host), ``_call(name, outputs)`` (the fail-stop guard every iris call runs
  inside), logging (``debug``/``info``/``warning``/``error``);
- the hooks ``_setup()`` (after the heap exists) and ``_teardown()``, which call ``super()``.

What a backend provides: the members of :class:`DeviceOps` below. Abstract ones must be defined
(a context class missing one cannot be created); the others have working defaults.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Callable, ClassVar

import attrs

__all__ = ["Backend", "DeviceOps"]


class DeviceOps(metaclass=abc.ABCMeta):
    """Base of a backend's host side: the device-side services of a context.

    A backend subclasses it; the subclass goes leftmost in the context class, so its
    ``_setup``/``_teardown`` hooks run last/first. It may use everything the core provides
    (listed in :mod:`iris.backend`).
    """

    #: The language the backend's kernels are written in (``"triton"``, ``"gluon"``, ...), matched
    #: against the languages a collective algorithm declares (:class:`iris.collectives.Algorithm`);
    #: None for a backend that compiles no kernels of its own.
    kernel_language: ClassVar[str | None] = None

    @abc.abstractmethod
    def device_barrier(self) -> None:
        """Device-side barrier: returns at once on the host; device work queued after it on this
        rank starts only once every rank reached its own. Collective; fails the context (an
        IrisTimeoutError) when a peer does not arrive within ``config.timeout``."""

    def _recorded_failure(self) -> str | None:
        """What a device-side wait of this rank recorded when it gave up, as a message for
        IrisTimeoutError, or None; read without waiting for the device (FailStopMixin). The
        default: nothing is recorded on the device."""
        return None

    def _recorded_call_mismatch(self):
        """A different call of a peer that this rank's kernels found (:mod:`iris.context.failstop`):
        ``(comm, world ranks, signature, {world rank: signature})``, the host communicator and the
        world ranks of the ranks involved, this rank's call's signature and the one each peer
        announced instead; None when none was found. The default: nothing is recorded on the
        device."""
        return None

    def _announce_call(self, signature: int) -> None:  # noqa: B027 (an optional hook)
        """Make this rank's next call (of ``signature``) known to peers whose kernels already wait
        for it, before this rank waits on the host (a workspace growing): they then find a
        different call at once, and come to the host exchange. The default: nothing."""

    def _trace_event_names(self) -> dict[int, str]:
        """Names of the backend's own trace event kinds (from ``iris.tracing.OPERATION_EVENTS``
        on), for the exported trace. The default: none."""
        return {}

    def _device_clock_ns(self) -> int | None:
        """The clock device-side trace events are stamped with, read now (nanoseconds), or None
        when it is the host's monotonic clock. The default: None."""
        return None

    def _demo_steps(self, inputs: list) -> dict[str, Callable[[], bool]]:
        """Extra steps for ``iris demo``, run before the collectives: ``{title: check}``, each
        check returning whether this rank's result is right; ``inputs`` is every rank's input,
        the same on every rank. The default: none."""
        return {}

    def _compile_check_calls(self, full: bool) -> Iterator[tuple[str, Callable[[], object]]]:
        """Calls that launch the backend's kernels no public call launches (kernels users call
        from their own, say), for ``iris compile-check`` (:mod:`iris.tools.compile_check.cases`):
        ``(what, call)`` pairs; ``full`` asks for every dtype and option, not one of each. The
        default: none."""
        return iter(())

    @classmethod  # noqa: B027 (an optional hook: nothing to check by default)
    def check_environment(cls, device) -> None:
        """Raise IrisError if this process cannot run the backend's kernels on ``device``;
        called by ``create`` before any collective set-up, so a bad environment fails fast."""

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        """Why the backend's kernels cannot run on ``device_type`` ranks in this installation
        (package versions, say), or None when they can. Asked before ranks are started (tests
        skip with it); cheap, and needs none of :meth:`rank_environment` set."""
        return None

    @classmethod  # noqa: B027 (an optional hook: nothing to do by default)
    def accept_upstream_launch_options(cls, device) -> None:
        """Called when a context with upstream iris's conventions (``iris.iris(...)``) is created on
        ``device``: make kernel launches accept the options upstream's programs pass that this
        backend's compiler does not know (AMD-only ones on NVIDIA GPUs, say), ignoring them."""

    @classmethod
    def rank_environment(cls, device_type: str) -> Mapping[str, str]:
        """Environment variables a process must have before it imports the backend to run its
        kernels on ``device_type`` ranks (``iris.spawn`` and ``iris run`` set them in the ranks)."""
        return {}


@attrs.frozen(kw_only=True)
class Backend:
    """A backend, as registered under the ``iris.backends`` entry-point group."""

    name: str
    """Name users select it by, e.g. ``"triton"``."""
    device_ops: type[DeviceOps] = attrs.field()
    """Its host side, mixed into the context class."""
    device_types: frozenset[str] = attrs.field(default=frozenset({"cuda", "cpu"}), converter=frozenset)
    """Device types its kernels run on."""
    unsupported_device_hint: str = ""
    """Appended to the error for a device type it does not run on (what to use instead)."""
    context_class: type | None = None
    """Its context class, when declared in source (``class MyContext(MyDeviceOps, iris.Context)``);
    None: iris composes ``device_ops`` with :class:`iris.context.Context` under the name
    ``<Name>Context``."""
    device_api: str | None = None
    """The module whose ``__all__`` lists the functions kernels call (``iris.load`` and the other
    upstream-compatible names resolve there for the default backend), or None."""
    device_modules: Mapping[str, str] = attrs.field(factory=dict, hash=False,
                                                 converter=lambda modules: MappingProxyType(dict(modules)))
    """Modules of the backend that upstream iris's programs import under iris's names, by the name
    after ``iris.`` (``{"x": "iris_triton.x"}`` makes ``import iris.x`` that module): see
    :mod:`iris.compat`."""

    @device_ops.validator
    def _check_device_ops(self, attribute, value) -> None:
        if not (isinstance(value, type) and issubclass(value, DeviceOps)):
            raise TypeError(f"backend {self.name!r}: device_ops must be a subclass of iris.DeviceOps, got {value!r}")
