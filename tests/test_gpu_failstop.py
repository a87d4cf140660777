"""Fail-stop on a GPU: two ranks share one GPU (CUDA IPC between two processes on one device).

Shown there: collectives of every algorithm still match torch with the new checks compiled in;
a peer that never makes a call makes the waiting rank's kernel give up after the timeout of
wall-clock time (the GPU's global timer), with the failure visible to the host through pinned
memory while the host never synchronised, the call's output NaN, and the next iris call raising;
a peer that makes a different call is reported as a mismatch; ``on_timeout="trap"`` ends the
process. Two processes on one GPU are time-sliced: nothing here is timed but the give-up.
"""

from __future__ import annotations

import time

import pytest
import torch

from iris.testing import run_sharing_one_gpu

pytestmark = pytest.mark.gpu

TIMEOUT = 2.0
ALGORITHMS = ("low_latency", "sentinel", "one_shot", "two_shot")


def _reference(tensors, op):
    wide = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in tensors]
    acc = wide[0]
    for t in wide[1:]:
        acc = acc + t if op == "sum" else torch.maximum(acc, t) if op == "max" else torch.minimum(acc, t)
    return acc.to(tensors[0].dtype)


def _inputs(world, n, dtype, seed):
    gens = [torch.Generator().manual_seed(seed * 100 + q) for q in range(world)]
    return [torch.randn(n, generator=g).to(dtype) for g in gens]


def _collectives_worker(rank, backend):
    import iris

    ctx = iris.create(backend, heap_size="256MiB", timeout=30)
    world, wrong = ctx.world_size, []
    for k, (n, dtype) in enumerate([(1, torch.float32), (4099, torch.bfloat16), (300_001, torch.float16),
                                    (1 << 20, torch.float32)]):
        mine = _inputs(world, world * n, dtype, k)
        for algorithm in ALGORITHMS:
            for op in ("sum", "min"):
                t = mine[rank].cuda()
                try:
                    ctx.ccl.all_reduce(t, op=op, algorithm=algorithm)
                except iris.IrisError as error:
                    if "at most" in str(error):  # a size the algorithm refuses
                        continue
                    raise
                if not torch.allclose(t.cpu().float(), _reference(mine, op).float(), rtol=1e-2, atol=1e-2):
                    wrong.append(f"all_reduce/{algorithm}/{op}/{n}/{dtype}")
        out = torch.empty(world * world * n, dtype=dtype, device="cuda")
        ctx.ccl.all_gather(out, mine[rank].cuda())
        if not torch.equal(out.cpu(), torch.cat(mine)):
            wrong.append(f"all_gather/{n}")
        out = torch.empty(n, dtype=dtype, device="cuda")
        ctx.ccl.reduce_scatter(out, mine[rank].cuda())
        if not torch.allclose(out.cpu().float(), _reference(mine, "sum")[rank * n:(rank + 1) * n].float(),
                              rtol=1e-2, atol=1e-2):
            wrong.append(f"reduce_scatter/{n}")
        out = torch.empty(world * n, dtype=dtype, device="cuda")
        ctx.ccl.all_to_all(out, mine[rank].cuda())
        if not torch.equal(out.cpu(), torch.cat([m[rank * n:(rank + 1) * n] for m in mine])):
            wrong.append(f"all_to_all/{n}")
        t = mine[rank].cuda()
        ctx.ccl.broadcast(t, src=1)
        if not torch.equal(t.cpu(), mine[1]):
            wrong.append(f"broadcast/{n}")
    ctx.device_barrier()
    ctx.check()
    ctx.barrier()
    ctx.destroy()
    return wrong


@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_collectives_match_torch_with_two_ranksrun_sharing_one_gpu(backend):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = run_sharing_one_gpu(_collectives_worker, backend)
    assert results == [[], []], results


def _give_up_worker(rank, algorithm):
    """Rank 1 never makes rank 0's second call: rank 0's kernel gives up on the device."""
    import iris

    ctx = iris.create(heap_size="64MiB", timeout=TIMEOUT)
    x = ctx.ones(1000)
    ctx.ccl.all_reduce(x, algorithm=algorithm)
    ctx.barrier()
    if rank == 1:
        time.sleep(3 * TIMEOUT)  # rank 0 gives up meanwhile
        return {"sum_before": x.sum().item()}
    report = {"sum_before": x.sum().item()}
    start = time.monotonic()
    ctx.ccl.all_reduce(x, algorithm=algorithm)  # returns at once: the host does not wait for the kernel
    report["launch_returned_after"] = time.monotonic() - start
    while not ctx.failed and time.monotonic() - start < 10 * TIMEOUT:  # the pinned words, no synchronisation
        time.sleep(0.01)
    report["failure_seen_after"] = time.monotonic() - start
    try:
        ctx.ccl.all_reduce(ctx.ones(10))
        report["next_call"] = "returned"
    except iris.IrisTimeoutError as error:
        report["next_call"] = str(error)
    torch.cuda.synchronize()
    report["output_all_nan"] = bool(x.isnan().all().item())
    try:
        ctx.barrier()
        report["barrier"] = "returned"
    except iris.IrisTimeoutError as error:
        report["barrier"] = str(error)
    ctx.destroy()
    return report


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_give_up_on_the_gpu_is_wall_clock_poisons_the_output_and_fails_the_next_call(algorithm):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    report = run_sharing_one_gpu(_give_up_worker, algorithm)[0]
    assert isinstance(report, dict), report
    assert report["sum_before"] == 2000
    assert report["launch_returned_after"] < TIMEOUT / 2, report
    # The kernel gave up between 1.0x and 1.5x the timeout (plus the host's polling period).
    assert TIMEOUT <= report["failure_seen_after"] <= 1.5 * TIMEOUT + 0.2, report
    assert "all_reduce gave up after 2 s waiting for world rank(s) [1]" in report["next_call"], report
    assert "on rank 0" in report["next_call"], report
    assert report["output_all_nan"], report
    assert "failed earlier" in report["barrier"], report


def _mismatch_worker(rank, algorithm):
    import iris

    ctx = iris.create(heap_size="64MiB", timeout=TIMEOUT)
    big = ctx.ones(4096)
    ctx.ccl.all_reduce(big, algorithm=algorithm)  # workspaces grown alike on both ranks
    ctx.barrier()
    x = ctx.ones(1000 + 24 * rank)
    ctx.ccl.all_reduce(x, algorithm=algorithm)
    try:
        ctx.check()
        return f"no error; values {x[:4].tolist()}"
    except iris.IrisTimeoutError as error:
        return f"raised: {error}; nan={bool(x.isnan().all().item())}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_different_call_on_the_gpu_fails_instead_of_exchanging_data(algorithm):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    for rank, outcome in enumerate(run_sharing_one_gpu(_mismatch_worker, algorithm)):
        assert outcome.startswith("raised: ") and outcome.endswith("nan=True"), (rank, outcome)


def _trap_worker(rank):
    import iris

    ctx = iris.create(heap_size="64MiB", timeout=TIMEOUT, on_timeout="trap")
    x = ctx.ones(1000)
    ctx.ccl.all_reduce(x)
    ctx.barrier()
    if rank == 1:
        time.sleep(3 * TIMEOUT)
        return "rank 1 skipped the call"
    ctx.ccl.all_reduce(x)
    try:
        torch.cuda.synchronize()
        return "synchronize returned"
    except RuntimeError as error:  # the trapped kernel took the CUDA context down
        return f"trapped: {error}"


def test_on_timeout_trap_ends_the_kernel_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    outcome = run_sharing_one_gpu(_trap_worker)[0]
    assert outcome.startswith("trapped: ") or outcome.startswith("no result (exit code"), outcome
    assert "synchronize returned" not in outcome
