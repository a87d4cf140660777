"""Context assembly: ``iris.create`` makes a context of the class of its backend.

:class:`Context` is the core's part of every context: the mixins, the terminal ContextBase and
the components it owns (``tracing``, ``workspaces``). The class of a context of backend ``b`` puts
the backend's DeviceOps in front of it, left to right (most specific first)::

    b.device_ops, LoggingMixin, FailStopMixin, GroupsMixin, HeapMixin, NodesMixin, TensorMixin,
    CCLMixin, ContextBase, DeviceOps

Built-in backends declare that class in source (``class TritonContext(TritonDeviceOps, Context)``);
for a backend that declares only its DeviceOps, the same class is composed once and cached.
ContextBase is terminal and owns the state. Set-up hooks (``_setup``) call ``super()`` first, so
they run right to left: ContextBase's identity, then the heap, then the backend's DeviceOps
with everything else in place. ``_teardown`` runs the other way.
"""

from __future__ import annotations

import functools
import os
from functools import cached_property
from typing import Any

import torch

from iris.backend import Backend, DeviceOps
from iris.context.bootstrap import Communicator, default_device_type, ensure_process_group, local_rank
from iris.config import ContextConfig
from iris.errors import BackendNotFoundError, IrisError
from iris.collectives.groups import GroupsMixin
from iris.collectives.workspaces import Workspaces, WorkspacesHost
from iris.context.failstop import FailStopMixin
from iris.context.nodes import NodesMixin
from iris.mixins import CCLMixin, HeapMixin, LoggingMixin, TensorMixin
from iris.tracing import Tracing, TracingHost
from iris.registry import get_backend

__all__ = ["Context", "ContextBase", "check_needs", "context_class", "create", "iris"]


class ContextBase:
    """Terminal base of every context: identity, host synchronisation and lifetime.

    Owns ``config``, ``backend``, ``comm``, ``rank``, ``world_size``, ``device`` and
    ``kernel_device_type``.
    """

    def __init__(self, config: ContextConfig, backend: Backend, device: torch.device,
                 group: "torch.distributed.ProcessGroup | None" = None, *, comm: Communicator | None = None,
                 kernel_device_type: str | None = None):
        self.config = config
        self.backend_spec = backend
        self.device = device
        #: The device type whose kernels, launch shapes and methods the context uses: its
        #: device's, except in a compile-only context (:mod:`iris.tools.compile_check`), whose tensors
        #: live in host memory while its kernels are compiled for GPUs and never run.
        self.kernel_device_type = kernel_device_type or device.type
        self.comm = comm or Communicator(group, timeout=config.timeout)
        self.rank = self.comm.rank
        self.world_size = self.comm.world_size
        self.destroyed = False
        self._setup()

    # -- cooperative hooks ------------------------------------------------------------------

    def _setup(self) -> None:
        """Extended by each mixin; ContextBase's runs first."""

    def _teardown(self) -> None:
        """Extended by each mixin; ContextBase's runs last."""

    def _setup_group_view(self) -> None:
        """Extended by a backend whose state is per group (its fault words, say): runs on a group
        view (:mod:`iris.collectives.groups`) once the view has its rank, world size, heap and communicator."""

    def _summary(self) -> dict[str, Any]:
        """Key facts for ``repr``; mixins extend the dict."""
        return {"rank": self.rank, "world_size": self.world_size, "device": str(self.device)}

    def __repr__(self) -> str:
        if self.destroyed:
            return f"<{type(self).__name__} destroyed>"
        return f"<{type(self).__name__} " + " ".join(f"{k}={v}" for k, v in self._summary().items()) + ">"

    # -- identity ---------------------------------------------------------------------------

    @property
    def backend(self) -> str:
        """Name of the backend this context runs."""
        return self.backend_spec.name

    def get_rank(self) -> int:
        return self.rank

    def get_num_ranks(self) -> int:
        return self.world_size

    @property
    def cur_rank(self) -> int:
        """Upstream iris's name of ``rank``."""
        return self.rank

    @property
    def num_ranks(self) -> int:
        """Upstream iris's name of ``world_size``."""
        return self.world_size

    def world_rank_of(self, rank: int) -> int:
        """The world rank of this context's ``rank`` (itself here; a group view's differ)."""
        return rank

    def describe_ranks(self) -> str:
        """What ranks this context's calls number, for error messages."""
        return f"this world (ranks 0..{self.world_size - 1})"

    def get_device(self) -> torch.device:
        return self.device

    def get_device_id(self) -> int:
        """Index of this rank's GPU (0 on CPU ranks)."""
        return self.get_device().index or 0

    def get_cu_count(self) -> int:
        """Streaming multiprocessors of the GPU, or usable CPU cores on CPU ranks: the natural
        grid size of persistent kernels."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return len(os.sched_getaffinity(0))

    # -- host synchronisation ---------------------------------------------------------------

    def barrier(self) -> None:
        """Host barrier: waits for this rank's queued device work, then for every rank.
        This is a collective operation."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm.barrier()

    # -- namespaces of this kind of context (upstream's conventions replace them) ---------------

    def _ccl_namespace(self):
        """What ``ctx.ccl`` is: the torch.distributed-convention collectives."""
        return self._torch_ccl

    def _ops_namespace(self, ops):
        """What ``ctx.ops`` is, given the backend's operations: those operations."""
        return ops

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """``value`` as rank ``src`` has it. Tensors are overwritten in place (every rank passes
        one of the same shape and dtype); other values must be picklable. Collective."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"src={src} is not a rank of this world (0..{self.world_size - 1})")
        if isinstance(value, torch.Tensor):
            return self.comm.broadcast_tensor(value, src)
        return self.comm.broadcast_object(value, src)

    # -- lifetime ---------------------------------------------------------------------------

    def destroy(self) -> None:
        """Release the heap (collective). Tensors still alive keep their memory valid. Anything
        but the context's identity used afterwards raises IrisError, so the context keeps only
        that: a destroyed context still referenced (a variable in scope) holds no heap, workspace
        or peer's mapping."""
        if not self.destroyed:
            self._teardown()
            identity = {name: value for name, value in vars(self).items() if name in _KEPT_AFTER_DESTROY}
            vars(self).clear()
            vars(self).update(identity, destroyed=True)
            self.__class__ = _destroyed_class(type(self))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.destroy()


#: What a destroyed context still answers: its identity, ``destroyed``, and ``destroy()`` (a no-op).
_KEPT_AFTER_DESTROY = frozenset({"destroyed", "destroy", "rank", "world_size", "device", "config", "backend",
                                 "backend_spec", "get_rank", "get_num_ranks", "get_device", "_summary", "cur_rank",
                                 "num_ranks", "_device_name"})


class _Destroyed:
    """Mixed in front of a context's class by ``destroy()``: every other attribute raises."""

    def __getattribute__(self, name: str):
        if name in _KEPT_AFTER_DESTROY or name.startswith("__"):
            return object.__getattribute__(self, name)
        raise IrisError(f"ctx.{name}: this context (rank {object.__getattribute__(self, 'rank')}) was destroyed; "
                        f"create a new one with iris.create(...)")


@functools.cache
def _destroyed_class(cls: type) -> type:
    return type(cls.__name__, (_Destroyed, cls), {"__module__": cls.__module__})


class Context(LoggingMixin, FailStopMixin, GroupsMixin, HeapMixin, NodesMixin, TensorMixin, CCLMixin, ContextBase,
              DeviceOps):
    """An iris context: the core's mixins and state, with a backend's DeviceOps put in front of it
    (:func:`context_class`). What every context offers, whatever its backend; abstract alone.

    Besides its mixins it owns two components, objects built over it that need of it what their
    protocols say (:attr:`components`): ``tracing``, made once the heap (and the device-context
    tensor it points at the trace buffer) exists and shared by its group views, and
    ``workspaces``, made at first use, a group view's its own."""

    #: The components a context owns, by attribute, with the protocol each needs the context to meet.
    components = {"tracing": TracingHost, "workspaces": WorkspacesHost}

    tracing: Tracing

    def _setup(self) -> None:
        super()._setup()
        self.tracing = Tracing(self)
        self.tracing.attach(self._device_context)

    @cached_property
    def workspaces(self) -> Workspaces:
        """The named heap buffers the context's device protocols share (collectives, fused
        operations, a backend's own)."""
        return Workspaces(self)


@functools.cache
def context_class(backend: Backend) -> type:
    """The context class of ``backend``: the one it declares, else ``device_ops`` composed with
    :class:`Context` (once, then cached). Raises BackendNotFoundError when the backend's DeviceOps
    lacks a member of the backend contract (:mod:`iris.backend`)."""
    cls = backend.context_class
    if cls is None:
        name = backend.name.replace("-", "_").title().replace("_", "") + "Context"
        cls = type(name, (backend.device_ops, Context), {"__module__": backend.device_ops.__module__,
                                                         "__doc__": f"iris context of the {backend.name!r} backend."})
    elif not (issubclass(cls, Context) and issubclass(cls, backend.device_ops)):
        raise BackendNotFoundError(f"backend {backend.name!r}: context_class {cls.__name__} must derive from its "
                                   f"device_ops {backend.device_ops.__name__} and iris.Context")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise BackendNotFoundError(f"backend {backend.name!r}: its DeviceOps {backend.device_ops.__name__} does not "
                                   f"define {', '.join(missing)}, which every backend provides (see the backend "
                                   f"contract in docs/plugins.md)")
    return cls


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        device = os.environ.get("IRIS_DEVICE") or default_device_type()
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {str(device)!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise IrisError("device='cuda' asked for, but no GPU is visible; use device='cpu' for CPU ranks")
        index = device.index if device.index is not None else local_rank() % torch.cuda.device_count()
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    return device


def create(backend: str | None = None, *, heap_size: int | str | None = None, device: Any = None,
           **options: Any) -> Context:
    """Create a context: a symmetric heap on every rank plus the device API of ``backend``.

    This is a collective operation: every rank calls it with the same arguments. The backend is
    the argument, else ``IRIS_BACKEND``, else ``"triton"``; the device is the argument, else a
    GPU when one is visible (one per rank), else ``"cpu"``. ``heap_size`` is bytes or a string
    such as ``"1GiB"`` (default ``IRIS_HEAP_SIZE``, else 1 GiB on GPUs and 128 MiB on CPU ranks).
    Options: ``heap_provider``, ``debug``, ``log_level``, ``timeout`` (seconds any wait on peers
    may take, wall-clock), ``on_timeout`` (``"raise"`` or ``"trap"``), ``group`` (a
    torch.distributed process group: the context's world is its ranks, numbered as in it, with a
    heap of its own; only its members call ``create``). Collectives and fused
    operations follow torch.distributed's conventions; :func:`iris` makes a context with upstream
    iris's instead.
    """
    return _create(backend, heap_size, device, options, conventions=None)


def _create(backend: str | None, heap_size, device, options: dict, conventions) -> Context:
    """:func:`create`, the context's class passed through ``conventions`` (None: as it is)."""
    group = options.pop("group", None)
    resolved_device = _resolve_device(device)
    config = ContextConfig.from_env(backend=backend, heap_size=heap_size, device=resolved_device.type, **options)
    spec = get_backend(config.backend)
    if not isinstance(spec, Backend):
        raise BackendNotFoundError(
            f"backend {config.backend!r} is registered as {spec!r}, which is not an iris.Backend; "
            f"register an iris.Backend(name=..., device_ops=...)"
        )
    if resolved_device.type not in spec.device_types:
        raise IrisError(
            f"backend {spec.name!r} runs on {', '.join(sorted(spec.device_types))} only, not on "
            f"{resolved_device}. {spec.unsupported_device_hint}".rstrip()
        )
    spec.device_ops.check_environment(resolved_device)
    ensure_process_group(resolved_device.type, config.timeout)
    _check_group(group)
    cls = context_class(spec)
    context = (cls if conventions is None else conventions(cls))(config, spec, resolved_device, group)
    check_needs(context)
    context.heap.check_symmetric("iris.create()")  # set-up allocated alike on every rank
    context._join_nodes()
    return context


def check_needs(context) -> None:
    """Raise BackendNotFoundError when a part of ``context``'s class lacks what it needs: each
    mixin declares that as a protocol (its ``needs``), and so does each component the context
    owns (``components``), which the parts provide."""
    for part in type(context).__mro__:
        declared = [(part.__name__, vars(part).get("needs"))]
        declared += [(f"its {name}", needs) for name, needs in vars(part).get("components", {}).items()]
        for who, needs in declared:
            missing = [name for name in getattr(needs, "__annotations__", ()) if not hasattr(context, name)]
            if missing:
                raise BackendNotFoundError(f"{type(context).__name__}: {who} needs {', '.join(missing)} "
                                           f"({needs.__name__}), which no part of the context provides; a backend's "
                                           f"DeviceOps must not remove what the core's mixins rely on")


def _check_group(group) -> None:
    """``create(group=...)``: None or a process group this process is a member of."""
    if group is None:
        return
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"create(group=...) takes a torch.distributed process group (dist.new_group(ranks)), got "
                        f"{type(group).__name__}")
    ranks = torch.distributed.get_process_group_ranks(group)
    if torch.distributed.get_rank() not in ranks:
        raise IrisError(f"create(group=...): world rank {torch.distributed.get_rank()} is not a member of the process "
                        f"group of ranks {ranks}; only its members create a context over it")


#: Upstream iris's heap allocators, and the heap provider each one's GPU heap is made by (on CPU
#: ranks, ``shm`` for both): virtual memory is what memory can be mapped into in place.
UPSTREAM_ALLOCATORS = {"torch": "cuda-ipc", "vmem": "cuda-vmm"}


def iris(heap_size: int | str | None = None, allocator_type: str = "torch", *, backend: str = "triton",
         **options: Any) -> Context:
    """Upstream iris's spelling: a context of ``backend`` (default ``"triton"``) whose collectives,
    fused operations, ``device``, ``broadcast`` and ``barrier`` follow upstream iris's conventions
    (:mod:`iris.compat.context`), and the ``iris`` logger set up as upstream's (:mod:`iris.logging`);
    ``options`` as for :func:`create`. ``allocator_type``
    (``"torch"`` or ``"vmem"``) chooses upstream's heap allocator on AMD GPUs; here it chooses the
    heap provider of a GPU heap (``cuda-ipc`` or ``cuda-vmm``, the one ``as_symmetric`` maps tensors
    into in place) unless ``heap_provider=...`` names one. This is a collective operation."""
    import iris.compat.logging  # noqa: F401 (upstream's logger set-up: its programs' ctx.info(...) lines are shown)
    from iris.compat.context import upstream_class

    if allocator_type not in UPSTREAM_ALLOCATORS:
        raise ValueError(f"allocator_type must be one of {', '.join(map(repr, UPSTREAM_ALLOCATORS))}, got "
                         f"{allocator_type!r}")
    device = options.pop("device", None)
    if _resolve_device(device).type == "cuda":
        options.setdefault("heap_provider", UPSTREAM_ALLOCATORS[allocator_type])
    context = _create(backend, heap_size, device, options, conventions=upstream_class)
    context.accept_upstream_launch_options(context.get_device())
    return context
