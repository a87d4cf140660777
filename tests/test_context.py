"""Context assembly (iris.create, iris.iris), identity, lifetime, logging, and iris.spawn.

In-process contexts are single-rank CPU contexts (a world-of-one process group); tests/conftest.py
sets TRITON_INTERPRET=1 when no GPU is visible. Multi-rank behaviour goes through iris.spawn.
"""

from __future__ import annotations

import logging
import os

import time

import attrs
import pytest
import torch
import torch.distributed as dist

import iris
from iris.backend import DeviceOps
from iris.context import Context, ContextBase, check_needs, context_class
from iris.errors import BackendNotFoundError, IrisError
from iris.heap.device_context import trailer_index
from iris.collectives.workspaces import WorkspacesHost
from iris.context.failstop import FailStopMixin
from iris.mixins import CCLMixin, HeapMixin, LoggingMixin, TensorMixin
from iris.tracing import TracingHost
from iris.registry import get_backend
from iris.testing import mapped_heap_segments

HEAP = "4MiB"
pytestmark = pytest.mark.usefixtures("clean_iris_env")

# On CPU-only machines tests/conftest.py sets TRITON_INTERPRET=1, so these always run there (and
# fail loudly if it did not). On GPU machines CPU contexts are skipped unless it is set.
needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available(),
    reason="CPU contexts need TRITON_INTERPRET=1, which is not set on this GPU machine",
)


@pytest.fixture
def make_context():
    """``make_context(**kwargs)``: a CPU context with a small heap, destroyed after the test."""
    made = []

    def make(**kwargs):
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("heap_size", HEAP)
        ctx = iris.create(**kwargs)
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.destroy()


@pytest.fixture
def iris_logger():
    """The ``iris`` logger, with its level and handlers restored after the test."""
    logger = logging.getLogger("iris")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def _triton_backend():
    return get_backend("triton")


def heap_offset(ctx, tensor: torch.Tensor) -> int:
    """Byte offset of ``tensor`` in ``ctx``'s local heap, from the public heap bases."""
    return tensor.data_ptr() - int(ctx.get_heap_bases()[ctx.get_rank()])


# -- assembly -----------------------------------------------------------------------------------


def test_every_part_declares_what_it_needs_and_a_gap_is_named():
    """Each mixin declares what it needs from the rest of the context (a protocol, its ``needs``);
    a context class whose parts leave one of those out is refused, naming the part and the names."""
    mixins = [part for part in Context.__mro__ if "needs" in vars(part)]
    assert {part.__name__ for part in mixins} >= {"LoggingMixin", "FailStopMixin", "GroupsMixin", "HeapMixin",
                                                 "NodesMixin", "TensorMixin", "CCLMixin"}
    # And each component the context owns, by the protocol its class takes.
    assert Context.components == {"tracing": TracingHost, "workspaces": WorkspacesHost}

    class Partial(TensorMixin):
        heap = object()
        rank = 0

    with pytest.raises(BackendNotFoundError, match=r"TensorMixin needs device \(TensorHost\)"):
        check_needs(Partial())

    class Whole(Partial):
        device = torch.device("cpu")

    check_needs(Whole())

    class Owner(Whole):  # a component's needs are checked as a mixin's
        components = {"tracing": TracingHost}

    with pytest.raises(BackendNotFoundError, match=r"its tracing needs _device_context, comm, info \(TracingHost\)"):
        check_needs(Owner())


def test_context_class_mro_order():
    from iris_triton.backend import TritonContext, TritonDeviceOps

    cls = context_class(_triton_backend())
    mro = cls.__mro__
    expected = [TritonDeviceOps, Context, LoggingMixin, FailStopMixin, HeapMixin, TensorMixin, CCLMixin, ContextBase,
                DeviceOps]
    assert [c for c in mro if c in expected] == expected
    assert mro[0] is cls and mro[1] is TritonDeviceOps  # the backend's host side is leftmost
    # The terminal base is the last with state; DeviceOps after it only declares the contract.
    assert mro[-3:] == (ContextBase, DeviceOps, object)
    # The fail-stop guard comes before the heap and the collectives: its barrier() and destroy()
    # wrap theirs (a heap symmetry error or a host barrier timeout fails the context, and a failed
    # context's teardown does not wait for peers).
    assert mro.index(FailStopMixin) < mro.index(HeapMixin) < mro.index(CCLMixin)
    assert cls is TritonContext  # declared in source


def test_a_composed_context_class_derives_from_the_backend_and_the_core():
    from iris_triton.backend import TritonDeviceOps

    composed = context_class(attrs.evolve(_triton_backend(), name="composed", context_class=None))
    assert composed.__mro__[1:3] == (TritonDeviceOps, Context) and composed.__name__ == "ComposedContext"


def test_one_cached_class_per_backend_with_a_readable_name():
    triton = _triton_backend()
    assert context_class(triton) is context_class(triton)
    assert context_class(triton).__name__ == "TritonContext"
    assert context_class(triton).__qualname__ == "TritonContext"
    assert context_class(triton).__module__ == "iris_triton.backend"
    other = attrs.evolve(triton, name="my-echo_backend", context_class=None)
    assert context_class(other) is not context_class(triton)
    assert context_class(other).__name__ == "MyEchoBackendContext"
    assert context_class(get_backend("gluon")).__name__ == "GluonContext"


@needs_interpreter
def test_contexts_of_one_backend_share_the_class(make_context):
    a, b = make_context(), make_context()
    assert type(a) is type(b) is context_class(_triton_backend())
    assert type(a).__name__ == "TritonContext"


@needs_interpreter
def test_in_process_backend_gets_its_own_context_class(make_context, global_backends):
    mine = attrs.evolve(_triton_backend(), name="echo-inproc", context_class=None)
    iris.register_backend("echo-inproc", mine)
    ctx = make_context(backend="echo-inproc")
    assert type(ctx).__name__ == "EchoInprocContext"
    assert ctx.backend == "echo-inproc"
    assert isinstance(ctx, ContextBase) and isinstance(ctx, HeapMixin)


@needs_interpreter
def test_backend_from_environment(make_context, monkeypatch):
    monkeypatch.setenv("IRIS_BACKEND", "no-such-backend")
    with pytest.raises(BackendNotFoundError, match="no-such-backend"):
        make_context()
    assert make_context(backend="triton").backend == "triton"  # the argument wins


@needs_interpreter
def test_heap_size_argument_and_environment(make_context, monkeypatch):
    assert make_context(heap_size="4MiB").heap_size == 4 << 20
    monkeypatch.setenv("IRIS_HEAP_SIZE", "2MiB")
    assert make_context(heap_size=None).heap_size == 2 << 20
    assert make_context(heap_size=1 << 20).heap_size == 1 << 20


def test_gluon_on_cpu_is_a_clear_error():
    with pytest.raises(IrisError) as excinfo:
        iris.create(backend="gluon", device="cpu", heap_size=HEAP)
    assert not isinstance(excinfo.value, BackendNotFoundError)  # installed, just not for CPUs
    message = str(excinfo.value)
    assert "'gluon'" in message and "cpu" in message
    assert "GPU" in message
    assert "backend='triton'" in message


def test_bad_device_is_rejected():
    with pytest.raises(ValueError, match="'cuda', 'cuda:N' or 'cpu'"):
        iris.create(device="meta", heap_size=HEAP)


# -- two contexts in one process ----------------------------------------------------------------


@needs_interpreter
def test_two_contexts_are_independent(make_context):
    a, b = make_context(), make_context()
    assert a.get_heap_bases().item() != b.get_heap_bases().item()

    # (the backend may reserve heap space at set-up, e.g. barrier flags: compare, never assume 0)
    x = b.zeros(16, dtype=torch.float32)
    big = a.empty(1 << 20, dtype=torch.uint8)  # a large allocation in a
    a.zeros(3, dtype=torch.float64)
    y = b.zeros(16, dtype=torch.float32)
    fresh = make_context()
    fresh.zeros(16, dtype=torch.float32)
    # b's layout is exactly that of a context where nothing happened in a
    assert heap_offset(b, y) == heap_offset(fresh, fresh.zeros(16, dtype=torch.float32))

    assert b.is_symmetric(x) and not a.is_symmetric(x)
    assert a.is_symmetric(big) and not b.is_symmetric(big)
    assert heap_offset(a, big) == heap_offset(b, x)  # same offset, different memory
    big.fill_(0xFF)
    assert torch.count_nonzero(x) == 0 and torch.count_nonzero(y) == 0  # a's writes are not b's

    a.destroy()
    z = b.ones(4)  # b outlives a
    assert z.sum().item() == 4 and not b.destroyed


@needs_interpreter
def test_iris_iris_is_a_triton_context_with_upstreams_conventions(monkeypatch):
    from iris_triton import TritonContext

    monkeypatch.setenv("IRIS_BACKEND", "gluon")  # iris.iris always means the Triton backend
    ctx = iris.iris(HEAP)
    try:
        assert type(ctx).__name__ == "TritonIris"
        assert isinstance(ctx, iris.Iris) and isinstance(ctx, TritonContext)
        assert type(ctx).__mro__[1:3] == (iris.Iris, TritonContext)
        assert ctx.backend == "triton"
        assert isinstance(ctx.device, str) and ctx.device == ctx.get_device()
        assert ctx.device.type == ctx.get_device().type
        assert ctx.heap_size == 4 << 20
        assert ctx.get_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    finally:
        ctx.destroy()


# -- identity, lifetime, repr -------------------------------------------------------------------


@needs_interpreter
def test_identity(make_context):
    ctx = make_context()
    assert ctx.get_rank() == ctx.rank == dist.get_rank() == 0
    assert ctx.get_num_ranks() == ctx.world_size == dist.get_world_size() == 1
    assert ctx.get_device() == torch.device("cpu")
    assert ctx.backend == "triton"
    assert ctx.get_cu_count() == len(os.sched_getaffinity(0)) >= 1
    assert ctx.get_heap_bases().dtype == torch.int64 and ctx.get_heap_bases().shape == (1,)
    # Then iris's own trailer: the heap size, the trace buffer's distance and capacity (no buffer
    # yet), the waits' timeout and where the fault words and their host-visible copy are.
    assert ctx.get_device_context().tolist() == [0, 1, ctx.get_heap_bases().item(), ctx.heap_size, 0, 0,
                                                 ctx.timeout_ns, ctx.faults.data_ptr(), ctx.host_faults.data_ptr()]


@needs_interpreter
@pytest.mark.parametrize(("on_timeout", "trap"), [(None, 0), ("raise", 0), ("trap", 1)])
def test_timeout_and_on_timeout_reach_the_kernels(make_context, monkeypatch, on_timeout, trap):
    # What kernels receive: the timeout in nanoseconds (an int, for the launcher) and the fault
    # words [first failure, one per peer, trap flag, the header of each peer's different call, this
    # rank's], none recorded, the trap flag from on_timeout.
    monkeypatch.delenv("IRIS_ON_TIMEOUT", raising=False)
    ctx = make_context(timeout=2.5, **({} if on_timeout is None else {"on_timeout": on_timeout}))
    assert type(ctx.timeout_ns) is int and ctx.timeout_ns == 2_500_000_000
    assert ctx.faults.dtype == torch.int32 and ctx.faults.device == ctx.device
    assert ctx.faults.tolist() == [0] + [0] * ctx.world_size + [trap] + [0] * ctx.world_size + [0]
    assert ctx.host_faults.data_ptr() == ctx.faults.data_ptr()  # CPU ranks: the same words
    trailer = ctx.get_device_context()
    assert [trailer[trailer_index(name, ctx.world_size)].item() for name in ("timeout_ns", "faults", "host_faults")] \
        == [2_500_000_000, ctx.faults.data_ptr(), ctx.host_faults.data_ptr()]
    assert not ctx.failed
    ctx.check()  # nothing recorded: does not raise


@needs_interpreter
def test_context_manager_destroys():
    with iris.create(device="cpu", heap_size=HEAP) as ctx:
        assert not ctx.destroyed
        t = ctx.arange(5)
    assert ctx.destroyed
    assert repr(ctx) == "<TritonContext destroyed>"
    with pytest.raises(IrisError, match="was destroyed"):
        _ = ctx.heap
    ctx.destroy()  # idempotent
    assert t.tolist() == [0, 1, 2, 3, 4]  # tensors still alive keep their memory


@needs_interpreter
def test_a_destroyed_context_still_referenced_maps_no_heap():
    before = len(mapped_heap_segments())
    ctx = iris.create(device="cpu", heap_size=HEAP)
    x = torch.ones(300)
    ctx.ccl.all_reduce(x)  # workspaces and a repeatable launch: more views of the heap
    ctx.ccl.all_gather(torch.empty(300), x)
    ctx.barrier()
    assert len(mapped_heap_segments()) > before
    ctx.destroy()
    assert ctx.destroyed and ctx.rank == 0  # its identity stays
    assert len(mapped_heap_segments()) == before  # though ``ctx`` still refers to it


@needs_interpreter
def test_context_manager_destroys_on_error():
    with pytest.raises(KeyError):
        with iris.create(device="cpu", heap_size=HEAP) as ctx:
            raise KeyError("boom")
    assert ctx.destroyed


@needs_interpreter
def test_repr(make_context):
    ctx = make_context()
    text = repr(ctx)
    assert text.startswith("<TritonContext ") and text.endswith(">")
    for part in ("rank=0", "world_size=1", "device=cpu", "heap_size=4.0 MiB"):
        assert part in text


# -- logging ------------------------------------------------------------------------------------


@needs_interpreter
def test_log_records_carry_the_rank_prefix(make_context, iris_logger, caplog):
    ctx = make_context(log_level="INFO")
    caplog.clear()
    ctx.info("hello %s", "world")
    (record,) = [r for r in caplog.records if r.name == "iris"]
    assert record.getMessage() == "[iris 0/1] hello world"
    assert record.levelno == logging.INFO
    assert (record.rank, record.world_size) == (0, 1)


@needs_interpreter
def test_log_level_from_argument(make_context, iris_logger, caplog):
    ctx = make_context(log_level="WARNING")
    caplog.clear()
    ctx.debug("d")
    ctx.info("i")
    ctx.warning("w")
    ctx.error("e")
    assert [r.getMessage() for r in caplog.records if r.name == "iris"] == ["[iris 0/1] w", "[iris 0/1] e"]


@needs_interpreter
def test_log_level_from_environment(make_context, iris_logger, caplog, monkeypatch):
    monkeypatch.setenv("IRIS_LOG_LEVEL", "debug")
    ctx = make_context()
    assert ctx.config.log_level == logging.DEBUG
    messages = [r.getMessage() for r in caplog.records if r.name == "iris"]
    assert any(m.startswith("[iris 0/1] heap: 4.0 MiB per rank") for m in messages)  # set-up is logged
    caplog.clear()
    ctx.debug("details")
    assert [r.getMessage() for r in caplog.records if r.name == "iris"] == ["[iris 0/1] details"]

    quiet = make_context(log_level="ERROR")  # the argument beats the environment
    caplog.clear()
    quiet.warning("not shown")
    quiet.error("shown")
    assert [r.getMessage() for r in caplog.records if r.name == "iris"] == ["[iris 0/1] shown"]


# -- iris.spawn ---------------------------------------------------------------------------------


def _spawned_rank(rank: int, base: int) -> dict:
    """Runs on each spawned rank: checks torch.distributed and builds a 2-rank iris context; the
    result also carries far more than a pipe holds."""
    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    with iris.create(heap_size="1MiB") as ctx:
        seen = {
            "ctx_rank": ctx.get_rank(),
            "ctx_world": ctx.get_num_ranks(),
            "device": str(ctx.get_device()),
            "bases": len(set(ctx.get_heap_bases().tolist())),
        }
    return {
        "result": base + rank,
        "initialized": dist.is_initialized(),
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "pg_backend": str(dist.get_backend()),
        "sum": int(value.item()),
        "interpret": os.environ.get("TRITON_INTERPRET"),
        "large": str(rank) * 300_000,
        **seen,
    }


def _failing_rank(rank: int) -> int:
    """Rank 1 fails; rank 0 would sleep for minutes, so spawn must stop rank 0 rather than wait
    for it. (Rank 0 does not wait in a collective: its own connection error could then race
    rank 1's exception to be the one reported.)"""
    if rank == 1:
        raise RuntimeError("rank 1 gave up on purpose")
    time.sleep(600)
    return rank


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """:func:`_spawned_rank`'s results on 2 CPU ranks, from one spawn."""
    return iris.spawn(_spawned_rank, 2, 100, device="cpu")


@pytest.mark.slow
def test_spawn_runs_fn_on_cpu_ranks_and_returns_results_by_rank(spawned):
    results = spawned
    assert [r["result"] for r in results] == [100, 101]
    for rank, r in enumerate(results):
        assert r["initialized"] is True
        assert (r["rank"], r["world"]) == (rank, 2)
        assert r["pg_backend"] == "gloo"
        assert r["sum"] == 3  # 1 + 2: the ranks talk to each other
        assert r["interpret"] == "1"
        assert (r["ctx_rank"], r["ctx_world"], r["device"], r["bases"]) == (rank, 2, "cpu", 2)


@pytest.mark.slow
def test_spawn_propagates_a_rank_exception_with_its_traceback(monkeypatch):
    monkeypatch.setenv("IRIS_TIMEOUT", "60")  # were rank 0 left waiting, it gives up in a minute
    with pytest.raises(Exception) as excinfo:
        iris.spawn(_failing_rank, 2, device="cpu")
    text = str(excinfo.value)
    assert "rank 1 gave up on purpose" in text
    assert "Traceback" in text and "_failing_rank" in text


@pytest.mark.parametrize("nprocs", [0, -1, "2", 1.5, None])
def test_spawn_rejects_bad_nprocs(nprocs):
    with pytest.raises(ValueError, match="nprocs must be a positive int"):
        iris.spawn(_failing_rank, nprocs, device="cpu")


def test_spawn_rejects_bad_device():
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        iris.spawn(_failing_rank, 2, device="tpu")


@pytest.mark.slow
def test_spawn_returns_results_larger_than_a_pipe(spawned):
    assert [r["large"] for r in spawned] == ["0" * 300_000, "1" * 300_000]


def test_gluon_device_context_shares_the_triton_methods():
    # One implementation of the device API: Gluon's IrisDeviceCtx carries the very functions of
    # the Triton DeviceContext (compiled in the caller's language), not copies.
    from iris_gluon import IrisDeviceCtx
    from iris_triton.device.context import DeviceContext, DeviceMethods

    shared = [name for name in vars(DeviceMethods) if not name.startswith("_")]
    assert {"load", "store", "get", "put", "copy", "atomic_add", "atomic_cas", "signal", "wait_until"} <= set(shared)
    for name in shared:
        assert getattr(IrisDeviceCtx, name) is vars(DeviceMethods)[name], name
        assert getattr(DeviceContext, name) is vars(DeviceMethods)[name], name


def test_iris_gluon_iris_is_iris_iris_with_the_gluon_backend(monkeypatch):
    import iris_gluon

    calls = []
    monkeypatch.setattr(iris, "iris", lambda heap_size, **kwargs: calls.append((heap_size, kwargs)))
    iris_gluon.iris("2GiB")
    assert calls == [("2GiB", {"backend": "gluon"})]
