"""Upstream iris's host-side names: ``iris.hip``, ``iris.device_utils``, ``iris.timing.do_bench``,
``iris.logging``, and the tensor constructors' upstream forms and errors.

Single rank, in process (the session ``ctx``), on the GPU when one is visible, else on the CPU with
kernels in Triton's interpreter; the import side effects are checked in fresh interpreters.
"""

from __future__ import annotations

import importlib
import logging
import os
import random
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch
import triton
import triton.language as tl

import iris
import iris.hip as hip
from iris.device_utils import get_cu_id, get_se_id, get_xcc_id, read_realtime
from iris.errors import BackendNotFoundError, NotOnHeapError

pytestmark = pytest.mark.usefixtures("free_heap_after")

HAS_CUDA = torch.cuda.is_available()




def gen(ctx, seed: int) -> torch.Generator:
    return torch.Generator(device=ctx.device).manual_seed(seed)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (this one's environment plus ``env``); it must succeed."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TRITON_INTERPRET": "1", **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


# -- iris.hip -------------------------------------------------------------------------------------


def test_hip_imports_without_gpu_process_group_or_triton():
    # No GPU visible, no process group, and Triton is not imported by it.
    out = run_python(
        "import os, sys, torch\n"
        "import iris.hip as hip\n"
        "assert 'triton' not in sys.modules, 'iris.hip imported Triton'\n"
        "assert not torch.distributed.is_initialized()\n"
        "print(hip.count_devices(), hip.get_device_id(), hip.get_cu_count(), hip.get_cu_count(0),\n"
        "      hip.get_num_xcc(), hip.get_arch_string(), hip.get_wall_clock_rate(5), hip.get_rocm_version(),\n"
        "      len(os.sched_getaffinity(0)))\n"
        "hip.set_device(0)\n",
        CUDA_VISIBLE_DEVICES="",
    ).stdout.split()
    cores = out[-1]
    assert out[:-1] == ["1", "0", cores, cores, "1", "cpu", "1000000", "(-1,", "-1)"]


@pytest.mark.parametrize("name", sorted(hip.AMD_ONLY))
def test_hip_amd_only_calls_import_and_raise_naming_the_call(name):
    # Upstream's HIP/ROCr-only calls import (a program that names them still loads) and raise,
    # when called, NotImplementedError naming the call and what it was for.
    call = getattr(hip, name)
    assert call.__name__ == name
    with pytest.raises(NotImplementedError, match=rf"iris\.hip\.{name} is {re.escape(hip.AMD_ONLY[name])}, which only "
                                                  r"HIP/ROCr provides \(AMD GPUs\)"):
        call(0, 1)


def test_hip_names_nothing_else_it_lacks():
    with pytest.raises(AttributeError, match="module 'iris.hip' has no attribute 'mem_create_typo'"):
        hip.mem_create_typo  # noqa: B018


@pytest.mark.skipif(not HAS_CUDA, reason="address ranges are those of CUDA allocations")
def test_hip_get_address_range_finds_the_allocation_of_a_tensor():
    whole = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    base, size = hip.get_address_range(whole[4096:].data_ptr())
    assert base <= whole.data_ptr() and whole.data_ptr() + whole.numel() <= base + size


@pytest.mark.skipif(HAS_CUDA, reason="CPU ranks")
def test_hip_get_address_range_says_why_without_a_gpu():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        hip.get_address_range(torch.zeros(4).data_ptr())


def test_hip_answers_for_this_machine():
    if HAS_CUDA:
        assert hip.count_devices() == torch.cuda.device_count()
        assert hip.get_device_id() == torch.cuda.current_device()
        for device in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(device)
            assert hip.get_cu_count(device) == props.multi_processor_count
            assert hip.get_arch_string(device) == f"sm_{props.major}{props.minor}"
        assert hip.get_cu_count() == torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    else:
        assert (hip.count_devices(), hip.get_device_id(), hip.get_arch_string()) == (1, 0, "cpu")
        assert hip.get_cu_count() == hip.get_cu_count(0) == len(os.sched_getaffinity(0))
    hip.set_device(hip.get_device_id())
    assert hip.get_device_id() == (torch.cuda.current_device() if HAS_CUDA else 0)


def test_hip_num_xcc_is_a_stable_int():
    first = hip.get_num_xcc()
    assert type(first) is int and first == 1
    assert all(hip.get_num_xcc() == first for _ in range(10))
    assert hip.get_num_xcc(hip.get_device_id()) == 1


def test_hip_wall_clock_rate_and_rocm_version():
    # kHz of a nanosecond clock: rate * 1e-3 ticks per microsecond, as upstream programs compute.
    for device in (0, 1, 7):
        assert hip.get_wall_clock_rate(device) == 1_000_000
    assert hip.get_rocm_version() == (-1, -1)
    for bad in (-1, "0", 1.0, True):
        with pytest.raises(ValueError):
            hip.get_wall_clock_rate(bad)


def test_hip_rejects_devices_that_are_not_there():
    missing = hip.count_devices()
    for call in (hip.set_device, hip.get_cu_count, hip.get_arch_string, hip.get_num_xcc):
        with pytest.raises(ValueError, match=f"device_id={missing}"):
            call(missing)
        with pytest.raises(ValueError):
            call(-1)
        with pytest.raises(TypeError):
            call("0")


# -- iris.device_utils ----------------------------------------------------------------------------


def test_device_utils_reexports_the_triton_backend():
    import iris.device_utils as device_utils
    import iris_triton.device.utils as backend

    for name in ("read_realtime", "get_cu_id", "get_xcc_id", "get_se_id"):
        assert getattr(device_utils, name) is getattr(backend, name)
    assert sorted(device_utils.__all__) == sorted(backend.__all__)


def test_device_utils_without_the_triton_backend(monkeypatch):
    """``iris.device_utils`` is the Triton backend's module: without that backend installed, its
    import names the distribution to install."""
    from iris.registry import backends

    monkeypatch.delitem(sys.modules, "iris.device_utils", raising=False)
    with backends.restored():
        backends._entries.pop("triton")  # as if iris-triton were not installed
        backends._loaded.pop("triton", None)
        with pytest.raises(BackendNotFoundError, match="pip install iris-triton"):
            importlib.import_module("iris.device_utils")


@triton.jit
def clocks(out, wait_ns):
    """Per program: the clock, a spin of at least ``wait_ns``, the clock again, and the ids."""
    pid = tl.program_id(0)
    first = read_realtime()
    while read_realtime() - first < wait_ns:
        pass
    second = read_realtime()
    tl.store(out + pid * 5 + 0, first)
    tl.store(out + pid * 5 + 1, second)
    tl.store(out + pid * 5 + 2, get_cu_id().to(tl.int64))
    tl.store(out + pid * 5 + 3, get_xcc_id().to(tl.int64))
    tl.store(out + pid * 5 + 4, get_se_id().to(tl.int64))


if HAS_CUDA:  # Gluon compiles for GPUs only (it has no interpreter)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def gluon_clocks(out, wait_ns):
        """As :func:`clocks`, in a Gluon kernel: it calls the same Triton jit functions."""
        pid = gl.program_id(0)
        first = read_realtime()
        while read_realtime() - first < wait_ns:
            pass
        second = read_realtime()
        gl.store(out + pid * 5 + 0, first)
        gl.store(out + pid * 5 + 1, second)
        gl.store(out + pid * 5 + 2, get_cu_id().to(gl.int64))
        gl.store(out + pid * 5 + 3, get_xcc_id().to(gl.int64))
        gl.store(out + pid * 5 + 4, get_se_id().to(gl.int64))


@pytest.mark.gpu
def test_read_realtime_and_ids_in_a_gluon_kernel():
    programs, wait_ns = 4, 200_000
    out = torch.zeros(programs, 5, dtype=torch.int64, device="cuda")
    gluon_clocks[(programs,)](out, wait_ns, num_warps=1)
    torch.cuda.synchronize()
    first, second, cu, xcc, se = out.cpu().T.tolist()
    assert all(0 < t0 and t1 - t0 >= wait_ns for t0, t1 in zip(first, second))
    assert all(0 <= c < hip.get_cu_count() for c in cu)
    assert xcc == [0] * programs and se == [0] * programs


def test_read_realtime_and_ids_in_a_kernel(ctx):
    programs, wait_ns = 4, 200_000
    out = torch.zeros(programs, 5, dtype=torch.int64, device=ctx.device)
    clocks[(programs,)](out, wait_ns)  # compiled (or interpreted) once before timing
    if HAS_CUDA:
        torch.cuda.synchronize()
    before = time.monotonic_ns()
    clocks[(programs,)](out, wait_ns)
    if HAS_CUDA:
        torch.cuda.synchronize()
    after = time.monotonic_ns()
    first, second, cu, xcc, se = out.cpu().T.tolist()
    for t0, t1 in zip(first, second):
        assert 0 < t0 < t1
        assert t1 - t0 >= wait_ns  # the clock advanced in nanoseconds while the program spun
        assert t1 - t0 <= after - before  # ... and by no more than the launch took on the host
    assert xcc == [0] * programs and se == [0] * programs
    if HAS_CUDA:
        assert all(0 <= c < hip.get_cu_count() for c in cu)
    else:
        # The interpreter reads the host's monotonic clock: the same one as time.monotonic_ns().
        assert before <= min(first) and max(second) <= after
        assert first == sorted(first)  # programs run one after another
        assert cu == [0] * programs


# -- iris.timing.do_bench -------------------------------------------------------------------------


def test_do_bench_call_sequence():
    from iris.timing import do_bench

    events = []
    n_warmup, n_repeat = 3, 5
    do_bench(lambda: events.append("fn"), barrier_fn=lambda: events.append("barrier"),
             preamble_fn=lambda: events.append("preamble"), n_warmup=n_warmup, n_repeat=n_repeat)
    iteration = ["barrier", "preamble", "barrier", "fn"]
    assert events == ["barrier", "preamble", "fn", "barrier"] + iteration * (n_warmup + n_repeat) + ["barrier"]
    assert events.count("fn") == events.count("preamble") == 1 + n_warmup + n_repeat
    assert events.count("barrier") == 3 + 2 * (n_warmup + n_repeat)


def test_do_bench_defaults_run_25_warmup_and_100_timed_calls():
    from iris.timing import do_bench

    calls = []
    times = do_bench(lambda: calls.append(1), return_mode="all")
    assert len(calls) == 1 + 25 + 100
    assert len(times) == 100 and all(isinstance(t, float) and t >= 0 for t in times)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_do_bench_return_modes_and_quantiles(monkeypatch, seed):
    import iris.timing as timing

    # A scripted clock: each call of fn lasts a known random time, so the results are exact.
    rng = random.Random(seed)
    n_warmup, n_repeat = rng.randint(0, 4), rng.randint(1, 40)
    durations = [rng.uniform(0.0001, 0.05) for _ in range(1 + n_warmup + n_repeat)]
    clock = {"now": 1000.0, "calls": 0}

    def fn():
        clock["now"] += durations[clock["calls"] % len(durations)]
        clock["calls"] += 1

    monkeypatch.setattr(timing, "perf_counter", lambda: clock["now"])
    timed_ms = [d * 1e3 for d in durations[-n_repeat:]]

    def bench(**kwargs):
        clock["calls"] = 0
        return timing.do_bench(fn, n_warmup=n_warmup, n_repeat=n_repeat, device="cpu", **kwargs)

    assert bench(return_mode="all") == pytest.approx(timed_ms, rel=1e-9)
    assert bench() == pytest.approx(statistics.mean(timed_ms), rel=1e-9)
    assert bench(return_mode="mean") == pytest.approx(statistics.mean(timed_ms), rel=1e-9)
    assert bench(return_mode="min") == pytest.approx(min(timed_ms), rel=1e-9)
    assert bench(return_mode="max") == pytest.approx(max(timed_ms), rel=1e-9)
    assert bench(return_mode="median") == pytest.approx(statistics.median(timed_ms), rel=1e-9)
    qs = sorted(rng.random() for _ in range(3))
    expected = torch.quantile(torch.tensor(timed_ms, dtype=torch.float64), torch.tensor(qs, dtype=torch.float64))
    got = bench(quantiles=qs, return_mode="max")  # quantiles win over return_mode
    assert isinstance(got, list) and got == pytest.approx(expected.tolist(), rel=1e-9)
    one = bench(quantiles=[0.5])
    assert isinstance(one, float) and one == pytest.approx(statistics.median(timed_ms), rel=1e-9)


def test_do_bench_refuses_bad_arguments_before_running():
    from iris.timing import do_bench

    calls = []
    for kwargs, match in [(dict(return_mode="average"), "return_mode"), (dict(n_repeat=0), "n_repeat"),
                          (dict(n_warmup=-1), "n_warmup"), (dict(quantiles=[0.5, 1.5]), "quantiles")]:
        with pytest.raises(ValueError, match=match):
            do_bench(lambda: calls.append(1), **kwargs)
    assert calls == []


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_do_bench_times_a_known_sleep_in_milliseconds(device):
    from iris.timing import do_bench

    sleep_ms = 20.0
    times = do_bench(lambda: time.sleep(sleep_ms / 1e3), n_warmup=1, n_repeat=5, return_mode="all", device=device)
    assert len(times) == 5
    # At least the sleep (GPU events: to within their resolution), and not absurdly more on a loaded machine.
    assert min(times) >= sleep_ms * (0.95 if device == "cuda" else 1.0)
    assert statistics.median(times) < sleep_ms + 500.0


# -- iris.logging ---------------------------------------------------------------------------------


def test_logging_levels_and_logger():
    import iris.logging as iris_logging

    assert (iris_logging.DEBUG, iris_logging.INFO, iris_logging.WARNING, iris_logging.ERROR) == (
        logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)
    assert iris_logging.logger is logging.getLogger("iris")
    assert iris_logging.logger.name == "iris"


def test_iris_logging_does_not_shadow_the_stdlib_module():
    import iris.logging as iris_logging
    import iris.mixins.logging as mixin

    assert iris_logging is not logging
    assert mixin.logging is logging and iris_logging.logging is logging
    assert logging.__name__ == "logging" and mixin.logging.getLogger("iris") is iris_logging.logger


def test_set_logger_level():
    from iris.logging import DEBUG, INFO, WARNING, logger, set_logger_level

    saved = logger.level
    try:
        for level in (DEBUG, WARNING, INFO):
            set_logger_level(level)
            assert logger.level == level
            assert logger.isEnabledFor(logging.INFO) == (level <= INFO)
    finally:
        logger.setLevel(saved)


def test_importing_iris_logging_configures_the_logger():
    # A fresh interpreter: the handler, its formatter and the level, then what lines come out.
    err = run_python(
        "import logging\n"
        "from iris.logging import IrisFormatter, logger, set_logger_level, DEBUG\n"
        "assert logger.level == logging.INFO, logger.level\n"
        "assert type(logger.handlers[0]) is logging.StreamHandler\n"
        "assert isinstance(logger.handlers[0].formatter, IrisFormatter)\n"
        "logger.info('shown at info'); logger.debug('hidden at info')\n"
        "set_logger_level(DEBUG); logger.debug('shown at debug')\n"
        "import iris\n"
        "ctx = iris.create(heap_size='4MiB', device='cpu')\n"
        "ctx.info('from %s', 'the context')\n"
        "ctx.destroy()\n",
        CUDA_VISIBLE_DEVICES="",
    ).stderr.splitlines()
    assert "[Iris] shown at info" in err and "[Iris] shown at debug" in err
    assert not any("hidden at info" in line for line in err)
    assert "[Iris] [0/1] from the context" in err  # the rank once, in upstream's form
    assert not any("[iris 0/1]" in line for line in err)


def test_importing_iris_logging_keeps_a_configured_logger():
    out = run_python(
        "import logging\n"
        "handler = logging.StreamHandler(); logging.getLogger('iris').addHandler(handler)\n"
        "logging.getLogger('iris').setLevel(logging.ERROR)\n"
        "import iris.logging as l\n"
        "print(l.logger.handlers == [handler], l.logger.level == logging.ERROR)\n"
    ).stdout.split()
    assert out == ["True", "True"]


def _record(msg, args=(), **attrs):
    record = logging.LogRecord("iris", logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(attrs)
    return record


def test_iris_formatter():
    from iris.logging import IrisFormatter

    formatter = IrisFormatter()
    assert formatter.format(_record("Test message without rank")) == "[Iris] Test message without rank"
    assert formatter.format(_record("Test message with rank", iris_rank=2, iris_num_ranks=4)) == (
        "[Iris] [2/4] Test message with rank")
    assert formatter.format(_record("allocate: num_elements = %d, dtype = %s", (100, None), iris_rank=0,
                                    iris_num_ranks=1)) == "[Iris] [0/1] allocate: num_elements = 100, dtype = None"
    # Only one of the two attributes is not a rank.
    assert formatter.format(_record("half", iris_rank=3)) == "[Iris] half"
    # A context's own prefix is dropped, only where it is the recorded one.
    assert formatter.format(_record("[iris 1/2] x", iris_rank=1, iris_num_ranks=2, iris_prefix="[iris 1/2] ")) == (
        "[Iris] [1/2] x")
    assert formatter.format(_record("[iris 1/2] x", iris_rank=1, iris_num_ranks=2)) == "[Iris] [1/2] [iris 1/2] x"
    try:
        raise KeyError("boom")
    except KeyError:
        record = _record("failed", iris_rank=0, iris_num_ranks=1)
        record.exc_info = sys.exc_info()
    text = formatter.format(record)
    assert text.startswith("[Iris] [0/1] failed\nTraceback") and "KeyError: 'boom'" in text


def test_context_records_carry_upstreams_rank_attributes(ctx):
    from iris.logging import IrisFormatter

    logger = logging.getLogger("iris")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler, saved = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        ctx.info("value %d", 7)
        ctx.warning("plain")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
    rank, world = ctx.rank, ctx.world_size
    assert [r.getMessage() for r in records] == [f"[iris {rank}/{world}] value 7", f"[iris {rank}/{world}] plain"]
    assert all((r.iris_rank, r.iris_num_ranks, r.rank, r.world_size) == (rank, world, rank, world) for r in records)
    assert [IrisFormatter().format(r) for r in records] == [f"[Iris] [{rank}/{world}] value 7",
                                                            f"[Iris] [{rank}/{world}] plain"]


# -- tensor constructors: upstream's forms ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_upstream_positional_form(ctx, seed):
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
    low = rng.uniform(-5, 0)
    high = low + rng.uniform(0.5, 5)
    expected = torch.empty(shape, device=ctx.device).uniform_(low, high, generator=gen(ctx, seed))
    for size in (shape, list(shape), torch.Size(shape), (shape,)):
        got = ctx.uniform(size, low, high, generator=gen(ctx, seed))
        assert ctx.is_symmetric(got) and got.shape == shape and got.dtype == torch.get_default_dtype()
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        assert bool(((got >= low) & (got < high)).all())
    # Only low positional: high stays its default (or its keyword).
    got = ctx.uniform(shape, -3.0, generator=gen(ctx, seed))
    torch.testing.assert_close(got, torch.empty(shape, device=ctx.device).uniform_(-3.0, 1.0, generator=gen(ctx, seed)))
    got = ctx.uniform(shape, -3.0, high=7.0, generator=gen(ctx, seed))
    torch.testing.assert_close(got, torch.empty(shape, device=ctx.device).uniform_(-3.0, 7.0, generator=gen(ctx, seed)))


def test_uniform_upstream_form_with_an_int_size(ctx):
    for args, shape, (low, high) in [((6, -1.0, 1.0), (6,), (-1.0, 1.0)), ((6, -2, 3.5), (6,), (-2, 3.5)),
                                     ((7, 2.0), (7,), (2.0, 1.0 + 2.0))]:
        kwargs = {"high": 3.0} if len(args) == 2 else {}
        got = ctx.uniform(*args, generator=gen(ctx, 11), **kwargs)
        expected = torch.empty(shape, device=ctx.device).uniform_(low, high, generator=gen(ctx, 11))
        assert got.shape == shape
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_uniform_torch_form_is_unchanged(ctx):
    got = ctx.uniform(4, 5, generator=gen(ctx, 3))
    torch.testing.assert_close(got, torch.empty(4, 5, device=ctx.device).uniform_(0.0, 1.0, generator=gen(ctx, 3)),
                               rtol=0, atol=0)
    got = ctx.uniform((4, 5), low=-1.0, high=1.0, generator=gen(ctx, 3))
    torch.testing.assert_close(got, torch.empty(4, 5, device=ctx.device).uniform_(-1.0, 1.0, generator=gen(ctx, 3)),
                               rtol=0, atol=0)
    assert ctx.uniform(2, 3, 4).shape == (2, 3, 4)  # ints: always a size


def test_uniform_bounds_given_twice_is_type_error(ctx):
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(TypeError, match="low"):
        ctx.uniform((2, 2), 0.0, low=1.0)
    with pytest.raises(TypeError, match="high"):
        ctx.uniform((2, 2), 0.0, 1.0, high=2.0)
    assert ctx.heap.allocator.used_bytes == used


@pytest.mark.parametrize("name", ["empty", "zeros", "ones", "rand", "randn"])
def test_nested_singleton_sizes(ctx, name):
    shape = (2, 3, 4)
    for size in [shape, (shape,), ((shape,),), ([list(shape)],), (torch.Size(shape),)]:
        random_kw = (lambda: {"generator": gen(ctx, 5)}) if name in ("rand", "randn") else dict
        got = getattr(ctx, name)(*size, **random_kw())
        assert got.shape == shape and ctx.is_symmetric(got)
        if name != "empty":
            expected = getattr(torch, name)(*shape, device=ctx.device, **random_kw())
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert getattr(ctx, name)(((),)).shape == ()
    assert getattr(ctx, name)(()).shape == () and getattr(ctx, name)(0).shape == (0,)


def test_nested_sizes_of_full_randint_and_linspace_steps(ctx):
    for size in [(2, 3), [2, 3], ((2, 3),), [[2, 3]], (((2, 3),),)]:
        torch.testing.assert_close(ctx.full(size, 7), torch.full((2, 3), 7, device=ctx.device), rtol=0, atol=0)
        torch.testing.assert_close(ctx.randint(0, 10, size, generator=gen(ctx, 1)),
                                   torch.randint(0, 10, (2, 3), generator=gen(ctx, 1), device=ctx.device),
                                   rtol=0, atol=0)
        torch.testing.assert_close(ctx.randint(10, size=size, generator=gen(ctx, 1)),
                                   torch.randint(10, (2, 3), generator=gen(ctx, 1), device=ctx.device),
                                   rtol=0, atol=0)
    for steps in [5, (5,), [5], ((5,),)]:
        torch.testing.assert_close(ctx.linspace(0.0, 1.0, steps), torch.linspace(0.0, 1.0, 5, device=ctx.device))


# -- tensor constructors: dtypes ------------------------------------------------------------------


@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_dtype_inference_like_upstream_and_torch(ctx, default):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        for fill in (0, 1, -1, 42, -100):
            assert ctx.full((2, 2), fill).dtype == torch.int64
        for fill in (3.141592, -2.718, 0.5, -0.25):
            got = ctx.full((2, 2), fill)
            assert got.dtype == default and bool((got == torch.tensor(fill, dtype=default)).all())
        assert ctx.full((2, 2), 3.14, dtype=torch.int32).tolist() == [[3, 3], [3, 3]]
        assert ctx.zeros(2, 3).dtype == default and ctx.rand(2).dtype == default
        assert ctx.linspace(0.0, 1.0, 5).dtype == default
        assert ctx.arange(5).dtype == torch.int64 and ctx.arange(1, 4).tolist() == [1, 2, 3]
        got = ctx.arange(1, 2.5, 0.5)
        assert got.dtype == default and got.tolist() == [1.0, 1.5, 2.0]
        assert ctx.randint(0, 10, (2, 3)).dtype == torch.int64
        got = ctx.randint(0, 10, (2, 2), dtype=torch.float32, requires_grad=True)
        assert got.dtype == torch.float32 and got.requires_grad
    finally:
        torch.set_default_dtype(saved)


def test_arange_values_like_torch(ctx):
    for args in [(5,), (1, 4), (1, 2.5, 0.5), (5, 0, -1), (0, 1, 0.1), (1000,), (0, 10, 2), (1.0, 2.0, 0.25)]:
        torch.testing.assert_close(ctx.arange(*args), torch.arange(*args, device=ctx.device), rtol=0, atol=0)
    for dtype in (torch.int64, torch.float32, torch.float64):
        got = ctx.arange(start=0, end=5, step=1, dtype=dtype)
        torch.testing.assert_close(got, torch.arange(start=0, end=5, step=1, dtype=dtype, device=ctx.device))
    assert ctx.arange(0, 1, 0.1).shape == (10,)


def test_linspace_complex_bounds_like_torch(ctx):
    got = ctx.linspace(0.0 + 0.0j, 1.0 + 1.0j, 5)
    assert got.dtype == torch.complex64
    torch.testing.assert_close(got, torch.linspace(0j, 1 + 1j, 5, device=ctx.device))
    # 0-d tensor bounds, real and complex: the dtype torch itself infers (not the meta device's).
    for start, end in [(0j, 1 + 1j), (0.0, 1.0), (-2.5, 4.0)]:
        start_t, end_t = torch.tensor(start, device=ctx.device), torch.tensor(end, device=ctx.device)
        got = ctx.linspace(start_t, end_t, 5)
        expected = torch.linspace(start_t, end_t, 5, device=ctx.device)
        assert got.dtype == expected.dtype and ctx.is_symmetric(got)
        torch.testing.assert_close(got, expected)


# -- tensor constructors: upstream's errors -------------------------------------------------------


def _every_constructor(ctx, **kw):
    like = torch.zeros(2, 3, device=ctx.device)
    return {
        "zeros": lambda: ctx.zeros(2, 3, **kw), "ones": lambda: ctx.ones(2, 3, **kw),
        "empty": lambda: ctx.empty(2, 3, **kw), "full": lambda: ctx.full((2, 3), 1.5, **kw),
        "rand": lambda: ctx.rand(2, 3, **kw), "randn": lambda: ctx.randn(2, 3, **kw),
        "randint": lambda: ctx.randint(0, 10, (2, 3), **kw), "arange": lambda: ctx.arange(6, **kw),
        "linspace": lambda: ctx.linspace(0.0, 1.0, 5, **kw), "uniform": lambda: ctx.uniform((2, 3), 0.0, 1.0, **kw),
        "zeros_like": lambda: ctx.zeros_like(like, **kw),
    }


@pytest.mark.parametrize("name", ["zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange",
                                  "linspace", "uniform", "zeros_like"])
def test_layout_strided_and_sparse(ctx, name):
    got = _every_constructor(ctx, layout=torch.strided)[name]()
    assert got.layout == torch.strided and ctx.is_symmetric(got)
    used = ctx.heap.allocator.used_bytes
    for error in (ValueError, RuntimeError):  # upstream's type, and torch-convention code's
        with pytest.raises(error, match="layout"):
            _every_constructor(ctx, layout=torch.sparse_coo)[name]()
    assert ctx.heap.allocator.used_bytes == used


@pytest.mark.parametrize("name", ["zeros", "ones", "full", "rand", "randint", "arange", "linspace", "uniform"])
def test_another_device_is_runtime_error(ctx, name):
    other = "cpu" if ctx.device.type == "cuda" else "cuda"
    with pytest.raises(RuntimeError):
        _every_constructor(ctx, device=other)[name]()
    for same in (None, ctx.device, str(ctx.device), ctx.device.type):
        got = _every_constructor(ctx, device=same)[name]()
        assert str(got.device) == str(ctx.device)


def test_out_errors_have_upstreams_messages(ctx):
    wrong_size, wrong_dtype, float_out, short_out = (ctx.empty(4), ctx.empty(9, dtype=torch.int32), ctx.empty(9),
                                                     ctx.empty(3))
    plain = torch.zeros(3, 3, device=ctx.device)
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(RuntimeError, match="The output tensor has 4 elements, but 9 are required"):
        ctx.zeros(3, 3, out=wrong_size)
    with pytest.raises(RuntimeError, match="The output tensor has dtype torch.int32, but torch.float32 is required"):
        ctx.zeros(3, 3, dtype=torch.float32, out=wrong_dtype)
    for error in (RuntimeError, NotOnHeapError):
        with pytest.raises(error, match="The output tensor is not on the symmetric heap"):
            ctx.zeros(3, 3, out=plain)
    with pytest.raises(RuntimeError, match="dtype torch.float32, but torch.int32 is required"):
        ctx.randint(0, 10, (3, 3), dtype=torch.int32, out=float_out)
    with pytest.raises(RuntimeError, match="3 elements, but 5 are required"):
        ctx.linspace(0.0, 1.0, 5, out=short_out)
    assert bool((plain == 0).all())
    assert ctx.heap.allocator.used_bytes == used, "a refused out= call allocated"


@pytest.mark.parametrize("seed", [0, 1])
def test_out_with_as_many_elements_gets_the_result_through_a_view(ctx, seed):
    out = ctx.full((9,), 5.0)
    got = ctx.zeros(3, 3, out=out)
    assert got.shape == (3, 3) and got.data_ptr() == out.data_ptr() and ctx.is_symmetric(got)
    assert bool((out == 0).all()) and out.shape == (9,)  # out keeps its shape: it stays freeable
    got = ctx.randint(0, 10, (2, 3), out=ctx.empty(6, dtype=torch.int64), generator=gen(ctx, seed))
    torch.testing.assert_close(got, torch.randint(0, 10, (2, 3), generator=gen(ctx, seed), device=ctx.device),
                               rtol=0, atol=0)
    got = ctx.rand(2, 3, out=ctx.empty(6), generator=gen(ctx, seed))
    torch.testing.assert_close(got, torch.rand(2, 3, generator=gen(ctx, seed), device=ctx.device), rtol=0, atol=0)
    ctx.free(out)
    # Not contiguous: it cannot be viewed as the result's shape.
    with pytest.raises(RuntimeError, match="contiguous"):
        ctx.zeros(6, out=ctx.empty(3, 2).t())


def test_out_of_arange_is_returned_itself(ctx):
    out = ctx.empty(3, dtype=torch.int64)
    assert ctx.arange(3, out=out) is out and out.tolist() == [0, 1, 2]
    out = ctx.empty(3, dtype=torch.float32)
    assert ctx.arange(3, dtype=torch.float32, out=out) is out and out.tolist() == [0.0, 1.0, 2.0]


def test_randint_argument_errors(ctx):
    used = ctx.heap.allocator.used_bytes
    for args in [(10,), (0, 10, (2, 3), (4, 5)), ()]:
        for error in (ValueError, TypeError):
            with pytest.raises(error, match="randint takes"):
                ctx.randint(*args)
    with pytest.raises(RuntimeError):
        ctx.randint(10, 5, (2, 3))  # low >= high: torch's own error
    assert ctx.heap.allocator.used_bytes == used
    for low, high in [(5, 15), (-10, -5), (0, 1), (42, 43)]:
        got = ctx.randint(low, high, (100,), generator=gen(ctx, 9))
        torch.testing.assert_close(got, torch.randint(low, high, (100,), generator=gen(ctx, 9), device=ctx.device),
                                   rtol=0, atol=0)
        assert int(got.min()) >= low and int(got.max()) < high
    got = ctx.randint(10, (2, 3), generator=gen(ctx, 4))
    torch.testing.assert_close(got, torch.randint(10, (2, 3), generator=gen(ctx, 4), device=ctx.device),
                               rtol=0, atol=0)


def test_arange_argument_errors(ctx):
    used = ctx.heap.allocator.used_bytes
    with pytest.raises(ValueError, match="step must be non-zero"):
        ctx.arange(1, 5, 0)
    with pytest.raises(RuntimeError, match="step must be non-zero"):
        ctx.arange(1, 5, 0)
    for args in [(5, 1), (1, 5, -1)]:
        for error in (ValueError, RuntimeError):
            with pytest.raises(error, match="inconsistent with step sign"):
                ctx.arange(*args)
    assert ctx.heap.allocator.used_bytes == used


# -- the names at the top of iris -----------------------------------------------------------------


def test_upstream_names_from_the_top_of_iris():
    import iris
    import iris.device_utils
    import iris.logging as iris_logging
    import iris.timing
    from iris import DEBUG, ERROR, INFO, WARNING, do_bench, logger, set_logger_level

    assert (DEBUG, INFO, WARNING, ERROR) == (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)
    assert logger is iris_logging.logger and set_logger_level is iris_logging.set_logger_level
    assert do_bench is iris.timing.do_bench
    assert iris.hip is hip and iris.device_utils.read_realtime is read_realtime


def test_import_iris_alone_leaves_logging_alone_and_answers_hip():
    # Upstream programs call iris.hip.get_num_xcc() at import time, before any process group.
    out = run_python(
        "import logging, sys, torch\n"
        "import iris\n"
        "print(iris.hip.get_num_xcc(), torch.distributed.is_initialized(), 'triton' in sys.modules,\n"
        "      logging.getLogger('iris').handlers, logging.getLogger('iris').level)\n"
    ).stdout.split()
    assert out == ["1", "False", "False", "[]", "0"]


# -- iris.iris contexts' constructors synchronise the ranks (upstream's allocations do) --------------------


def _late_allocation_worker(rank: int) -> dict:
    ctx = iris.iris(1 << 20)
    seen = {}
    for round_ in range(3):
        if rank == round_ % 2:
            time.sleep(0.5)  # this rank reaches the constructor late
        mine = ctx.full((64,), 10.0 * round_ + rank)
        # No barrier: every peer's twin is already allocated and filled.
        peer = ctx.heap.peer_view(mine, 1 - rank)
        seen[round_] = peer.tolist() == [10.0 * round_ + 1 - rank] * 64
    zero_d = ctx.zeros()
    seen["zero_d"] = tuple(zero_d.shape) == () and zero_d.item() == 0
    seen["pin_memory_ignored"] = ctx.rand(4, pin_memory=True).shape == (4,)
    ctx.destroy()
    return seen


def test_iris_iris_constructors_return_once_every_rank_filled_its_twin():
    """A kernel launched right after a constructor may read the peers' twins, as in upstream's
    tests: the constructors of an iris.iris() context return on a rank once every rank has
    allocated and filled its tensor (each rank in turn arrives late)."""
    from iris.testing import interpreted_device

    results = iris.spawn(_late_allocation_worker, 2, device=interpreted_device(), start_method="forkserver")
    for rank, seen in enumerate(results):
        assert seen == {0: True, 1: True, 2: True, "zero_d": True, "pin_memory_ignored": True}, (rank, seen)
