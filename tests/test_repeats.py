"""Repeated eager calls (iris.calls.repeats): an identical call runs the earlier call's repeat and
nothing else, and only where that is safe: a call that differs in any way is checked again, a
failed context raises, another thread is refused, recorded calls run in full.

Kernels under the interpreter have no repeat, so these tests register collective algorithms whose
repeats record that they ran (on GPUs the built-in kernels' repeats are timed by
benchmarks/call_overhead.py and checked by its equality asserts)."""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

import pytest
import torch

import iris
from iris.calls.repeats import MAX_REPEATS, Kept, invalidate
from iris.collectives import Algorithm, algorithm_registry, register_algorithm
from iris.errors import IrisError, IrisTimeoutError
from iris_triton.device import frontend
from iris_triton.protocol.waits import TIMEOUT, site_code


@contextmanager
def _recording(collective: str = "broadcast"):
    """An algorithm ``test_recording`` of ``collective`` registered for the block: yields the list
    of what ran, ``"run"`` for a call made in full and ``"repeat"`` for a repeat."""
    ran: list[str] = []

    def run(call):
        ran.append("run")
        return lambda stream: ran.append("repeat")

    with algorithm_registry(collective).restored():
        register_algorithm(Algorithm(name="test_recording", collective=collective, run=run, languages=()))
        yield ran


def test_an_identical_call_returns_what_the_call_returns_and_runs_only_the_repeat(ctx):
    with _recording() as ran:
        x = ctx.ones(8)
        assert ctx.ccl.broadcast(x, 0, algorithm="test_recording") is x
        y = x.view(8)  # another tensor object over the same memory, alike: the same call
        assert ctx.ccl.broadcast(y, 0, algorithm="test_recording") is y
        assert ran == ["run", "repeat"]


def test_a_repeat_launches_on_the_current_stream_and_asks_about_a_capture_only_off_the_default_one(ctx, monkeypatch):
    # The legacy default stream (handle 0, CPU ranks' only one) is never captured into a CUDA
    # graph; on any other stream a repeat notes a capture in progress, as a full call does.
    streams, asked = [], []
    with algorithm_registry("broadcast").restored():
        register_algorithm(Algorithm(name="test_streams", collective="broadcast", languages=(),
                                     run=lambda call: lambda stream: streams.append(stream)))
        x = ctx.ones(8)
        ctx.ccl.broadcast(x, 0, algorithm="test_streams")  # in full: keeps the repeat
        monkeypatch.setattr(ctx.workspaces, "note_capture", lambda: asked.append(True) or False)
        ctx.ccl.broadcast(x, 0, algorithm="test_streams")
        assert (streams, asked) == ([0], [])
        monkeypatch.setattr(ctx, "_current_stream", lambda: 0x5A00)
        ctx.ccl.broadcast(x, 0, algorithm="test_streams")
        assert (streams, asked) == ([0, 0x5A00], [True])
    ctx.free(x)


def test_an_algorithms_repeat_of_no_parameters_is_called_without_the_stream(ctx):
    # A plugin's repeat written as a function of nothing (before repeats were handed the stream).
    ran = []

    class Launches:
        def again(self):
            ran.append("method repeat")

    repeats = {"function": lambda: ran.append("function repeat"), "method": Launches().again}
    with algorithm_registry("broadcast").restored():
        for name, repeat in repeats.items():
            register_algorithm(Algorithm(name=f"test_{name}", collective="broadcast", languages=(),
                                         run=lambda call, repeat=repeat: repeat))
        x = ctx.ones(8)
        for name in repeats:
            ctx.ccl.broadcast(x, 0, algorithm=f"test_{name}")  # in full: the algorithm returns its repeat
            ctx.ccl.broadcast(x, 0, algorithm=f"test_{name}")
        assert ran == ["function repeat", "method repeat"]
    ctx.free(x)


def test_forgetting_the_repeats_while_other_threads_make_contexts_raises_nothing():
    # invalidate() empties every kept set of repeats while other threads add new ones.
    errors, stop = [], threading.Event()

    def make():
        try:
            while not stop.is_set():
                Kept(4).keep("key", "value")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can
    threads = [threading.Thread(target=make) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for _ in range(3000):
            invalidate()
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        sys.setswitchinterval(switch)
    assert not errors, errors


def test_writing_into_the_tensor_keeps_its_repeat(ctx):
    with _recording() as ran:
        x = ctx.zeros(4, 4)
        ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        x.copy_(torch.randn(4, 4))
        x.add_(1)
        ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        assert ran == ["run", "repeat"]


def _changed_in_place(ctx, x, how: str) -> torch.Tensor:
    """``x`` itself, its memory or layout changed in place by ``how``."""
    if how == "set_":
        x.set_(ctx.zeros(4, 4).untyped_storage(), 0, (4, 4), (4, 1))
    elif how == "resize_":
        x.resize_(2, 2)
    elif how == "as_strided_":
        x.as_strided_((2, 4), (4, 1), 4)
    return x


@pytest.mark.parametrize("differs", ["shape", "strides", "dtype", "address", "type of an argument", "option",
                                     "set_", "resize_", "as_strided_"])
def test_a_call_that_differs_in_anything_is_checked_again(ctx, differs):
    with _recording() as ran:
        x = ctx.zeros(4, 4)
        ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        in_place = lambda: ctx.ccl.broadcast(_changed_in_place(ctx, x, differs), 0, algorithm="test_recording")  # noqa: E731
        again = {"set_": in_place, "resize_": in_place, "as_strided_": in_place,
                 "shape": lambda: ctx.ccl.broadcast(x.view(16), 0, algorithm="test_recording"),
                 "strides": lambda: ctx.ccl.broadcast(x.t(), 0, algorithm="test_recording"),
                 "dtype": lambda: ctx.ccl.broadcast(x.view(torch.int32), 0, algorithm="test_recording"),
                 "address": lambda: ctx.ccl.broadcast(ctx.zeros(4, 4), 0, algorithm="test_recording"),
                 "type of an argument": lambda: ctx.ccl.broadcast(x, False, algorithm="test_recording"),
                 "option": lambda: ctx.ccl.broadcast(x, 0, algorithm=None)}[differs]
        if differs in ("strides", "type of an argument"):
            with pytest.raises(IrisError, match="not contiguous" if differs == "strides" else "src=False"):
                again()
        else:
            again()
        assert "repeat" not in ran


def test_a_failed_context_raises_instead_of_repeating(ctx):
    with _recording() as ran, iris.create(heap_size="1MiB", device=ctx.device.type) as c:
        x = c.ones(8)
        c.ccl.broadcast(x, 0, algorithm="test_recording")
        words = c.host_faults  # what the host reads (on GPUs a mapped copy of the kernels' words)
        words[1] = TIMEOUT.value * 256 + site_code("device_barrier")  # what a give-up leaves
        words[0] = 1
        if c.device.type == "cuda":
            torch.cuda.synchronize()
        with pytest.raises(IrisTimeoutError, match="gave up"):
            c.ccl.broadcast(x, 0, algorithm="test_recording")
        with pytest.raises(IrisTimeoutError, match="failed earlier"):
            c.ccl.broadcast(x, 0, algorithm="test_recording")
        assert ran == ["run"]
        words.zero_()  # destroy() releases without raising again


def test_a_call_from_a_second_thread_is_refused_not_repeated(ctx):
    with _recording() as ran:
        x = ctx.ones(8)
        ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        inside, leave = threading.Event(), threading.Event()

        def hold():
            with ctx._call("test.hold"):
                inside.set()
                leave.wait(30)

        other = threading.Thread(target=hold)
        other.start()
        try:
            assert inside.wait(30)
            with pytest.raises(IrisError, match="another thread is inside a call"):
                ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        finally:
            leave.set()
            other.join()
        assert ran == ["run"]


def test_a_call_recorded_by_the_profiler_runs_in_full(ctx):
    with _recording() as ran:
        x = ctx.ones(8)
        ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        assert ran == ["run", "run"]
        assert any(event.name == "iris.ccl.broadcast" for event in profile.events())


def test_debug_mode_checks_every_call_in_full(ctx):
    with _recording() as ran, iris.create(heap_size="1MiB", device=ctx.device.type, debug=True) as c:
        x = c.ones(8)
        for _ in range(3):
            c.ccl.broadcast(x, 0, algorithm="test_recording")
        assert ran == ["run"] * 3


def test_a_call_made_inside_another_offers_its_repeat_to_itself(ctx):
    # The outer call's algorithm makes an inner iris call: each keeps its own repeat, and the
    # outer one's repeat is only its own launch.
    ran = []
    inner_tensor = ctx.ones(4)

    def outer(call):
        ran.append("outer run")
        ctx.ccl.all_gather(torch.empty(4 * ctx.world_size, device=ctx.device), inner_tensor.clone(),
                           algorithm="test_inner")
        return lambda stream: ran.append("outer repeat")

    def inner(call):
        ran.append("inner run")
        return lambda stream: ran.append("inner repeat")

    with algorithm_registry("broadcast").restored(), algorithm_registry("all_gather").restored():
        register_algorithm(Algorithm(name="test_outer", collective="broadcast", run=outer, languages=()))
        register_algorithm(Algorithm(name="test_inner", collective="all_gather", run=inner, languages=()))
        x = ctx.ones(8)
        ctx.ccl.broadcast(x, 0, algorithm="test_outer")
        ctx.ccl.broadcast(x, 0, algorithm="test_outer")
    assert ran == ["outer run", "inner run", "outer repeat"]


def test_an_asynchronous_call_keeps_its_repeat_for_later_calls(ctx):
    with _recording() as ran:
        x = ctx.ones(8)
        ctx.ccl.broadcast(x, 0, algorithm="test_recording", async_op=True).wait()
        ctx.ccl.broadcast(x, 0, algorithm="test_recording")
        assert ran == ["run", "repeat"]


def test_the_oldest_repeats_are_dropped_past_the_limit(ctx):
    with _recording() as ran:
        tensors = [ctx.ones(1) for _ in range(MAX_REPEATS + 1)]
        for t in tensors:
            ctx.ccl.broadcast(t, 0, algorithm="test_recording")
        assert len(ctx.ccl._repeats) == MAX_REPEATS
        ctx.ccl.broadcast(tensors[-1], 0, algorithm="test_recording")
        ctx.ccl.broadcast(tensors[0], 0, algorithm="test_recording")
        assert ran[-2:] == ["repeat", "run"]
        for t in tensors:
            ctx.free(t)


def test_the_fused_all_reduce_rmsnorm_repeats_its_launch(ctx, monkeypatch):
    # Under the interpreter the launch has no repeat; a recording one stands in for the compiled
    # kernel's, so the operation's offer and the identical call's use of it are what is tested.
    launches = []
    real = frontend.Frontend.launch

    def launch(self, fn, grid, **arguments):
        launches.append("launch")
        real(self, fn, grid, **arguments)
        return lambda stream: launches.append("repeat")

    monkeypatch.setattr(frontend.Frontend, "launch", launch)
    generator = torch.Generator().manual_seed(7)
    tokens, hidden = 4, 64
    x = ctx.zeros(tokens, hidden)
    x.copy_(torch.randn(tokens, hidden, generator=generator))
    residual, weight = torch.randn(tokens, hidden, generator=generator), torch.rand(hidden, generator=generator)
    residual, weight = residual.to(ctx.device), weight.to(ctx.device)
    out = torch.empty_like(residual)
    assert ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, method="one_shot") is out
    expected = torch.nn.functional.rms_norm(x * ctx.world_size + residual, (hidden,), weight, 1e-6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, method="one_shot") is out
    ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, 1e-5, method="one_shot")  # another eps: in full
    assert launches == ["launch", "repeat", "launch"]
    # The optional output: its tensor is checked too (the guard is called with it only when given).
    kept = torch.empty_like(residual)
    for _ in range(2):
        ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, residual_out=kept, method="one_shot")
    torch.testing.assert_close(kept, x * ctx.world_size + residual, atol=1e-5, rtol=1e-5)
    kept.resize_(tokens - 1, hidden)  # the same address, another shape: the call is checked again (and refused)
    with pytest.raises(IrisError, match="residual_out has shape"):
        ctx.ops.all_reduce_rmsnorm(out, x, residual, weight, residual_out=kept, method="one_shot")
    assert launches == ["launch", "repeat", "launch", "launch", "repeat"]
    ctx.free(x)


def test_a_parameter_is_known_by_its_memory_not_its_identity(ctx):
    # An nn.Parameter (a tensor subclass) whose data is replaced is another call's tensor.
    with _recording() as ran:
        a, b = ctx.ones(8), ctx.ones(8)
        weight = torch.nn.Parameter(a, requires_grad=False)
        ctx.ccl.broadcast(weight, 0, algorithm="test_recording")
        ctx.ccl.broadcast(weight, 0, algorithm="test_recording")
        weight.data = b
        ctx.ccl.broadcast(weight, 0, algorithm="test_recording")
        assert ran == ["run", "repeat", "run"]


def test_without_torchs_tensor_guard_the_key_holds_each_tensors_layout(monkeypatch):
    # Where torch has no C++ tensor guard, the shape, strides and dtype go into the key itself.
    from iris.calls import entries
    from iris.calls.declarations import DECLARATIONS

    monkeypatch.setattr(entries, "_TENSOR_GUARDS", None)
    entries.keyer.cache_clear()
    try:
        keyed = entries.keyer(DECLARATIONS["broadcast"])
        x = torch.zeros(4, 4)
        key, tensors = keyed(x, 0)
        assert keyed(x.view(4, 4), 0)[0] == key and entries.guard(tensors)(x)
        assert keyed(x.view(16), 0)[0] != key and keyed(x.t(), 0)[0] != key
        assert keyed(x.view(torch.int32), 0)[0] != key and keyed(x, False)[0] != key
        x.resize_(2, 2)
        assert keyed(x, 0)[0] != key
    finally:
        entries.keyer.cache_clear()


def test_a_reduction_named_otherwise_is_never_taken_for_the_kept_one(ctx):
    # ReduceOp.SUM == 0 == False: a kept call of op=ReduceOp.SUM is not the call of op=0, which is refused.
    with _recording("all_reduce") as ran:
        x = ctx.zeros(8)
        ctx.ccl.all_reduce(x, torch.distributed.ReduceOp.SUM, algorithm="test_recording")
        with pytest.raises((ValueError, IrisError)):
            ctx.ccl.all_reduce(x, 0, algorithm="test_recording")
        assert ran == ["run"]


@pytest.mark.parametrize("name", ["group", "found", "_default0", "not an identifier", "lambda"])
def test_a_declared_parameter_the_generated_entry_cannot_take_is_refused(name):
    # The generated source has names of its own; a parameter named so would silently become another value.
    import attrs

    from iris.calls import entries
    from iris.calls.declarations import DECLARATIONS, Param

    broadcast = DECLARATIONS["broadcast"]
    declaration = attrs.evolve(broadcast, params=(*broadcast.params, Param(name, "int", 0)))
    for make in (entries.keyer, lambda d: entries.entry(d, None)):
        with pytest.raises(ValueError, match=f"{name!r}.*rename"):
            make(declaration)
