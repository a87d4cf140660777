"""Fail-stop under injected faults: no iris call returns a wrong value normally.

Every collective (each all_reduce algorithm, all_gather, reduce_scatter, all_to_all, broadcast,
reduce, gather, scatter, all_to_all_single and all_to_all_vdev with uneven splits, send/recv
between every pair, an all_reduce on a group, device_barrier) and every ``ctx.ops`` call (fused
and sequential; MoE dispatch then combine; all_reduce_rmsnorm by each method; tile collectives
inside a kernel) runs on 2 and 3
ranks while a peer is SIGKILLed before the call, SIGKILLed during it, exits early
(``os._exit``), is late by more than the timeout, is late by less than the timeout, or while busy
processes load the CPUs. On every
surviving rank each call either returns exactly the torch reference (computed from every rank's
seeded inputs: small integers, so every order of summation gives the same bits), or raises an
IrisError (then its float outputs are NaN, and the next call raises too); a give-up happens between
1.0x and 1.5x of the timeout. Also: the sentinel's bit pattern and NaNs through the sentinel and
low-latency all_reduce, consecutive calls with a delayed peer (stale slots or flags would show),
mismatched calls, and on_timeout="trap".

The ranks are CPU ranks (Triton's interpreter) where no GPU is visible, else GPU ranks: rank r on
GPU r modulo the GPUs visible, so that ranks share a GPU where there are fewer GPUs than ranks (CUDA
IPC between processes on one device; the GPU time-slices them). On GPUs an iris call need not wait
for its kernel: a call counts as made once ``ctx.check()`` after it returned (the failure rule's
"the next iris call raises"). CPU ranks are forked from the server ``iris.spawn`` forks its CPU
ranks from, which imported iris once (cheap ranks); GPU ranks are spawned (CUDA is not usable in a
process forked from one that has asked CUDA for its devices). A rank reports through a file it
rewrites after every check, so a rank that is killed leaves what it saw, and the parent bounds
every world in time and kills what is left. Short by default; ``IRIS_CHAOS_ITERS=n`` adds n rounds
of random victims, seeds and timings to every scenario.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing
import os
import pickle
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
import types

import pytest
import torch

#: Where the ranks run (module docstring).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import iris  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from iris.errors import IrisError, IrisTimeoutError  # noqa: E402
from iris.testing import mapped_heap_segments, seeded_generator  # noqa: E402
from fused_cases import cut_shape, with_few_units  # noqa: E402
from iris.tools.spawn import cpu_rank_context, die_with_launcher  # noqa: E402
from iris_triton.backend import TritonDeviceOps  # noqa: E402

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and (os.environ.get("TRITON_INTERPRET") != "1"
                                                     or TritonDeviceOps.unavailable_reason("cpu") is not None),
                                reason="CPU ranks need Triton's interpreter (TRITON_INTERPRET=1 before Triton loads)")

#: Rounds of random victims, seeds and timings on top of the short mode (0: short mode only).
CHAOS_ITERS = int(os.environ.get("IRIS_CHAOS_ITERS", "0"))
#: The timeout of scenarios that must give up (seconds).
T = 1.0
#: The timeout of scenarios that must succeed: far above any delay injected.
T_OK = 60.0
#: Slack of the give-up time's upper bound when worlds run side by side on 2 cores (heavy load).
LOADED_SLACK = 3.0

ALL_REDUCE = tuple(f"all_reduce/{a}" for a in ("low_latency", "sentinel", "one_shot", "two_shot"))
COLLECTIVES = ALL_REDUCE + ("all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "gather", "scatter",
                            "all_to_all_single", "all_to_all_vdev", "send_recv", "group", "device_barrier")
#: Calls that exchange a few numbers on the host before their kernel (eager calls with host split
#: sizes agree on the workspace's size): a dead peer can fail them there.
HOST_EXCHANGES = ("all_to_all_single",)
#: all_gather_matmul whose fused product's last wave is cut along K (on a context of few units).
CUT = "all_gather_matmul/cut"
FUSED = tuple(f"{k}/{m}" for k in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
              for m in ("fused", "sequential")) + (CUT,)
#: MoE token routing: ctx.ops.moe_dispatch, then moe_combine of the experts' outputs.
MOE = ("moe_dispatch_combine",)
#: The fused all_reduce + residual add + RMSNorm (ctx.ops.all_reduce_rmsnorm) by each method.
NORMS = ("all_reduce_rmsnorm/one_shot", "all_reduce_rmsnorm/two_shot")
#: Tile collectives inside a kernel (iris.x, tests/tile_kernels.py), each launch then ctx.check().
TILE_COLLECTIVES = ("tile/all_reduce", "tile/all_gather_rows", "tile/broadcast")
OPS = COLLECTIVES + FUSED + MOE + NORMS + TILE_COLLECTIVES
#: A slow peer pauses every this many Python function calls (:func:`sluggish`).
SLOWDOWN = int(os.environ.get("IRIS_CHAOS_SLOWDOWN", "400"))
#: Elements per rank of a collective call (divisible by 2 and 3; several blocks and rounds).
N = 600
#: (rows per rank, K, N) of the ctx.ops calls: ragged against the 16 x 16 x 16 tiles of CPU ranks.
SHAPE = (5, 16, 24)
#: Steps along K of the all_gather_matmul whose last wave is cut (into 2 parts).
CUT_STEPS = 9


# -- the harness: ranks forked from a forkserver, reporting through files ------------------------------------

def _rank_env() -> dict[str, str]:
    """The ranks' environment: this process's, without the settings each test gives its ranks."""
    return {k: v for k, v in os.environ.items() if k not in ("IRIS_DEBUG", "IRIS_ON_TIMEOUT")}


def _processes():
    """Where the ranks come from: the forkserver ``iris.spawn`` uses for CPU ranks (torch, Triton
    and iris imported once), else ``spawn``."""
    return cpu_rank_context(_rank_env()) if DEVICE == "cpu" else multiprocessing.get_context("spawn")


class Report(dict):
    """What one rank saw, written to its file after every entry (a killed rank keeps the rest)."""

    def __init__(self, rank: int, path: str):
        super().__init__()
        self.rank, self.path = rank, path

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.save()

    def save(self) -> None:
        with open(self.path + ".tmp", "wb") as f:
            pickle.dump(dict(self), f)
        os.replace(self.path + ".tmp", self.path)  # a reader sees the last report whole

    @staticmethod
    def path_of(directory: str, rank: int) -> str:
        return os.path.join(directory, f"rank{rank}.pkl")

    @staticmethod
    def read(directory: str, rank: int) -> dict:
        """What ``rank`` of the world in ``directory`` has reported so far (empty: nothing yet)."""
        try:
            with open(Report.path_of(directory, rank), "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return {}


def _rank_entry(rank: int, world: int, directory: str, worker, args: tuple, env: dict[str, str],
                launcher: int) -> None:
    die_with_launcher(launcher)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      IRIS_TIMEOUT=str(T_OK), GLOO_SOCKET_IFNAME="lo")
    if DEVICE == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(directory, 'rendezvous')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=T_OK))
    report = Report(rank, Report.path_of(directory, rank))
    try:
        worker(rank, world, report, *args)
        report["done"] = True
    except BaseException:
        report["crash"] = traceback.format_exc()[-4000:]
    os._exit(0)  # peers may be gone: no collective clean-up at exit


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


class World:
    def __init__(self, name, reports, exitcodes, seconds):
        self.name, self.reports, self.exitcodes, self.seconds = name, reports, exitcodes, seconds

    def __repr__(self):
        return f"World({self.name}, exitcodes={self.exitcodes}, {self.seconds:.1f} s)"


def run_worlds(specs: list, *, parallel: int = 3, bound: float = 240, busy: int = 0) -> list[World]:
    """Run every ``(name, worker, world, args)`` of ``specs`` (``worker(rank, world, report, *args)``
    on ``world`` ranks), at most ``parallel`` worlds at once, with ``busy`` busy processes
    alongside; every world is killed at ``bound`` seconds. Their reports, exit codes, durations."""
    processes, env = _processes(), _rank_env()
    results: list = [None] * len(specs)
    pending = list(enumerate(specs))
    running = []
    hogs = [processes.Process(target=_busy, args=(bound,), daemon=True) for _ in range(busy)]
    for hog in hogs:
        hog.start()
    try:
        with tempfile.TemporaryDirectory(prefix="iris-failstop-") as root:
            while pending or running:
                while pending and len(running) < parallel:
                    index, (name, worker, world, args) = pending.pop(0)
                    directory = os.path.join(root, str(index))
                    os.mkdir(directory)
                    entry = (world, directory, worker, args, env, os.getpid())
                    procs = [processes.Process(target=_rank_entry, args=(r, *entry), daemon=True) for r in range(world)]
                    for p in procs:
                        p.start()
                    running.append((index, name, world, directory, procs, time.monotonic()))
                time.sleep(0.05)
                for entry in list(running):
                    index, name, world, directory, procs, started = entry
                    overdue = time.monotonic() - started > bound
                    if all(p.exitcode is not None for p in procs) or overdue:
                        for p in procs:
                            if p.exitcode is None:
                                p.kill()
                            p.join()
                        reports = [Report.read(directory, r) for r in range(world)]
                        if overdue:
                            for rep in reports:
                                rep["overdue"] = f"the world was still running after {bound} s and was killed"
                        results[index] = World(name, reports, [p.exitcode for p in procs],
                                               time.monotonic() - started)
                        running.remove(entry)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
    return results


# -- calls and their references --------------------------------------------------------------------------------


def _ints(shape, dtype, *seed, low=-8, high=9) -> torch.Tensor:
    """Small integers as ``dtype`` on the ranks' device: sums and products of them are exact in every order."""
    return torch.randint(low, high, shape, generator=seeded_generator(*seed)).to(dtype=dtype, device=DEVICE)


def _filled(shape, dtype=torch.float32) -> torch.Tensor:
    """An output tensor on the ranks' device, filled with a value no call produces."""
    return torch.full(shape, 12345.0, dtype=dtype, device=DEVICE)


def prepare(ctx, op: str, seed, n: int = N):
    """``(call, expected, out)`` of ``op`` on this rank: ``call()`` makes the iris call and returns
    its result, ``expected`` is torch's result from every rank's inputs (None: nothing to compare),
    ``out`` the tensor a failed call must fill with NaN (None: no output)."""
    world, rank = ctx.world_size, ctx.rank
    kind, _, variant = op.partition("/")
    if kind == "device_barrier":
        return ctx.device_barrier, None, None
    if kind in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        # "cut": the fused GEMM's last wave cut along K (tests/fused_cases.py), in fp16, which holds
        # its longer sums exactly.
        cut = variant == "cut"
        m, K, Nn = cut_shape(DEVICE, world, CUT_STEPS) if cut else SHAPE
        dtype = torch.float16 if cut else (torch.bfloat16, torch.float16)[len(str(seed)) % 2]
        rows = m if kind == "all_gather_matmul" else world * m
        a = [_ints((rows, K), dtype, op, seed, "a", q, low=-2, high=3) for q in range(world)]
        b = [_ints((K, Nn), dtype, op, seed, "b", q, low=-2, high=3) for q in range(world)]
        if kind == "all_gather_matmul":
            expected = torch.cat([x.float() for x in a]) @ b[rank].float()
        else:
            total = sum(x.float() @ y.float() for x, y in zip(a, b))
            expected = total[rank * m:(rank + 1) * m] if kind == "matmul_reduce_scatter" else total
        out = _filled(tuple(expected.shape), dtype)
        fn = getattr(ctx.ops, kind)
        return (lambda: fn(out, a[rank], b[rank], method="fused" if cut else variant)), expected.to(dtype), out
    xs = [_ints((n,), torch.float32, op, seed, q) for q in range(world)]
    mine = xs[rank].clone()
    if kind == "all_reduce":
        total = xs[0].clone()
        for x in xs[1:]:
            total += x
        return (lambda: ctx.ccl.all_reduce(mine, algorithm=variant)), total, mine
    if kind == "all_gather":
        out = _filled((world * n,))
        return (lambda: ctx.ccl.all_gather(out, mine)), torch.cat(xs), out
    if kind == "reduce_scatter":
        m = n // world
        out = _filled((m,))
        return (lambda: ctx.ccl.reduce_scatter(out, mine)), sum(xs)[rank * m:(rank + 1) * m], out
    if kind == "all_to_all":
        out = _filled((n,))
        expected = torch.stack([x.view(world, -1)[rank] for x in xs]).reshape(-1)
        return (lambda: ctx.ccl.all_to_all(out, mine)), expected, out
    if kind == "broadcast":
        src = len(str(seed)) % world
        return (lambda: ctx.ccl.broadcast(mine, src=src)), xs[src], mine
    root = len(str(seed)) % world  # the rooted collectives: the root's result; the others' tensors are not outputs
    if kind == "reduce":
        if rank != root:
            return (lambda: ctx.ccl.reduce(mine, dst=root)), xs[rank], None
        return (lambda: ctx.ccl.reduce(mine, dst=root)), sum(xs[1:], xs[0]), mine
    if kind == "gather":
        out = _filled((world * n,)) if rank == root else None
        return (lambda: ctx.ccl.gather(out, mine, dst=root)), torch.cat(xs) if rank == root else None, out
    if kind == "scatter":
        m = n // world
        out = _filled((m,))
        return (lambda: ctx.ccl.scatter(out, mine if rank == root else None, src=root)), xs[root][rank * m:][:m], out
    if kind == "send_recv":
        return _send_recv(ctx, mine, xs)
    if kind == "group":  # a group of every rank: the calls run on a group view, with its own workspaces
        return (lambda: ctx.ccl.all_reduce(mine, group=_whole_group(ctx))), sum(xs[1:], xs[0]), mine
    if kind in ("all_to_all_single", "all_to_all_vdev"):
        return _uneven(ctx, kind, op, seed, n)
    if kind == "moe_dispatch_combine":
        return _moe(ctx, op, seed, n)
    if kind == "all_reduce_rmsnorm":
        return _rmsnorm(ctx, op, variant, seed, n)
    if kind == "tile":
        return _tile(ctx, variant, xs, seed)
    raise ValueError(op)


#: The group of every rank of each context (made at its first call, when every rank is there).
_GROUPS: dict[int, object] = {}


def _whole_group(ctx):
    if id(ctx) not in _GROUPS:
        _GROUPS[id(ctx)] = ctx.new_group(list(range(ctx.world_size)))
    return _GROUPS[id(ctx)]


def _send_recv(ctx, mine, xs):
    """Every pair of ranks exchanges its input, pairs in one order on every rank (the lower rank
    sends first): every rank receives from every peer, so a missing peer fails every survivor."""
    world, rank, n = ctx.world_size, ctx.rank, mine.numel()
    peers = [q for q in range(world) if q != rank]
    out = _filled(((world - 1) * n,))

    def call():
        for i, j in itertools.combinations(range(world), 2):
            if rank in (i, j):
                peer = j if rank == i else i
                place = out[peers.index(peer) * n:][:n]
                if rank == i:
                    ctx.ccl.send(mine, peer)
                    ctx.ccl.recv(place, peer)
                else:
                    ctx.ccl.recv(place, peer)
                    ctx.ccl.send(mine, peer)
        return out

    # On 2 ranks ``out`` is the one recv's tensor, all NaN after a failure; on more, only the
    # tensor of the recv that failed is (the others may hold what arrived): not checked then.
    return call, torch.cat([xs[q] for q in peers]), out if world == 2 else None


def _uneven(ctx, kind: str, op: str, seed, n: int):
    """all_to_all with a different number of elements between every pair of ranks (host split
    sizes, or device ones with an output bound)."""
    world, rank = ctx.world_size, ctx.rank
    unit = max(1, n // (4 * world))

    def split(src, dst):
        return ((3 * src + 5 * dst + len(str(seed))) % 4 + 1) * unit

    xs = [_ints((sum(split(q, d) for d in range(world)),), torch.float32, op, seed, q) for q in range(world)]
    sent_to_me = [xs[q][sum(split(q, d) for d in range(rank)):][:split(q, rank)] for q in range(world)]
    received = torch.cat(sent_to_me)
    mine = xs[rank].clone()
    if kind == "all_to_all_single":
        out = _filled((received.numel(),))
        ins, outs = [split(rank, d) for d in range(world)], [split(q, rank) for q in range(world)]
        return (lambda: ctx.ccl.all_to_all_single(out, mine, outs, ins)), received, out
    out = _filled((4 * unit * world,))  # the bound: the most any rank can receive
    splits = torch.tensor([split(rank, d) for d in range(world)], device=DEVICE)
    counts = torch.full((world,), -7, dtype=torch.int64, device=DEVICE)

    def call():
        ctx.ccl.all_to_all_vdev(out, mine, splits, counts)
        return torch.cat([out[:received.numel()], counts.float()])

    return call, torch.cat([received, torch.tensor([float(split(q, rank)) for q in range(world)], device=DEVICE)]), out


def _moe(ctx, op: str, seed, n: int):
    """Top-2 of 2 experts per rank over a number of tokens that follows ``n``; the experts scale
    their tokens by (expert + 1). The result: combine's output, then this rank's experts' counts.
    No ``out``: the call returns new tensors, and a call that fails on CPU ranks returns none."""
    world, rank = ctx.world_size, ctx.rank
    tokens, local = 4 + n % 7, 2
    experts = local * world
    ids = [torch.stack([torch.randperm(experts, generator=seeded_generator(op, seed, "ids", q, t))[:2]
                        for t in range(tokens)]).to(DEVICE) for q in range(world)]
    x = _ints((tokens, 8), torch.float32, op, seed, "x", rank)
    w = _ints((tokens, 2), torch.float32, op, seed, "w", rank, low=1, high=4)
    factor = torch.arange(rank * local + 1, (rank + 1) * local + 1, dtype=torch.float32, device=DEVICE).view(-1, 1, 1)

    def call():
        result = ctx.ops.moe_dispatch(x, ids[rank], w, experts)
        combined = ctx.ops.moe_combine(result.tokens * factor, result)
        return torch.cat([combined.flatten(), result.counts.float()])

    combined = sum(w[:, j:j + 1] * x * (ids[rank][:, j:j + 1] + 1).float() for j in range(2))
    counts = [float(sum(int((i == rank * local + e).sum()) for i in ids)) for e in range(local)]
    return call, torch.cat([combined.flatten(), torch.tensor(counts, device=DEVICE)]), None


def _rmsnorm(ctx, op: str, method: str, seed, n: int):
    """Rows of 40 over a number of tokens that follows ``n`` (some two-shot shares empty); the
    residual makes every sum +-2, so that with eps=0 the result is exactly +-weight (small
    integers) in every order of summation. The result: out, then residual_out (one buffer)."""
    world, rank = ctx.world_size, ctx.rank
    tokens, hidden = 1 + n % 5, 40
    dtype = (torch.bfloat16, torch.float32)[len(str(seed)) % 2]
    xs = [_ints((tokens, hidden), dtype, op, seed, "x", q, low=-2, high=3) for q in range(world)]
    sums = (2 * torch.randint(0, 2, (tokens, hidden), generator=seeded_generator(op, seed, "sign")) * 2 - 2).to(DEVICE)
    residual = (sums - sum(x.float() for x in xs)).to(dtype)
    weight = _ints((hidden,), dtype, op, seed, "weight", low=-3, high=4)
    both = _filled((2, tokens, hidden), dtype)
    sums, weight_cpu = sums.float().cpu(), weight.float().cpu()
    expected = torch.stack([torch.nn.functional.rms_norm(sums, (hidden,), weight_cpu, 0.0), sums])

    def call():
        ctx.ops.all_reduce_rmsnorm(both[0], xs[rank], residual, weight, 0.0, both[1], method=method)
        return both

    return call, expected.to(dtype), both


#: Each context's tile sync and heap copy of the input per number of rows (made at the first call of
#: that size, when every rank is there).
_TILE_STATE: dict[tuple, tuple] = {}
#: Columns and tile edge of the tile collectives' matrices.
TILE_COLUMNS, TILE_BLOCK = 24, 16


def _tile(ctx, collective: str, xs, seed):
    """``collective`` on every tile of this rank's input as a ``rows x TILE_COLUMNS`` matrix, by one
    launch of tests/tile_kernels.py's kernel (two programs) and ``ctx.check()``."""
    from tile_kernels import tile_collective

    world, rank = ctx.world_size, ctx.rank
    rows = xs[0].numel() // TILE_COLUMNS
    parts = [x[:rows * TILE_COLUMNS].view(rows, TILE_COLUMNS) for x in xs]
    if (id(ctx), rows) not in _TILE_STATE:
        tiles = -(-rows // TILE_BLOCK) * -(-TILE_COLUMNS // TILE_BLOCK)
        _TILE_STATE[id(ctx), rows] = ctx.tile_sync(tiles), ctx.zeros(rows, TILE_COLUMNS)
    sync, src = _TILE_STATE[id(ctx), rows]
    root = len(str(seed)) % world
    expected = {"all_reduce": sum(parts[1:], parts[0]), "all_gather_rows": torch.cat(parts),
                "broadcast": parts[root]}[collective]
    out = _filled(tuple(expected.shape))

    def call():
        src.copy_(parts[rank])
        ctx.frontend.kernel(tile_collective)[(2,)](
            ctx.get_device_context(), src, out, sync, rows, TILE_COLUMNS, *out.shape, TILE_COLUMNS, 1, out.stride(0), 1,
            1, root, CTX=ctx.frontend.device_context, RANK=rank, WORLD=world, COLLECTIVE=collective,
            TRACING=False, OP="sum", BLOCK_M=TILE_BLOCK, BLOCK_N=TILE_BLOCK)
        try:
            ctx.check()
        except IrisError:
            # A failure is per tile: the tiles whose calls succeeded before it hold their results.
            # Every tile must be all NaN or exactly right; then the call counts as failed (NaN).
            if not _tiles_nan_or_exact(out, expected, world if collective == "all_gather_rows" else 1):
                return out  # compared with the reference: reported as wrong
            out.fill_(float("nan"))
            raise
        return out

    return call, expected, out


def _tiles_nan_or_exact(out: torch.Tensor, expected: torch.Tensor, blocks: int) -> bool:
    """Whether every tile the collective wrote is all NaN or equal to ``expected``'s: ``out`` is
    ``blocks`` blocks of rows (all_gather's, one per rank, each as many rows as the input, which
    need not be a multiple of the tile), each cut into TILE_BLOCK x TILE_BLOCK tiles from its
    first row."""
    rows = out.shape[0] // blocks
    for first in range(0, out.shape[0], rows):
        for r in range(first, first + rows, TILE_BLOCK):
            end = min(r + TILE_BLOCK, first + rows)
            for c in range(0, out.shape[1], TILE_BLOCK):
                got, want = out[r:end, c:c + TILE_BLOCK], expected[r:end, c:c + TILE_BLOCK]
                if not (bool(got.isnan().all()) or torch.equal(got, want)):
                    return False
    return True


def attempt(ctx, op: str, seed, n: int = N) -> dict:
    """Make the call; what happened: status ``exact`` / ``WRONG`` / ``raised`` / ``other``, its
    duration, the error's message, whether a failed call's output is all NaN."""
    call, expected, out = prepare(ctx, op, seed, n)
    expected = None if expected is None else expected.cpu()
    started = time.monotonic()
    try:
        result = call()
        ctx.check()  # on GPUs the call need not have waited for its kernel: a failure surfaces here
        seconds = time.monotonic() - started
        if expected is None or (result is not None and torch.equal(result.cpu(), expected)):
            return dict(status="exact", seconds=seconds)
        got = result.cpu().flatten()
        wrong = (got != expected.flatten()).nonzero().flatten()
        return dict(status="WRONG", seconds=seconds,
                    detail=f"{wrong.numel()} of {got.numel()} elements differ, first at {wrong[:4].tolist()}: got "
                           f"{got[wrong[:4]].tolist()}, expected {expected.flatten()[wrong[:4]].tolist()}")
    except IrisError as error:
        nan = None if out is None else out.float().isnan()
        return dict(status="raised", seconds=time.monotonic() - started, type=type(error).__name__,
                    message=str(error), nan=None if nan is None else bool(nan.all()),
                    nan_share=None if nan is None else float(nan.float().mean()))
    except Exception as error:  # noqa: BLE001 - reported, and the test fails on it
        return dict(status="other", seconds=time.monotonic() - started,
                    message=f"{type(error).__name__}: {str(error)[-600:]}")


def next_call(ctx) -> dict:
    """Another iris call on the context (after a failure it must raise at once; a rank whose
    peers stopped calling raises after the timeout)."""
    started = time.monotonic()
    try:
        ctx.device_barrier()  # no workspace to allocate: a device-side wait only
        ctx.check()  # on GPUs the barrier's kernel may still be waiting
        return dict(status="returned", seconds=time.monotonic() - started, failed=ctx.failed)
    except IrisError as error:
        return dict(status="raised", seconds=time.monotonic() - started, message=str(error), failed=ctx.failed)
    except Exception as error:  # noqa: BLE001 - reported, and the test fails on it
        return dict(status="other", seconds=time.monotonic() - started, message=f"{type(error).__name__}: {error}",
                    failed=ctx.failed)


def bounded_destroy(ctx) -> dict:
    started = time.monotonic()
    try:
        ctx.destroy()
        error = None
    except Exception as exc:  # noqa: BLE001 - a failed context's destroy may raise what it recorded
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return dict(seconds=time.monotonic() - started, error=error)


def _create(timeout: float, ops=(), **options):
    """A context of the ranks for ``ops``; with few units (tests/fused_cases.py) where they include
    all_gather_matmul/cut, so that its fused product has a last wave to cut."""
    ctx = iris.create(heap_size="4MiB", device=DEVICE, timeout=timeout, **options)
    return with_few_units(ctx) if CUT in ops else ctx


# -- workers (module level: ranks import them by name) ---------------------------------------------------------


def _sync() -> None:
    import torch.distributed as dist

    dist.barrier()


def compile_first(ops, seed) -> None:
    """GPU ranks: make each op's call once on a context that waits long, so that Triton compiles
    its kernels (seconds, and not as long on every rank) before the calls whose waits are short,
    which would give up on a peer still compiling. A call's kernels are compiled once per process."""
    if DEVICE == "cpu":
        return
    ctx = _create(T_OK, ops)
    for op in ops:
        attempt(ctx, op, ("warm", seed))  # the warm-up's data: its sizes, and so its kernels
    _sync()
    ctx.destroy()
    _GROUPS.pop(id(ctx), None)
    for key in [key for key in _TILE_STATE if key[0] == id(ctx)]:
        del _TILE_STATE[key]


def dead_peer_worker(rank, world, report, how, ops, victim, seed, timeout):
    """One context per op, each warmed up by a correct call; then ``victim`` dies (``how``:
    sigkill / exit) and every other rank makes each op's call on its context."""
    compile_first(ops, seed)
    contexts = []
    for op in ops:
        _sync()
        ctx = _create(timeout, (op,))
        report[f"warm/{op}"] = attempt(ctx, op, ("warm", seed))
        contexts.append(ctx)
    _sync()
    if rank == victim:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(0)
    time.sleep(0.2)  # the victim is gone
    for op, ctx in zip(ops, contexts):
        report[f"call/{op}"] = attempt(ctx, op, ("call", seed))
        report[f"next/{op}"] = next_call(ctx)
        report[f"destroy/{op}"] = bounded_destroy(ctx)
    # Destroyed contexts hold no heap, though the loop's ``ctx`` still refers to the last one:
    # every heap freed, every peer's heap unmapped.
    contexts.clear()
    _GROUPS.clear()
    _TILE_STATE.clear()
    report["heap_ranges_left"] = _live_heap_ranges()


def _live_heap_ranges() -> list[str]:
    """The heaps (this rank's own, or a peer's) this process still maps: on GPUs each range opened
    through CUDA IPC, as what refers to it, two steps back; on CPU ranks each shared-memory
    segment's line of /proc/self/maps."""
    if DEVICE == "cpu":
        return mapped_heap_segments()
    from iris.heap.cuda_ipc import _DeviceMemory

    gc.collect()
    ranges = [o for o in gc.get_objects() if isinstance(o, _DeviceMemory)]
    return [_holders(r, {id(ranges)}) for r in ranges]


def _holders(obj, ours: set, depth: int = 2) -> str:
    """The types of what refers to ``obj`` (and, ``depth`` steps back, to those), leaving out
    frames and this search's own lists (``ours``)."""
    referrers = [r for r in gc.get_referrers(obj) if id(r) not in ours and not isinstance(r, types.FrameType)]
    ours.add(id(referrers))
    names = [type(r).__name__ + ("" if depth == 1 else f" <- ({_holders(r, ours, depth - 1)})") for r in referrers[:4]]
    return ", ".join(names)


def kill_during_worker(rank, world, report, op, victim, seed, kill_after, others_late, timeout):
    """``victim`` kills itself ``kill_after`` s into its call (a timer thread); the others start
    theirs ``others_late`` s after it (so with ``others_late > kill_after`` it dies inside the
    call, waiting for them)."""
    compile_first((op,), seed)
    ctx = _create(timeout, (op,))
    report[f"warm/{op}"] = attempt(ctx, op, ("warm", seed))
    _sync()
    if rank == victim:
        timer = threading.Timer(kill_after, os.kill, (os.getpid(), signal.SIGKILL))
        timer.start()
        report["victim_started"] = True
        report["victim_call"] = attempt(ctx, op, ("call", seed))  # recorded only if it finished first
        time.sleep(60)
    time.sleep(others_late)
    report[f"call/{op}"] = attempt(ctx, op, ("call", seed))
    report[f"next/{op}"] = next_call(ctx)
    report[f"destroy/{op}"] = bounded_destroy(ctx)


def late_peer_worker(rank, world, report, ops, victim, seed, late, timeout, victim_next):
    """For each op, a fresh context: a correct call, then ``victim`` makes the next call ``late``
    seconds after every other rank's call returned (so after they gave up on it: how long their
    calls' own work takes before they wait does not matter)."""
    compile_first(ops, seed)
    for op in ops:
        _sync()
        ctx = _create(timeout, (op,))
        report[f"warm/{op}"] = attempt(ctx, op, ("warm", seed))
        _sync()
        if rank == victim:
            _await_peers_reports(report, world, f"call/{op}")
            time.sleep(late)
            report[f"late_call/{op}"] = attempt(ctx, op, ("call", seed))
            if victim_next:
                report[f"late_next/{op}"] = next_call(ctx)
        else:
            report[f"call/{op}"] = attempt(ctx, op, ("call", seed))
            report[f"next/{op}"] = next_call(ctx)
        report[f"failed/{op}"] = ctx.failed  # not destroyed: destroy is checked in the dead-peer test


def _await_peers_reports(report: Report, world: int, key: str) -> None:
    """Wait until every other rank of the world has reported ``key`` (their report files lie
    beside this rank's); the parent's bound on the world ends a wait that never ends."""
    directory = os.path.dirname(report.path)
    waiting = set(range(world)) - {report.rank}
    while waiting:
        time.sleep(0.02)
        waiting = {peer for peer in waiting if key not in Report.read(directory, peer)}


@contextlib.contextmanager
def sluggish(every: int, pause: float = 1e-4):
    """Run the block with this process's Python (the interpreter running the kernels included)
    slowed down: a pause every ``every`` function calls (0: not slowed)."""
    if not every:
        yield
        return
    events = itertools.count()

    def hook(frame, event, arg):
        if next(events) % every == 0:
            time.sleep(pause)

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def slow_peer_worker(rank, world, report, ops, calls, delays, seed, slowdown):
    """Consecutive calls of each op, new data every call, one rank (a different one per op) late
    by ``delays[i]`` seconds (< the timeout) before call i and running its even-numbered
    collective calls ``slowdown`` (:func:`sluggish`): while it still reads call i, its peers
    already push call i + 1. Every call exact."""
    ctx = _create(T_OK, ops)
    for index, op in enumerate(ops):
        late = (index + len(str(seed))) % world
        _sync()
        for i in range(calls):
            if rank == late:
                time.sleep(delays[(index + i) % len(delays)])
            with sluggish(slowdown if rank == late and op in COLLECTIVES and i % 2 == 0 else 0):
                report[f"slow/{op}/{i}"] = attempt(ctx, op, ("slow", seed, i), n=N + 6 * world * (i % 3))
    _sync()
    ctx.destroy()


def mixed_worker(rank, world, report, ops, rounds, seed):
    """Every op, ``rounds`` times, no fault (run under CPU load): every call exact."""
    ctx = _create(T_OK, ops)
    for r in range(rounds):
        for op in ops:
            report[f"load/{op}/{r}"] = attempt(ctx, op, ("load", seed, r))
    _sync()
    ctx.destroy()


# -- checking ----------------------------------------------------------------------------------------------------


def _survivor_problems(world: World, victim: int, timeout: float, *, must_raise: bool, upper: float,
                       lower: float | None = None) -> list[str]:
    """Problems on the surviving ranks: a call that returned a wrong value normally (or raised
    something else than an IrisError), a failed call whose output is not NaN, a give-up outside
    [lower, upper] seconds, a next call that did not raise, a destroy that hung."""
    problems = []
    lower = timeout if lower is None else lower
    for rank, rep in enumerate(world.reports):
        if rank == victim:
            continue
        where = f"{world.name} rank {rank}"
        for key in ("crash", "overdue"):
            if key in rep:
                problems.append(f"{where}: {key}: {rep[key]}")
        if "done" not in rep:
            problems.append(f"{where}: did not finish (exit code {world.exitcodes[rank]})")
        for key, value in rep.items():
            if not isinstance(value, dict):
                continue
            op = key.split("/", 1)[1]
            if key.startswith("warm/") and value["status"] != "exact":
                problems.append(f"{where}: the warm-up {op} before any fault: {value}")
            if key.startswith("call/"):
                status = value["status"]
                if status in ("WRONG", "other"):
                    problems.append(f"{where}: {op} returned normally with a wrong value or raised a non-iris "
                                    f"error: {value}")
                elif status == "exact" and must_raise:
                    problems.append(f"{where}: {op} returned normally although a peer never made the call "
                                    f"(the give-up was not recorded?)")
                elif status == "raised":
                    if value["nan"] is False:
                        problems.append(f"{where}: {op} raised but only {value['nan_share']:.0%} of its output is "
                                        f"NaN: {value['message'][:200]}")
                    host = op in HOST_EXCHANGES and "host exchange on rank" in value["message"]
                    # A host exchange also fails as soon as gloo sees a dead peer's connection close.
                    if not (0 if host else lower) <= value["seconds"] <= upper:
                        problems.append(f"{where}: {op} gave up after {value['seconds']:.2f} s, outside "
                                        f"[{lower:.2f}, {upper:.2f}] (timeout {timeout} s)")
                    if value["type"] != "IrisTimeoutError" or not (host or "a device-side wait failed" in
                                                                   value["message"]):
                        problems.append(f"{where}: {op} raised an unexpected error: {value['message'][:300]}")
                nxt = rep.get(f"next/{op}")
                if nxt is None or nxt["status"] != "raised" or not nxt["failed"]:
                    problems.append(f"{where}: the call after {op} ({status}) did not raise with a failed context: "
                                    f"{nxt}")
                elif status == "raised" and ("failed earlier" not in nxt["message"] or nxt["seconds"] > 0.5):
                    problems.append(f"{where}: the call after a failed {op} did not raise at once naming the earlier "
                                    f"failure: {nxt}")
            if key.startswith("destroy/") and rep.get(f"call/{op}", {}).get("status") == "raised" and (
                    value["error"] is not None or value["seconds"] > 0.5):
                problems.append(f"{where}: destroy of the context whose {op} failed waited for peers or raised "
                                f"({value['seconds']:.2f} s): {value['error']}")
    return problems


def _seeds(base: str) -> list:
    return [base] + [f"{base}-chaos{i}" for i in range(CHAOS_ITERS)]


def _split(ops, world_sizes=(2, 3), parts: int = 1) -> list[tuple[int, tuple]]:
    """Short mode: each op on one world size (alternating), the ops of each size over ``parts``
    worlds (which run side by side: a test whose calls wait out a timeout one after another
    waits the shorter); long mode: every op on every size."""
    if CHAOS_ITERS:
        return [(w, tuple(ops)) for w in world_sizes]
    sizes = world_sizes * parts
    return [(w, tuple(op for i, op in enumerate(ops) if i % len(sizes) == k)) for k, w in enumerate(sizes)]


# -- tests ------------------------------------------------------------------------------------------------------


def test_a_dead_peer_makes_every_call_raise_with_nan_outputs():
    """SIGKILL and os._exit before the call, for every collective and ctx.ops call: each survivor's
    call raises IrisTimeoutError within [1.0, 1.5] x timeout (+ slack: worlds run side by side),
    its output NaN, the next call raises at once, destroy does not wait, and no heap stays mapped
    once every context is destroyed. A give-up that is not recorded (the call returns NaN
    normally) fails here for any op."""
    specs = []
    for seed in _seeds("dead"):
        rng = random.Random(seed)
        for how in ("sigkill", "exit"):
            for world, ops in _split(OPS):
                victim = rng.randrange(world) if CHAOS_ITERS else world - 1
                specs.append((f"{how}/{world}/{seed}", dead_peer_worker, world, (how, ops, victim, seed, T)))
    results = run_worlds(specs, parallel=4)  # short mode: every world at once
    problems = []
    for (name, _, world, args), result in zip(specs, results):
        victim = args[2]
        expected_exit = -signal.SIGKILL if args[0] == "sigkill" else 0
        if result.exitcodes[victim] != expected_exit:
            problems.append(f"{name}: the victim exited with {result.exitcodes[victim]}")
        problems += _survivor_problems(result, victim, T, must_raise=True, upper=T + LOADED_SLACK)
        calls = [k for rep in result.reports for k in rep if k.startswith("call/")]
        if len(calls) < (world - 1) * len(args[1]):
            problems.append(f"{name}: only {len(calls)} calls reported")
        problems += [f"{name} rank {rank}: heap ranges left after every context was destroyed, held by "
                     f"{left}" for rank, rep in enumerate(result.reports) if (left := rep.get("heap_ranges_left"))]
        survivors = [rep for rank, rep in enumerate(result.reports) if rank != victim]
        if not all("heap_ranges_left" in rep for rep in survivors):
            problems.append(f"{name}: a survivor did not count its heap ranges")
    assert not problems, "\n".join(problems[:40])


def test_a_give_up_happens_between_1x_and_1_5x_of_the_timeout():
    """Quiet: one world at a time, a dead peer; each give-up within [1.0, 1.5] x timeout."""
    timeout = 2.0
    ops = ("all_reduce/one_shot", "all_reduce/sentinel", "all_reduce/low_latency", "device_barrier",
           "matmul_reduce_scatter/fused", "all_gather_matmul/fused")
    results = run_worlds([("timing/2", dead_peer_worker, 2, ("sigkill", ops, 1, "timing", timeout))], parallel=1)
    problems = _survivor_problems(results[0], 1, timeout, must_raise=True, upper=1.5 * timeout)
    seconds = {k: round(v["seconds"], 2) for k, v in results[0].reports[0].items() if k.startswith("call/")}
    assert len(seconds) == len(ops), results[0].reports[0]
    assert not problems, "\n".join(problems) + f"\n{seconds}"


def test_a_peer_killed_during_the_call_never_yields_a_wrong_value():
    """The victim dies inside its call: while waiting for the others (they start after it), or
    racing them. Survivors: exact, or IrisTimeoutError with NaN output; the next call raises."""
    specs = []
    for seed in _seeds("during"):
        rng = random.Random(seed)
        for index, op in enumerate(OPS):
            world = (2, 3)[index % 2] if not CHAOS_ITERS else rng.choice((2, 3))
            victim = world - 1 if not CHAOS_ITERS else rng.randrange(world)
            if CHAOS_ITERS:
                kill_after, late = rng.uniform(0.0, 0.4), rng.choice((0.0, rng.uniform(0.0, 0.6)))
            else:
                kill_after, late = (0.2, 0.5) if index % 4 < 2 else (0.03, 0.0)
            specs.append((f"during/{op}/{world}/{seed}", kill_during_worker, world,
                          (op, victim, seed, kill_after, late, T)))
    results = run_worlds(specs, parallel=4)
    problems = []
    for (name, _, _world, args), result in zip(specs, results):
        victim = args[1]
        if result.exitcodes[victim] != -signal.SIGKILL:
            problems.append(f"{name}: the victim exited with {result.exitcodes[victim]}")
        # The give-up starts once the survivor's wait does: at most ``late`` + the call's work late.
        problems += _survivor_problems(result, victim, T, must_raise=False, upper=T + args[4] + LOADED_SLACK)
    assert not problems, "\n".join(problems[:40])


def test_a_peer_late_by_more_than_the_timeout():
    """Survivors raise within the bound (NaN outputs); the late rank's call returns exactly the
    reference or raises, and its next call raises: nobody returns a wrong value."""
    specs = []
    for seed in _seeds("late"):
        rng = random.Random(seed)
        for part, (world, ops) in enumerate(_split(OPS, parts=2)):
            victim = rng.randrange(world) if CHAOS_ITERS else world - 1
            late = rng.uniform(0.0, 1.0) if CHAOS_ITERS else 0.0  # after the others gave up
            specs.append((f"late/{world}/{part}/{seed}", late_peer_worker, world, (ops, victim, seed, late, T, True)))
    results = run_worlds(specs, parallel=4)  # short mode: every world at once
    problems = []
    for (name, _, _world, args), result in zip(specs, results):
        victim = args[1]
        problems += _survivor_problems(result, victim, T, must_raise=True, upper=T + LOADED_SLACK)
        rep = result.reports[victim]
        for op in args[0]:
            late_call, late_next = rep.get(f"late_call/{op}"), rep.get(f"late_next/{op}")
            if late_call is None or late_call["status"] not in ("exact", "raised"):
                problems.append(f"{name}: the late rank's {op}: {late_call}")
            elif late_call["status"] == "raised" and late_call["nan"] is False:
                problems.append(f"{name}: the late rank's {op} raised without NaN output")
            if late_next is None or late_next["status"] != "raised":
                problems.append(f"{name}: the late rank's call after {op} did not raise: {late_next}")
    assert not problems, "\n".join(problems[:40])


def test_a_peer_late_by_less_than_the_timeout_gets_exact_results_every_call():
    """Consecutive calls of every op with new data (and sizes) each call, one rank delayed before
    every call: all exact (each op on one world size, alternating; with IRIS_CHAOS_ITERS on
    both). Stale data from a collapsed workspace slot, or a wait that accepts another call's flag,
    shows here as a wrong value or a timeout."""
    specs = []
    for seed in _seeds("slow"):
        rng = random.Random(seed)
        delays = (0.15, 0.3, 0.05) if not CHAOS_ITERS else tuple(rng.uniform(0.0, 0.4) for _ in range(5))
        for world, ops in _split(OPS):
            specs.append((f"slow/{world}/{seed}", slow_peer_worker, world, (ops, 4, delays, seed, SLOWDOWN)))
    results = run_worlds(specs, parallel=2)
    problems = []
    for spec, result in zip(specs, results):
        ops, calls = spec[3][:2]
        expected = len(ops) * calls
        for rank, rep in enumerate(result.reports):
            for key in ("crash", "overdue"):
                if key in rep:
                    problems.append(f"{result.name} rank {rank}: {rep[key]}")
            checks = {k: v for k, v in rep.items() if k.startswith("slow/")}
            if len(checks) != expected:
                problems.append(f"{result.name} rank {rank}: {len(checks)} calls reported of {expected}")
            problems += [f"{result.name} rank {rank}: {k}: {v}" for k, v in checks.items() if v["status"] != "exact"]
    assert not problems, "\n".join(problems[:40])


def test_busy_cpus_change_no_result():
    """Busy processes on both cores: every op, twice, exact (each on one world size, alternating;
    with IRIS_CHAOS_ITERS on both); then a dead peer under the same load still makes every
    survivor raise (bound: timeout + slack)."""
    seeds = _seeds("load")
    specs = [(f"load/{w}/{s}", mixed_worker, w, (ops, 2, s)) for s in seeds for w, ops in _split(OPS)]
    specs += [(f"load-dead/{w}/{s}", dead_peer_worker, w, ("sigkill", ops, w - 1, s, T))
              for s in seeds for w, ops in _split(ALL_REDUCE + ("all_gather", "matmul_reduce_scatter/fused"))]
    results = run_worlds(specs, parallel=2, busy=3)
    problems = []
    for spec, result in zip(specs, results):
        if spec[1] is mixed_worker:
            for rank, rep in enumerate(result.reports):
                checks = {k: v for k, v in rep.items() if k.startswith("load/")}
                if len(checks) != 2 * len(spec[3][0]) or "done" not in rep:
                    problems.append(f"{result.name} rank {rank}: {len(checks)} calls, {rep.get('crash')}")
                problems += [f"{result.name} rank {rank}: {k}: {v}" for k, v in checks.items()
                             if v["status"] != "exact"]
        else:
            problems += _survivor_problems(result, spec[2] - 1, T, must_raise=True, upper=T + 2 * LOADED_SLACK)
    assert not problems, "\n".join(problems[:40])


# -- the sentinel's bit pattern and NaNs -----------------------------------------------------------------------

#: Bit patterns of each dtype fed through the sentinel and low-latency all_reduce: the sentinel
#: (all ones), NaNs of either sign and other payloads, infinities, zeros of either sign, ordinary values.
SPECIAL_BITS = {
    torch.float16: (0xFFFF, 0x7FFF, 0xFE00, 0x7E00, 0xFC01, 0x7C00, 0xFC00, 0x8000, 0x0000, 0x3C00, 0xBC00, 0x0001),
    torch.bfloat16: (0xFFFF, 0x7FFF, 0xFFC0, 0x7FC0, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x3F80, 0xBF80, 0x0080),
    torch.float32: (0xFFFFFFFF, 0x7FFFFFFF, 0xFFC00000, 0x7FC00000, 0xFF800001, 0x7F800000, 0xFF800000, 0x80000000,
                    0x00000000, 0x3F800000, 0xBF800000, 0x00000001),
}
_INT_OF = {2: torch.int16, 4: torch.int32}


def special_inputs(dtype, world: int, n: int, seed) -> list[torch.Tensor]:
    """Every rank's input: special bit patterns at random places, small integers elsewhere;
    element 0..k of rank 0 are each pattern against ones, so every pattern meets an ordinary value."""
    width = torch.finfo(dtype).bits
    patterns = torch.tensor([b - (1 << width) if b >> (width - 1) else b for b in SPECIAL_BITS[dtype]],
                            dtype=_INT_OF[width // 8])
    out = []
    for q in range(world):
        g = seeded_generator("special", str(dtype), seed, q)
        x = torch.randint(-4, 5, (n,), generator=g).to(dtype)
        bits = x.view(patterns.dtype)
        where = torch.rand(n, generator=g) < 0.3
        bits[where] = patterns[torch.randint(0, len(patterns), (int(where.sum()),), generator=g)]
        if q == 0:
            bits[:len(patterns)] = patterns
        out.append(bits.view(dtype))
    return out


def torch_reduction(xs: list, op: str) -> torch.Tensor:
    acc = xs[0].float()
    for x in xs[1:]:
        acc = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op](acc, x.float())
    return acc.to(xs[0].dtype)


def same_bits(got: torch.Tensor, expected: torch.Tensor, zero_ties: bool = False) -> tuple[bool, str]:
    """NaN where torch gives NaN, the same bits elsewhere; with ``zero_ties`` (max and min) either
    zero where torch gives a zero: +0 and -0 compare equal, and which one torch's own maximum
    returns depends on its kernel's path (vectorized or not), the GPU's on IEEE 754's order."""
    nan_g, nan_e = got.isnan(), expected.isnan()
    ints = _INT_OF[got.element_size()]
    differ = (nan_g != nan_e) | (~nan_e & (got.view(ints) != expected.view(ints)))
    if zero_ties:
        differ &= ~((got == 0) & (expected == 0))
    where = differ.nonzero().flatten()[:4]
    return not bool(differ.any()), (f"{int(differ.sum())} differ, at {where.tolist()}: got "
                                    f"{[hex(v & 0xFFFFFFFF) for v in got.view(ints)[where].tolist()]}, torch "
                                    f"{[hex(v & 0xFFFFFFFF) for v in expected.view(ints)[where].tolist()]}")


def special_bits_worker(rank, world, report, seed):
    ctx = _create(3.0)
    for algorithm in ("sentinel", "low_latency"):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            for op in ("sum", "max", "min"):
                for n in (64, 257):
                    xs = special_inputs(dtype, world, n, (seed, algorithm, op, n))
                    mine = xs[rank].to(DEVICE, copy=True)
                    key = f"bits/{algorithm}/{str(dtype)[6:]}/{op}/{n}"
                    try:
                        ctx.ccl.all_reduce(mine, op=op, algorithm=algorithm)
                        ok, detail = same_bits(mine.cpu(), torch_reduction(xs, op), zero_ties=op != "sum")
                        report[key] = True if ok else detail
                    except IrisError as error:
                        report[key] = f"raised: {str(error)[:300]}"
                        return
    _sync()
    ctx.destroy()


def test_sentinel_and_nan_patterns_give_torchs_bits():
    """All-ones elements (the sentinel's pattern), NaNs and infinities through the sentinel and
    low-latency all_reduce: NaN where torch gives NaN, torch's bits elsewhere. Without the
    sentinel escape in _sendable, an all-ones input is never seen as arrived: a timeout."""
    specs = [(f"bits/{w}/{s}", special_bits_worker, w, (s,)) for s in _seeds("bits") for w in (2, 3)]
    results = run_worlds(specs, parallel=2)
    problems = []
    for result in results:
        for rank, rep in enumerate(result.reports):
            checks = {k: v for k, v in rep.items() if k.startswith("bits/")}
            if len(checks) != 2 * 3 * 3 * 2 or "done" not in rep:
                problems.append(f"{result.name} rank {rank}: {len(checks)} checks; {rep.get('crash')}")
            problems += [f"{result.name} rank {rank}: {k}: {v}" for k, v in checks.items() if v is not True]
    assert not problems, "\n".join(problems[:40])


# -- on_timeout="trap" ----------------------------------------------------------------------------------------


def trap_worker(rank, world, report, op):
    compile_first((op,), "trap")
    ctx = _create(T, on_timeout="trap")
    report["warm"] = attempt(ctx, op, "warm")
    _sync()
    if rank == 1:
        os._exit(0)
    time.sleep(0.2)
    report["calling"] = True
    report["call"] = attempt(ctx, op, "call")  # the process ends inside the call
    report["after"] = True


def test_on_timeout_trap_ends_the_rank_with_sigabrt():
    """CPU ranks: the process ends (SIGABRT) inside the call. GPU ranks: the kernel traps, which
    takes the rank's CUDA context down: the call (its check) raises CUDA's error, never a result."""
    results = run_worlds([(f"trap/{op}", trap_worker, 2, (op,)) for op in ("all_reduce/one_shot", "device_barrier")],
                         parallel=2)
    for result in results:
        rep = result.reports[0]
        assert rep.get("warm", {}).get("status") == "exact", rep
        assert rep.get("calling") is True, rep
        if DEVICE == "cpu":
            assert "call" not in rep and "after" not in rep, rep
            assert result.exitcodes[0] == -signal.SIGABRT, result
        elif "call" in rep:
            assert rep["call"]["status"] == "other" and "CUDA error" in rep["call"]["message"], rep
        assert result.exitcodes[1] == 0, result


# -- mismatched calls -----------------------------------------------------------------------------------------

MISMATCHES = {
    "size": (("all_reduce", 100, torch.float32, "sum", None), ("all_reduce", 200, torch.float32, "sum", None)),
    "size/one_shot": (("all_reduce", 100, torch.float32, "sum", "one_shot"),
                      ("all_reduce", 200, torch.float32, "sum", "one_shot")),
    "size/sentinel": (("all_reduce", 100, torch.float32, "sum", "sentinel"),
                      ("all_reduce", 200, torch.float32, "sum", "sentinel")),
    "collective": (("all_reduce", 100, torch.float32, "sum", None), ("all_gather", 100, torch.float32, "sum", None)),
    "collective/one_shot": (("all_reduce", 100, torch.float32, "sum", "one_shot"),
                            ("all_gather", 100, torch.float32, "sum", None)),
    "dtype": (("all_reduce", 100, torch.float32, "sum", None), ("all_reduce", 100, torch.float16, "sum", None)),
    "dtype/sentinel": (("all_reduce", 100, torch.float32, "sum", "sentinel"),
                       ("all_reduce", 100, torch.float16, "sum", "sentinel")),
    "op": (("all_reduce", 100, torch.float32, "sum", None), ("all_reduce", 100, torch.float32, "max", None)),
    "algorithm": (("all_reduce", 100, torch.float32, "sum", "one_shot"),
                  ("all_reduce", 100, torch.float32, "sum", "two_shot")),
    # The last field: reduce's root. Each rank is the root of its own call, so neither pushes.
    "root": (("reduce", 100, torch.float32, "sum", None, 0), ("reduce", 100, torch.float32, "sum", None, 1)),
}


def mismatch_call(ctx, call, seed):
    """``(run, expected)``: the call, and its result had every rank made the same call."""
    collective, n, dtype, op, algorithm, *root = call
    world, rank = ctx.world_size, ctx.rank
    xs = [_ints((n,), dtype, "mismatch", seed, repr(call), q) for q in range(world)]
    mine = xs[rank].clone()
    if collective == "reduce":
        dst = root[0]
        return (lambda: ctx.ccl.reduce(mine, dst=dst)), torch_reduction(xs, op) if rank == dst else xs[rank]
    if collective == "all_gather":
        out = _filled((world * n,), dtype)
        return (lambda: ctx.ccl.all_gather(out, mine)), torch.cat(xs)
    return (lambda: ctx.ccl.all_reduce(mine, op=op, algorithm=algorithm)), torch_reduction(xs, op)


def mismatch_worker(rank, world, report, case, seed):
    compile_first(("all_reduce/one_shot",), seed)
    ctx = _create(1.5)
    report["warm"] = attempt(ctx, "all_reduce/one_shot", "warm")
    _sync()
    run, expected = mismatch_call(ctx, MISMATCHES[case][min(rank, 1)], seed)
    try:
        result = run()
        ctx.check()  # on GPUs the call need not have waited for its kernel: a failure surfaces here
        report["outcome"] = "exact" if torch.equal(result, expected) else (
            f"WRONG: returned normally, {int((result != expected).sum())} of {result.numel()} elements differ from "
            f"its own call's reference, e.g. {result[:4].tolist()} vs {expected[:4].tolist()}")
    except IrisError as error:
        report["outcome"] = f"raised {type(error).__name__}: {str(error)[:200]}"
    bounded_destroy(ctx)


def test_mismatched_calls_raise_or_return_exactly_their_own_reference():
    specs = [(f"mismatch/{case}/{s}", mismatch_worker, 2, (case, s)) for case in MISMATCHES for s in _seeds("mm")]
    results = run_worlds(specs, parallel=3)
    problems = []
    for result in results:
        for rank, rep in enumerate(result.reports):
            outcome = rep.get("outcome", f"no outcome: {rep.get('crash') or rep.get('overdue')}")
            if rep.get("warm", {}).get("status") != "exact" or not (outcome == "exact" or outcome.startswith("raised")):
                problems.append(f"{result.name} rank {rank}: {outcome}")
    assert not problems, "\n".join(problems)


# -- one thread at a time ---------------------------------------------------------------------------------


def test_a_context_used_from_two_threads_at_once_raises_instead_of_interleaving(ctx, monkeypatch):
    inside, release = threading.Event(), threading.Event()
    allocate = ctx.heap.allocate_strided

    def slow_allocate(*args, **kwargs):
        inside.set()
        assert release.wait(30), "the test never released the first call"
        return allocate(*args, **kwargs)

    monkeypatch.setattr(ctx.heap, "allocate_strided", slow_allocate)
    first = {}
    thread = threading.Thread(target=lambda: first.setdefault("tensor", ctx.zeros(4)))
    thread.start()
    try:
        assert inside.wait(30), "the first call never started"
        with pytest.raises(IrisError, match=r"another thread is inside a call on this context; a context is not "
                                            r"thread-safe"):
            ctx.zeros(4)
        with pytest.raises(IrisError, match="another thread is inside a call"):
            ctx.ccl.all_reduce(torch.ones(4, device=ctx.device))
    finally:
        release.set()
        thread.join(30)
    monkeypatch.undo()
    assert first["tensor"].eq(0).all()  # the first call was not disturbed
    ctx.free(first["tensor"])
    x = ctx.ones(4)  # and the context works again from this thread
    ctx.ccl.all_reduce(x)
    assert x.eq(1).all()
    ctx.free(x)


@triton.jit
def _never_published(acc, partials, arrived, slot, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A cut tile's part that never hands its sum over (a program of this GPU that never ran)."""
    pass


def cut_part_worker(rank, world, report, cache_dir) -> None:
    """The cut product with its parts' sums never published: what the call raises, how long it
    took, whether its output is NaN. In a process of its own, compiling into ``cache_dir``: the
    kernel compiled with the no-op is kept from every other process's Triton cache."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    from iris_triton.operations import gemm

    from fused_cases import parts_of

    gemm.publish_partial = _never_published  # before the kernel is first compiled in this process
    ctx = _create(T, (CUT,))
    report["cut"] = parts_of(DEVICE, ctx.world_size, CUT_STEPS) > 1
    call, _, out = prepare(ctx, CUT, 1)
    started = time.monotonic()
    try:
        call()
        ctx.check()  # GPUs: the kernel's give-up raises here
        report["raised"] = None
    except IrisTimeoutError as error:
        report["raised"] = str(error)
    report["seconds"] = time.monotonic() - started
    report["nan"] = bool(out.isnan().all())
    ctx.destroy()


def test_a_cut_tile_whose_other_parts_never_arrive_gives_up_on_this_rank_and_says_so(tmp_path):
    # The parts of a tile cut along K meet in one program of the same kernel: with their sums
    # never published, its wait gives up, the output is poisoned, and the error names no peer
    # (none is at fault) and says what waited.
    from iris_triton.protocol.waits import LOCAL_FAILURES

    (result,) = run_worlds([("cut_part", cut_part_worker, 1, (str(tmp_path),))], parallel=1)
    (rep,) = result.reports
    assert rep.get("done"), rep.get("crash") or rep.get("overdue") or rep
    assert rep["cut"], "the product's last wave is not cut: the test would check nothing"
    message = rep["raised"]
    assert message is not None, "the call returned normally"
    assert LOCAL_FAILURES["cut_part"] in message and "world rank(s)" not in message, message
    assert rep["seconds"] >= T
    assert rep["nan"]
