"""The symmetric heap across real rank processes, on CPU ranks (POSIX shared memory).

Starting ranks costs seconds, so one worker per world size makes many checks and returns what it
saw; the test then asserts on every rank's report. The worker functions are module-level so that
``iris.spawn`` can pickle them.
"""

from __future__ import annotations

import os
import random
import selectors
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import iris
from iris.errors import AsymmetricHeapError, IrisError, format_bytes
from iris.testing import free_loopback_port

SHM_DIR = "/dev/shm"

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs POSIX shared memory in /dev/shm")


def iris_shm_entries() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("iris-")}


def assert_no_new_iris_segments(before: set[str]) -> None:
    """No iris-* entry of /dev/shm that was not there before remains. Another test run on the
    machine may hold a name for the instant between creating and unlinking its segment, so an
    entry counts as left over only if it is still there a moment later."""
    new = iris_shm_entries() - before
    deadline = time.monotonic() + 3
    while new and time.monotonic() < deadline:
        time.sleep(0.2)
        new &= iris_shm_entries()
    assert not new, f"shared-memory segments left in {SHM_DIR}: {sorted(new)}"


def mapped_iris_segments(pid: str | int = "self") -> list[str]:
    """Lines of /proc/<pid>/maps that map an iris heap (an unnamed memfd)."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line.strip() for line in maps if "/memfd:iris-heap" in line]


# -- one worker, many checks ----------------------------------------------------------------------------


def _peer_data(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """What ``rank`` writes: random, seeded by the writer's rank, so any reader can recompute it."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, (n,), generator=g).to(dtype)


def _heap_worker(rank: int) -> dict:
    ctx = iris.create(heap_size="16MiB", device="cpu")
    world = ctx.world_size
    report: dict = {"rank": rank, "world_size": world}

    # Every peer's segment is mapped here, and once every rank is through create() (each unlinks
    # its own segment on the way out), no name refers to any of them.
    ctx.barrier()
    report["segments"] = mapped_iris_segments()

    # -- heap bases and device context ------------------------------------------------------------
    bases = ctx.get_heap_bases()
    report["bases"] = bases.tolist()
    report["peer_ptrs"] = [p.data_ptr() for p in ctx.heap.mapping.peers]
    report["local_ptr"] = ctx.heap.local.data_ptr()
    report["device_context"] = ctx.get_device_context().tolist()
    report["fail_stop"] = [ctx.timeout_ns, ctx.faults.data_ptr(), ctx.host_faults.data_ptr()]
    report["heap_size"] = ctx.heap_size
    report["bases_meta"] = (str(bases.dtype), str(bases.device), tuple(bases.shape))

    # -- identical offsets for a sequence of allocations ---------------------------------------------
    sequence = [
        ctx.empty(0),
        ctx.zeros(()),
        ctx.ones(17, dtype=torch.float16),
        ctx.randn(3, 5, 7),
        ctx.empty(2, 3, 4, 5, memory_format=torch.channels_last),
        ctx.arange(1000),
        ctx.full((33,), True),
        ctx.empty_like(torch.empty(4, 6).t()),
        ctx.as_symmetric(torch.arange(10.0)),
        ctx.randint(0, 9, (257,), dtype=torch.int8),
        ctx.linspace(0, 1, 100_000, dtype=torch.float64),
    ]
    offsets = [ctx.heap.offset_of(t) for t in sequence]
    report["sequence_offsets"] = ctx.comm.all_gather_object(offsets)
    report["sequence_on_heap"] = all(ctx.is_symmetric(t) for t in sequence)

    # -- peer views: each rank writes its row into every peer's heap --------------------------------
    n = 1001  # odd
    peer_results = {}
    peer_ptrs_ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64):
        buf = ctx.zeros(world, n, dtype=dtype)
        allocated = ctx.zeros(n, world, dtype=dtype)
        strided = allocated.t()  # rows are strided: peer_view keeps strides
        offset = ctx.heap.offset_of(buf)
        mine = _peer_data(rank, dtype, n)
        ctx.barrier()
        for peer in range(world):
            view = ctx.heap.peer_view(buf, peer)
            peer_ptrs_ok &= view.data_ptr() == int(bases[peer]) + offset
            peer_ptrs_ok &= view.stride() == buf.stride() and view.shape == buf.shape
            view[rank].copy_(mine)
            ctx.heap.peer_view(strided, peer)[rank].copy_(mine)
        ctx.barrier()  # every rank has written into every peer
        expected = torch.stack([_peer_data(q, dtype, n) for q in range(world)])
        peer_results[str(dtype)] = (
            torch.equal(buf, expected),
            torch.equal(strided, expected),
            not torch.equal(expected[0], expected[-1]),  # the rows differ: a real test
        )
        ctx.barrier()  # nobody frees (and reuses) while a peer may still read
        ctx.free(allocated)  # the tensor as allocated: free() refuses views such as `strided`
        ctx.free(buf)
    report["peer_results"] = peer_results
    report["peer_ptrs_ok"] = peer_ptrs_ok

    # -- a long random sequence of allocations and frees, the same on every rank --------------------
    allocations_before = ctx.heap.allocator.num_allocations
    rng = random.Random(2024)  # the same seed on every rank: the same calls in the same order
    live: list[tuple[torch.Tensor, int]] = []
    log: list[tuple[str, int]] = []
    dtypes = [torch.int8, torch.int32, torch.float32, torch.float64]
    for i in range(300):
        if live and rng.random() < 0.45:
            t, _ = live.pop(rng.randrange(len(live)))
            log.append(("free", ctx.heap.offset_of(t)))
            ctx.free(t)
        else:
            size = rng.choice([0, 1, 7, 100, 1000, rng.randrange(1, 40_000)])
            value = i % 100
            t = ctx.full((size,), value, dtype=rng.choice(dtypes))
            log.append(("alloc", ctx.heap.offset_of(t)))
            live.append((t, value))
    ctx.barrier()
    report["random_log"] = ctx.comm.all_gather_object(log)
    report["random_live"] = len(live)
    report["random_intact"] = all(bool((t == v).all()) for t, v in live)
    # Every rank filled the same values at the same offsets, so each peer's copy matches too.
    report["random_peers_agree"] = all(
        bool((ctx.heap.peer_view(t, p) == v).all()) for t, v in live for p in range(world)
    )
    report["used_before_free_all"] = ctx.heap.allocator.used_bytes
    ctx.barrier()
    for t, _ in live:
        ctx.free(t)
    report["allocations_left"] = ctx.heap.allocator.num_allocations - allocations_before

    # -- debug mode: an asymmetric allocation fails on every rank ------------------------------------
    dbg = iris.create(heap_size="1MiB", device="cpu", debug=True)
    a = dbg.zeros(5)
    b = dbg.zeros(6)
    errors = {}
    try:
        dbg.empty(10 + rank)  # rank-dependent size
    except AsymmetricHeapError as exc:
        errors["allocate"] = str(exc)
    try:
        dbg.free(a if rank % 2 == 0 else b)  # rank-dependent free
    except AsymmetricHeapError as exc:
        errors["free"] = str(exc)
    symmetric_after_error = dbg.ones(7)  # still usable: the failed calls changed nothing
    errors["offsets_after"] = dbg.comm.all_gather_object(dbg.heap.offset_of(symmetric_after_error))
    report["debug_errors"] = errors
    dbg.destroy()

    # ... and through the environment (IRIS_DEBUG=1).
    os.environ["IRIS_DEBUG"] = "1"
    try:
        env_ctx = iris.create(heap_size="1MiB", device="cpu")
    finally:
        del os.environ["IRIS_DEBUG"]
    report["env_debug"] = env_ctx.config.debug
    try:
        env_ctx.full((3 * (rank + 1),), 1.0)
    except AsymmetricHeapError as exc:
        report["env_debug_error"] = str(exc)
    env_ctx.destroy()

    ctx.destroy()
    return report


@pytest.fixture
def short_timeout(monkeypatch):
    """A rank that hangs fails the test in a minute instead of the default five."""
    monkeypatch.setenv("IRIS_TIMEOUT", "90")
    monkeypatch.delenv("IRIS_DEBUG", raising=False)


@pytest.mark.parametrize("world_size", [2, 3])
def test_symmetric_heap_across_ranks(world_size, short_timeout):
    before = iris_shm_entries()
    reports = iris.spawn(_heap_worker, world_size, device="cpu", start_method="forkserver")
    assert [r["rank"] for r in reports] == list(range(world_size))

    for r in reports:
        rank = r["rank"]
        assert r["world_size"] == world_size
        # Mapping: one segment per rank, every one already unlinked.
        assert len(r["segments"]) == world_size, r["segments"]
        assert all(line.endswith("(deleted)") for line in r["segments"]), r["segments"]
        # Bases and device context.
        assert r["bases"] == r["peer_ptrs"] and r["bases"][rank] == r["local_ptr"]
        assert len(set(r["bases"])) == world_size
        assert r["bases_meta"] == ("torch.int64", "cpu", (world_size,))
        # No trace buffer; the waits' timeout and fault words.
        assert r["device_context"] == [rank, world_size, *r["bases"], r["heap_size"], 0, 0, *r["fail_stop"]]
        # Offsets of the allocation sequence agree on every rank, and are distinct blocks.
        gathered = r["sequence_offsets"]
        assert len(gathered) == world_size and all(g == gathered[0] for g in gathered), gathered
        assert len(set(gathered[0])) == len(gathered[0]) and all(o % 256 == 0 for o in gathered[0])
        assert r["sequence_on_heap"]
        # Data written into peers' heaps arrived.
        assert r["peer_ptrs_ok"]
        for dtype, (dense_ok, strided_ok, rows_differ) in r["peer_results"].items():
            assert dense_ok, f"rank {rank}: peers' rows of {dtype} did not arrive"
            assert strided_ok, f"rank {rank}: peers' strided rows of {dtype} did not arrive"
            assert rows_differ
        # Random alloc/free sequence: the same offsets everywhere, memory intact, blocks reused.
        logs = r["random_log"]
        assert all(log == logs[0] for log in logs)
        allocs = [o for op, o in logs[0] if op == "alloc"]
        assert len(allocs) > 150 and len(logs[0]) == 300
        assert len(set(allocs)) < len(allocs), "freed blocks were never reused"
        assert r["random_live"] > 10 and r["random_intact"] and r["random_peers_agree"]
        assert r["used_before_free_all"] > 0 and r["allocations_left"] == 0
        # Debug mode.
        errors = r["debug_errors"]
        assert "allocate" in errors and "free" in errors, f"rank {rank}: no AsymmetricHeapError: {errors}"
        assert "allocate(" in errors["allocate"] and "call #" in errors["allocate"]
        assert f"({10 + rank},)" in errors["allocate"]  # names this rank's call...
        assert "rank 0" in errors["allocate"] and f"rank {world_size - 1}" in errors["allocate"]  # ...and all
        assert "free(" in errors["free"]
        assert len(set(errors["offsets_after"])) == 1
        assert r["env_debug"] is True
        assert "allocate(" in r.get("env_debug_error", ""), "IRIS_DEBUG=1 did not check symmetry"

    # Every rank reports the same error text: all failed on the same call.
    assert len({r["debug_errors"]["allocate"] for r in reports}) == 1
    assert_no_new_iris_segments(before)


# -- killed ranks leave nothing behind --------------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent(
    """
    import time

    import iris

    ctx = iris.create(heap_size="8MiB", device="cpu")
    t = ctx.ones(1000)
    ctx.barrier()
    print("READY", flush=True)
    time.sleep(600)
    """
)


def _wait_for_ready(procs: list[subprocess.Popen], timeout: float) -> None:
    selector = selectors.DefaultSelector()
    for proc in procs:
        selector.register(proc.stdout, selectors.EVENT_READ, proc)
    waiting = set(procs)
    deadline = time.monotonic() + timeout
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("ranks did not print READY in time")
        for key, _ in selector.select(left):
            line = key.fileobj.readline()
            if not line:
                raise AssertionError(f"rank {key.data.pid} exited before READY (rc {key.data.wait()})")
            if line.strip() == "READY":
                waiting.discard(key.data)
                selector.unregister(key.fileobj)


def test_sigkilled_ranks_leave_no_segments(tmp_path):
    world_size = 2
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    common = {k: v for k, v in os.environ.items() if not k.startswith("IRIS_")}
    common.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_loopback_port()), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), TRITON_INTERPRET="1", IRIS_TIMEOUT="90",
    )
    before = iris_shm_entries()
    procs = []
    try:
        for rank in range(world_size):
            env = dict(common, RANK=str(rank), LOCAL_RANK=str(rank))
            log = open(tmp_path / f"rank{rank}.err", "w")
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                          stdout=subprocess.PIPE, stderr=log, text=True))
            log.close()
        try:
            _wait_for_ready(procs, timeout=180)
        except AssertionError:
            errs = "\n".join((tmp_path / f"rank{r}.err").read_text()[-2000:] for r in range(world_size))
            raise AssertionError(f"ranks did not come up:\n{errs}") from None
        # While the ranks run: each maps both segments, and no name refers to either already.
        for proc in procs:
            segments = mapped_iris_segments(proc.pid)
            assert len(segments) == world_size and all(s.endswith("(deleted)") for s in segments), segments
        assert_no_new_iris_segments(before)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # SIGKILL: no Python clean-up runs
        for proc in procs:
            proc.wait(timeout=60)
    assert all(proc.returncode == -9 for proc in procs), [proc.returncode for proc in procs]
    assert_no_new_iris_segments(before)


# -- /dev/shm too small ------------------------------------------------------------------------------


def test_heap_larger_than_dev_shm_is_a_clear_error(ctx, monkeypatch):
    # ``ctx`` makes sure the process group exists in the form the session's context wants.
    if ctx.device.type != "cpu":
        pytest.skip("a CPU context needs Triton's interpreter from the process's start; this one runs GPU kernels")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    stats = os.statvfs(SHM_DIR)
    free = stats.f_bavail * stats.f_frsize
    heap_size = free + (1 << 30)
    before = iris_shm_entries()
    with pytest.raises(IrisError) as info:
        iris.create(heap_size=heap_size, device="cpu")
    message = str(info.value)
    assert SHM_DIR in message
    assert format_bytes(heap_size) in message  # the heap asked for
    assert "free" in message and "heap_size" in message  # the space there, and the fix
    assert "--shm-size" in message
    assert_no_new_iris_segments(before)
