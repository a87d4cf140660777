"""Point-to-point transfers (``ctx.ccl.send`` / ``ctx.ccl.recv``) across real ranks.

One spawn per world size (2 and 3 ranks: CPU ranks, or GPUs where there are enough) runs
ring exchanges, pairwise exchanges in both directions with many messages back to back, and
transfers interleaved with collectives, on seeded random data of several dtypes and of sizes
below, at and many times the chunk that messages stream through; every result is compared
bit for bit with what torch.distributed's ``send``/``recv`` (gloo on CPU ranks, NCCL on GPUs)
delivered in the same worker, and with the sender's data. Bad calls are checked for their
errors; on 2 ranks, messages whose size or dtype differ between the pair fail both calls. On
GPUs, transfers captured in a CUDA graph replay with new data. Each rank returns ``{check
name: True | False | error text}``.

Two worlds cover what the transfers depend on: on 2 ranks a rank's next and previous rank in
the ring are the same peer, on 3 they differ, and the ring has two even ranks next to each
other (2 sends to 0 while 0 sends to 1, so a sender must not need its receiver to be
receiving); the pairs' rounds leave a rank out of each pair, and every peer index of the
per-peer regions other than the rank's own is used. A world of 4 runs the same kernels with
the same arithmetic (the peer's region, the slot, the chunk) on one more peer index.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import iris
from iris.collectives import SUPPORTED_DTYPES
from iris.errors import IrisError, IrisTimeoutError
from iris.testing import RankReport, assert_rank_checks, rank_device, seeded_generator, spawn_reports
from iris_triton.collectives import p2p

WORLDS = (2, 3)
#: dtypes checked: float32, bfloat16, int32, and the 8-bit ones where the collectives take them.
DTYPES = (torch.float32, torch.bfloat16, torch.int32) + tuple(
    d for d in (torch.int8, getattr(torch, "float8_e4m3fn", None)) if d in SUPPORTED_DTYPES)
#: Messages of ``2 * SLOTS + 1`` chunks and a part: the sender waits for its receiver's
#: acknowledgements within one message, and the slots are reused within one message.
MANY_CHUNKS = 2 * p2p.SLOTS + 1
#: Messages each pair exchanges back to back, per direction (every dtype, sizes changing).
BACK_TO_BACK = max(5, len(DTYPES))
#: Seconds a wait may take in the contexts whose calls are meant to fail.
SHORT_TIMEOUT = 10
#: Bytes of heap of the context whose chunks must shrink to fit (:func:`_check_small_heap`).
SMALL_HEAP = 64 << 10
#: What differs between a send and its recv in the mismatch checks.
MISMATCHES = ("size", "dtype")


def _per_chunk(ctx, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in one chunk of ``ctx``'s transfers."""
    return ctx.p2p_regions.chunk_bytes // torch.empty(0, dtype=dtype).element_size()


def _sizes(per_chunk: int) -> tuple[int, ...]:
    """Element counts of messages sent in chunks of ``per_chunk`` elements: one element, less than
    a chunk, one chunk exactly, many chunks and a part."""
    return 1, 37, per_chunk, MANY_CHUNKS * per_chunk + 17


def _bad_peers(world: int) -> tuple:
    """Peers that are not a rank of a world of ``world`` ranks."""
    return -1, world, 1.0, None


def _data(dtype: torch.dtype, n: int, *seed) -> torch.Tensor:
    """Seeded values every rank can recompute, spread over the dtype's range."""
    g = seeded_generator(*seed)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)


#: The integer type of each element size.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same elements of the same dtype, bit for bit."""
    a, b = a.cpu(), b.cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.element_size()]),
                                                                     b.view(BITS[b.element_size()]))


def _name(dtype: torch.dtype, n: int) -> str:
    return f"{str(dtype).removeprefix('torch.')}/n{n}"


def _torch_exchange(send_to: int | None, payload: torch.Tensor | None, recv_from: int | None,
                    like: torch.Tensor, send_first: bool) -> torch.Tensor | None:
    """torch.distributed's send/recv of the same message, in the same order (on ``like``'s
    device with NCCL, on the CPU with gloo); the process group moves the bytes (as integers of
    the element's size, which every gloo and NCCL build takes)."""
    bits = BITS[like.element_size()]
    device = like.device if dist.get_backend() == "nccl" else "cpu"
    received = torch.empty(like.shape, dtype=bits, device=device) if recv_from is not None else None
    steps = [lambda: dist.send(payload.to(device).view(bits), send_to) if send_to is not None else None,
             lambda: dist.recv(received, recv_from) if recv_from is not None else None]
    for step in steps if send_first else steps[::-1]:
        step()
    return None if received is None else received.view(like.dtype)


def _output(ctx, n: int, dtype: torch.dtype, on_heap: bool, keep: list) -> torch.Tensor:
    """A receive buffer holding a value no message has (so an element left unwritten shows)."""
    if on_heap:
        keep.append(ctx.full((n,), 7, dtype=dtype))
        return keep[-1]
    return torch.full((n,), 7, dtype=dtype, device=ctx.device)


def _input(ctx, values: torch.Tensor, on_heap: bool, keep: list) -> torch.Tensor:
    if on_heap:
        keep.append(ctx.as_symmetric(values.to(ctx.device)))
        return keep[-1]
    return values.to(ctx.device, copy=True)


def _free(ctx, keep: list) -> None:
    ctx.barrier()  # no peer still writes into what is freed (every rank allocated alike)
    while keep:
        ctx.free(keep.pop())


def _check_ring(ctx, report: RankReport) -> None:
    """Send to rank + 1, receive from rank - 1 (even ranks send first, so no rank waits on a
    rank that waits on it), with heap and plain tensors on either side."""
    rank, world = ctx.rank, ctx.world_size
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    case = 0
    keep: list = []
    for dtype in DTYPES:
        for n in _sizes(_per_chunk(ctx, dtype)):
            mine = _data(dtype, n, "ring", rank, n, str(dtype))
            expected = _data(dtype, n, "ring", prev, n, str(dtype))
            source = _input(ctx, mine, case % 2 == 0, keep)
            out = _output(ctx, n, dtype, case // 2 % 2 == 0, keep)
            case += 1
            send_first = rank % 2 == 0
            if send_first:
                ctx.ccl.send(source, nxt)
                received = ctx.ccl.recv(out, prev)
            else:
                received = ctx.ccl.recv(out, prev)
                ctx.ccl.send(source, nxt)
            by_torch = _torch_exchange(nxt, mine, prev, out, send_first)
            name = _name(dtype, n)
            report.check(f"ring/{name}/returns_its_tensor", received is out)
            report.check(f"ring/{name}/matches_the_sender", _same_bits(out, expected))
            report.check(f"ring/{name}/matches_torch_distributed", _same_bits(out, by_torch))
            report.check(f"ring/{name}/input_unchanged", _same_bits(source, mine))
    _free(ctx, keep)
    report.check("ring/no_wait_failed", not ctx.failed)


def _pair_message(ctx, i: int, a: int, b: int) -> tuple[int, torch.dtype, tuple]:
    """The size, dtype and seed of message ``i`` from ``a`` to ``b``: size and dtype change from
    one message to the next."""
    dtype = DTYPES[(i + a) % len(DTYPES)]
    sizes = _sizes(_per_chunk(ctx, dtype))
    return sizes[(i + a + b) % len(sizes)], dtype, ("pair", a, b, i, str(dtype))


def _check_pairs(ctx, report: RankReport) -> None:
    """Every pair in turn: ``BACK_TO_BACK`` messages from the lower rank to the higher, then as
    many back, with changing sizes, dtypes and data; the other ranks take no part."""
    rank, world = ctx.rank, ctx.world_size
    for a in range(world):
        for b in range(a + 1, world):
            if rank not in (a, b):
                continue
            for src, dst in ((a, b), (b, a)):
                got, by_torch, expected = [], [], []
                for i in range(BACK_TO_BACK):
                    n, dtype, seed = _pair_message(ctx, i, src, dst)
                    if rank == src:
                        ctx.ccl.send(_data(dtype, n, *seed).to(ctx.device), dst)
                    else:
                        got.append(ctx.ccl.recv(torch.full((n,), 7, dtype=dtype, device=ctx.device), src))
                        expected.append(_data(dtype, n, *seed))
                for i in range(BACK_TO_BACK):
                    n, dtype, seed = _pair_message(ctx, i, src, dst)
                    like = torch.empty(n, dtype=dtype, device=ctx.device)
                    if rank == src:
                        _torch_exchange(dst, _data(dtype, n, *seed), None, like, True)
                    else:
                        by_torch.append(_torch_exchange(None, None, src, like, False))
                if rank == dst:
                    report.check(f"pairs/{src}_to_{dst}/in_order_matching_the_sender",
                                 len(got) == BACK_TO_BACK and all(_same_bits(g, e) for g, e in zip(got, expected)))
                    report.check(f"pairs/{src}_to_{dst}/matches_torch_distributed",
                                 all(_same_bits(g, e) for g, e in zip(got, by_torch)))
    ctx.barrier()
    report.check("pairs/no_wait_failed", not ctx.failed)


def _check_interleaved(ctx, report: RankReport) -> None:
    """Rounds of a ring transfer, an all_reduce, a pair transfer (0 to the last rank) and a
    broadcast, with new data each round and no host synchronisation between the calls."""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    nxt, prev, last = (rank + 1) % world, (rank - 1) % world, world - 1
    n = 2 * _per_chunk(ctx, torch.float32) + 5
    results = []
    for r in range(3):
        out = torch.zeros(n, device=device)
        mine = _data(torch.float32, n, "interleaved", r, rank).to(device)
        if rank % 2 == 0:
            ctx.ccl.send(mine, nxt)
            ctx.ccl.recv(out, prev)
        else:
            ctx.ccl.recv(out, prev)
            ctx.ccl.send(mine, nxt)
        reduced = mine.clone()
        ctx.ccl.all_reduce(reduced)
        pair = torch.zeros(3 * n, device=device)
        if rank == 0:
            ctx.ccl.send(_data(torch.float32, 3 * n, "interleaved pair", r).to(device), last)
        elif rank == last:
            ctx.ccl.recv(pair, 0)
        shared = _data(torch.int32, n, "interleaved broadcast", r).to(device)
        if rank != r % world:
            shared.zero_()
        ctx.ccl.broadcast(shared, src=r % world)
        results.append((out, reduced, pair, shared))
    ok = {"ring": True, "all_reduce": True, "pair": True, "broadcast": True}
    for r, (out, reduced, pair, shared) in enumerate(results):
        everyone = [_data(torch.float32, n, "interleaved", r, q) for q in range(world)]
        ok["ring"] &= _same_bits(out, everyone[prev])
        ok["all_reduce"] &= torch.allclose(reduced.cpu(), sum(everyone[1:], everyone[0]), atol=1e-3)
        if rank == last:
            ok["pair"] &= _same_bits(pair, _data(torch.float32, 3 * n, "interleaved pair", r))
        ok["broadcast"] &= _same_bits(shared, _data(torch.int32, n, "interleaved broadcast", r))
    for what, passed in ok.items():
        report.check(f"interleaved/{what}", passed)
    ctx.barrier()
    report.check("interleaved/no_wait_failed", not ctx.failed)


def _raises(call, *fragments) -> bool | str:
    try:
        call()
    except (IrisError, TypeError) as error:
        return all(f in str(error) for f in fragments) or f"{type(error).__name__}: {error}"
    return "no error"


def _check_errors(ctx, report: RankReport) -> None:
    """Calls refused on the host, before anything is sent: a peer that is this rank or not a
    rank, and tensors the kernels cannot take. (Each rank checks alone: no peer is involved.)"""
    rank, world, device = ctx.rank, ctx.world_size, ctx.device
    t = torch.ones(8, device=device)
    for name, call in (("send", ctx.ccl.send), ("recv", ctx.ccl.recv)):
        peer = "dst" if name == "send" else "src"
        report[f"errors/{name}/own_rank"] = _raises(lambda: call(t, rank), f"{name}: {peer}={rank} is this rank")
        for bad in _bad_peers(world):
            report[f"errors/{name}/peer_{bad}"] = _raises(lambda: call(t, bad), f"{name}: {peer}={bad!r} is not a rank "
                                                          f"of this world (ranks 0..{world - 1})")
        other = (rank + 1) % world
        report[f"errors/{name}/not_contiguous"] = _raises(lambda: call(torch.ones(4, 4, device=device).t(), other),
                                                          f"{name}: tensor is not contiguous")
        report[f"errors/{name}/unsupported_dtype"] = _raises(
            lambda: call(torch.ones(4, dtype=torch.complex64, device=device), other), "dtype torch.complex64")
        report[f"errors/{name}/not_a_tensor"] = _raises(lambda: call([1.0], other),
                                                        f"{name}: tensor must be a torch.Tensor")
    report.check("errors/no_wait_failed", not ctx.failed)


def _check_cuda_graph(ctx, report: RankReport) -> None:
    """GPUs: rank 0 sends to rank 1 and rank 1 sends back, captured once in a CUDA graph (after
    a first eager exchange), then replayed with new data: the counts on the heap keep every
    replay's chunks apart."""
    rank, device = ctx.rank, ctx.device
    n = MANY_CHUNKS * _per_chunk(ctx, torch.float32) + 3
    x, y = torch.zeros(n, device=device), torch.zeros(n, device=device)

    def exchange():
        if rank == 0:
            ctx.ccl.send(x, 1)
            ctx.ccl.recv(y, 1)
        elif rank == 1:
            ctx.ccl.recv(y, 0)
            ctx.ccl.send(x, 0)

    if rank in (0, 1):  # the other ranks take no part
        exchange()
        torch.cuda.synchronize(device)
        stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            exchange()
        ok = True
        for replay in range(10):
            x.copy_(_data(torch.float32, n, "graph", rank, replay).to(device))
            graph.replay()
            ok &= _same_bits(y, _data(torch.float32, n, "graph", 1 - rank, replay))
        report.check("cuda_graph/replays_deliver_new_data", ok)
    ctx.barrier()
    report.check("cuda_graph/no_wait_failed", not ctx.failed)


def _expect_failure(ctx, call, operation: str, fragment: str) -> bool | str:
    """``call()`` fails with ``fragment`` in the error: raised by the call itself on CPU ranks,
    by the next iris call (``ctx.check()``) on GPUs."""
    raised_by = f"ctx.ccl.{operation}" if ctx.device.type == "cpu" else "ctx.check"
    try:
        call()
        ctx.check()
    except IrisTimeoutError as error:
        text = str(error)
        return (text.startswith(f"{raised_by}: on rank") and fragment in text) or text
    return "no error"


def _check_mismatches(rank: int, device: str, report: RankReport) -> None:
    """On 2 ranks: debug mode (which compares collectives' calls across all ranks) lets a pair's
    calls through; a message of another size, or of another dtype, fails the recv (its tensor
    poisoned) and the send (waiting for a slot, it learns of the refusal)."""
    with iris.create(heap_size="8MiB", device=device, debug=True, timeout=SHORT_TIMEOUT) as ctx:
        x = _data(torch.float32, 100, "debug").to(ctx.device)
        got = torch.zeros(100, device=ctx.device)
        if rank == 0:
            ctx.ccl.send(x, 1)
        else:
            ctx.ccl.recv(got, 0)
        report.check("mismatch/debug_mode_pair_call", rank == 0 or _same_bits(got, x))
    for what in MISMATCHES:
        ctx = iris.create(heap_size="8MiB", device=device, timeout=SHORT_TIMEOUT)
        sent = MANY_CHUNKS * _per_chunk(ctx, torch.float32)
        receiving = (torch.zeros(_per_chunk(ctx, torch.float32), device=ctx.device) if what == "size"
                     else torch.zeros(sent, dtype=torch.int32, device=ctx.device))
        if rank == 0:  # more chunks than slots: the send waits for its receiver, which refuses
            report[f"mismatch/{what}/send_fails"] = _expect_failure(
                ctx, lambda: ctx.ccl.send(_data(torch.float32, sent, "mismatch").to(ctx.device), 1), "send",
                "send: world rank(s) [1] refused this rank's message: its recv has another size or dtype")
        else:
            report[f"mismatch/{what}/recv_fails"] = _expect_failure(
                ctx, lambda: ctx.ccl.recv(receiving, 0), "recv",
                "recv: world rank(s) [0] sent a message of another size or dtype than this recv's")
            report.check(f"mismatch/{what}/recv_poisoned", bool((receiving.view(torch.int32) == -1).all()))
        report.check(f"mismatch/{what}/context_failed", ctx.failed)
        try:
            ctx.destroy()
        except IrisError:
            pass  # a failed context is released without waiting for its peer


def _check_small_heap(rank: int, device: str, report: RankReport) -> None:
    """A heap too small for the regions' usual chunks (upstream iris's examples default to 64 KiB)
    sets up with smaller ones, and a message of many of them arrives whole."""
    with iris.create("triton", heap_size=SMALL_HEAP, device=device) as ctx:
        chunk = ctx.p2p_regions.chunk_bytes
        report.check("small_heap/smaller_chunks", chunk < p2p.CHUNK_BYTES[ctx.kernel_device_type] and
                     2 * p2p.SLOTS * chunk <= SMALL_HEAP // p2p.HEAP_SHARE)
        x = _data(torch.float32, MANY_CHUNKS * _per_chunk(ctx, torch.float32) + 17, "small heap").to(ctx.device)
        got = torch.zeros_like(x)
        if rank == 0:
            ctx.ccl.send(x, 1)
        else:
            ctx.ccl.recv(got, 0)
        report.check("small_heap/message", rank == 0 or _same_bits(got, x))


def _p2p_worker(rank: int, device: str) -> bytes:
    report = RankReport(rank)
    ctx = iris.create("triton", heap_size="32MiB" if device == "cpu" else "256MiB", device=device)
    sections = [("ring", _check_ring), ("pairs", _check_pairs), ("errors", _check_errors),
                ("interleaved", _check_interleaved)]
    if device == "cuda":
        sections.append(("cuda_graph", _check_cuda_graph))
    for section, check in sections:
        with report.section(section):
            check(ctx, report)
    ctx.barrier()
    ctx.destroy()
    if ctx.world_size == 2:
        with report.section("mismatch"):
            _check_mismatches(rank, device, report)
        with report.section("small_heap"):
            _check_small_heap(rank, device, report)
    return report.packed()


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"world{w}")
def reports(request) -> list[dict]:
    device = rank_device(request.param, "triton")
    return spawn_reports(_p2p_worker, request.param, device, device=device)


def test_ring_exchanges_match_torch_distributed(reports):
    # Every size of every dtype, in the chunks of the device the ranks ran on (p2p.PeerRegions).
    chunk_bytes = p2p.CHUNK_BYTES[rank_device(len(reports), "triton")]
    names = {_name(dtype, n) for dtype in DTYPES for n in _sizes(chunk_bytes // dtype.itemsize)}
    assert_rank_checks(reports, "ring/", {f"ring/{name}/{check}" for name in names for check in (
        "returns_its_tensor", "matches_the_sender", "matches_torch_distributed", "input_unchanged")} | {
        "ring/no_wait_failed", "ring/completed"})


def test_pairs_exchange_back_to_back_in_both_directions(reports):
    world = len(reports)
    # Each rank checks the messages every other rank sent it.
    assert_rank_checks(reports, "pairs/", lambda rank: {
        f"pairs/{src}_to_{rank}/{check}" for src in range(world) if src != rank
        for check in ("in_order_matching_the_sender", "matches_torch_distributed")} | {
        "pairs/no_wait_failed", "pairs/completed"})


def test_transfers_interleave_with_collectives(reports):
    assert_rank_checks(reports, "interleaved/", {f"interleaved/{name}" for name in (
        "ring", "all_reduce", "pair", "broadcast", "no_wait_failed", "completed")})


def test_bad_calls_raise_clear_errors(reports):
    refusals = ("own_rank", *(f"peer_{bad}" for bad in _bad_peers(len(reports))), "not_contiguous",
                "unsupported_dtype", "not_a_tensor")
    assert_rank_checks(reports, "errors/", {f"errors/{call}/{refusal}" for call in ("send", "recv")
                                            for refusal in refusals} | {"errors/no_wait_failed", "errors/completed"})


def test_cuda_graph_capture_and_replay(reports):
    if rank_device(len(reports), "triton") != "cuda":
        pytest.skip("CUDA graphs need GPU ranks")
    # Ranks 0 and 1 exchange; the others take no part.
    assert_rank_checks(reports, "cuda_graph/", lambda rank: {"cuda_graph/no_wait_failed", "cuda_graph/completed"} | (
        {"cuda_graph/replays_deliver_new_data"} if rank < 2 else set()))


def test_messages_of_another_size_or_dtype_fail_both_calls(reports):
    if len(reports) != 2:
        pytest.skip("checked on 2 ranks")
    # Rank 0 sends, rank 1 receives.
    checks = {0: ("send_fails", "context_failed"), 1: ("recv_fails", "recv_poisoned", "context_failed")}
    assert_rank_checks(reports, "mismatch/", lambda rank: {f"mismatch/{what}/{check}" for what in MISMATCHES
                                                           for check in checks[rank]} | {
        "mismatch/debug_mode_pair_call", "mismatch/completed"})


def test_a_small_heap_streams_through_smaller_chunks(reports):
    if len(reports) != 2:
        pytest.skip("checked on 2 ranks")
    assert_rank_checks(reports, "small_heap/", {"small_heap/smaller_chunks", "small_heap/message",
                                                "small_heap/completed"})


# -- single-rank checks (the session context) -------------------------------------------------------------


def test_send_and_recv_are_registered_algorithms(ctx):
    assert ctx.ccl.algorithms("send") == ["direct"]
    assert ctx.ccl.algorithms("recv") == ["direct"]
    # A single rank has no peer to send to.
    with pytest.raises(IrisError, match=r"send: dst=0 is this rank"):
        ctx.ccl.send(torch.ones(4, device=ctx.device), 0)
    with pytest.raises(IrisError, match=r"recv: src=1 is not a rank of this world \(ranks 0\.\.0\)"):
        ctx.ccl.recv(torch.ones(4, device=ctx.device), 1)


def test_a_message_announces_its_exact_size_and_dtype():
    # The receiver compares the announcement exactly: any difference of size or dtype differs.
    a = p2p.announcement(torch.empty(1024))
    assert a != p2p.announcement(torch.empty(1025))
    assert a != p2p.announcement(torch.empty(1024, dtype=torch.int32))
    assert a != p2p.announcement(torch.empty(2048, dtype=torch.bfloat16))
    assert a == p2p.announcement(torch.empty(32, 32))
