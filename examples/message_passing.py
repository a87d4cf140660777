"""Message passing between two ranks through the symmetric heap.

Rank 0 (producer) stores a message into rank 1's heap with remote stores, then releases a flag
on rank 1 (``signal``: an atomic exchange with release semantics at system scope). Rank 1
(consumer) acquires the flag (``wait_until``), reads the message from its own heap and
acknowledges, so the producer never overwrites a message before it was read. Every round sends
a different message; the consumer keeps all of them and the host compares them with torch.

A wait is bounded in wall-clock time: ``wait_until`` gives up after ``ctx.timeout_ns``
nanoseconds (the context's timeout, ``create(timeout=seconds)``) and returns False; each kernel
reports whether all of its waits succeeded, so a lost peer shows as a failed exchange, not a hang.

    python examples/message_passing.py [--rounds 100] [--size 1024] [--backend gluon]

Runs on 2 GPUs when there are, else on 2 CPU ranks (Triton's interpreter). The kernels are
written once and compiled by the backend's front end: with ``--backend gluon`` they are Gluon
kernels using ``IrisDeviceCtx`` (GPUs only).
"""

from __future__ import annotations

import argparse

import torch
import triton.language as tl

import iris


def producer_kernel(context, source, mailbox, flag, ack, waits_ok, rounds, n, timeout_ns, CTX: tl.constexpr,
                    RANK: tl.constexpr, PEER: tl.constexpr, BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, 2)
    offs = dctx.block_offsets(source, 0, BLOCK)
    ok = tl.program_id(0) >= 0  # a run-time boolean: every wait so far succeeded
    for r in range(1, rounds + 1):
        # Wait until the consumer has read the previous message (ack is on our own heap).
        ok = ok & dctx.wait_until(ack, r - 1, RANK, timeout_ns)
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            message = tl.load(source + (r % 7) * n + start + offs, mask=mask) + r
            dctx.store(mailbox + start + offs, message, PEER, mask=mask)
        dctx.signal(flag, r, PEER)
    tl.store(waits_ok, ok.to(tl.int32))


def consumer_kernel(context, mailbox, flag, ack, received, waits_ok, rounds, n, timeout_ns, CTX: tl.constexpr,
                    RANK: tl.constexpr, PEER: tl.constexpr, BLOCK: tl.constexpr):
    dctx = CTX.initialize(context, RANK, 2)
    offs = dctx.block_offsets(mailbox, 0, BLOCK)
    ok = tl.program_id(0) >= 0
    for r in range(1, rounds + 1):
        ok = ok & dctx.wait_until(flag, r, RANK, timeout_ns)
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            message = tl.load(mailbox + start + offs, mask=mask, volatile=True)
            tl.store(received + (r - 1) * n + start + offs, message, mask=mask)
        dctx.signal(ack, r, PEER)
    tl.store(waits_ok, ok.to(tl.int32))


def expected_messages(source: torch.Tensor, rounds: int) -> torch.Tensor:
    """What the consumer must have received in each round."""
    r = torch.arange(1, rounds + 1, device=source.device)
    return source[r % source.shape[0]] + r[:, None].to(source.dtype)


def exchange(ctx, rounds: int, n: int, block: int = 256) -> bool:
    """Run ``rounds`` messages of ``n`` floats from rank 0 to rank 1; True on rank 1 when every
    wait succeeded and every message arrived intact and in order (rank 0 returns True once it
    has sent them all, every wait for an acknowledgement having succeeded)."""
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    source = torch.randn(7, n, generator=generator, device=ctx.device)
    mailbox = ctx.zeros(n, dtype=torch.float32)
    flags = ctx.zeros(2, dtype=torch.int32)  # [flag, ack]
    received = torch.full((rounds, n), float("nan"), device=ctx.device)
    waits_ok = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    ctx.barrier()
    front = ctx.frontend  # compiles the kernels as Triton or as Gluon kernels, per the backend
    common = dict(rounds=rounds, n=n, timeout_ns=ctx.timeout_ns, CTX=front.device_context, RANK=ctx.rank,
                  PEER=1 - ctx.rank, BLOCK=block)
    context = ctx.get_device_context()
    if ctx.rank == 0:
        front.kernel(producer_kernel)[(1,)](context, source, mailbox, flags[0:], flags[1:], waits_ok, **common)
    else:
        front.kernel(consumer_kernel)[(1,)](context, mailbox, flags[0:], flags[1:], received, waits_ok, **common)
    ctx.barrier()
    if waits_ok.item() != 1:
        return False
    if ctx.rank == 0:
        return True
    return bool(torch.equal(received, expected_messages(source, rounds)))


def _run(rank: int, backend: str, rounds: int, n: int) -> bool:
    with iris.create(backend, heap_size="64MiB") as ctx:
        return exchange(ctx, rounds, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--size", type=int, default=1024, help="floats per message")
    parser.add_argument("--backend", default="triton", help="triton (GPUs or CPU ranks) or gluon (GPUs)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    runs_on = iris.registry.get_backend(args.backend).device_types
    if device not in runs_on:
        raise SystemExit(f"backend {args.backend!r} runs on {', '.join(sorted(runs_on))} only; this machine has "
                         f"fewer than 2 GPUs, so use --backend triton (CPU ranks)")
    rounds = args.rounds or (1000 if device == "cuda" else 20)
    ok = iris.spawn(_run, 2, args.backend, rounds, args.size, device=device)
    print(f"{rounds} messages of {args.size} floats, rank 0 -> rank 1 on {device} ({args.backend}): "
          f"{'all intact' if all(ok) else 'CORRUPTED'}")
    raise SystemExit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
