"""Message passing between two ranks through the symmetric heap.

Rank 0 (producer) stores a message into rank 1's heap with remote stores, then releases a flag
on rank 1 (``signal``: an atomic exchange with release semantics at system scope). Rank 1
(consumer) acquires the flag (``wait_until``), reads the message from its own heap and
acknowledges, so the producer never overwrites a message before it was read. Every round sends
a different message; the consumer keeps all of them and the host compares them with torch.

    python examples/message_passing.py [--rounds 100] [--size 1024]

Runs on 2 GPUs when there are, else on 2 CPU ranks (Triton's interpreter).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import iris


@triton.jit
def producer_kernel(source, mailbox, flag, ack, heap_bases, rounds, n, max_spins, RANK: tl.constexpr,
                    PEER: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for r in range(1, rounds + 1):
        # Wait until the consumer has read the previous message (ack is on our own heap).
        iris.wait_until(ack, r - 1, RANK, RANK, heap_bases, max_spins)
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            message = tl.load(source + (r % 7) * n + start + offs, mask=mask) + r
            iris.store(mailbox + start + offs, message, RANK, PEER, heap_bases, mask=mask)
        iris.signal(flag, r, RANK, PEER, heap_bases)


@triton.jit
def consumer_kernel(mailbox, flag, ack, received, heap_bases, rounds, n, max_spins, RANK: tl.constexpr,
                    PEER: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    for r in range(1, rounds + 1):
        iris.wait_until(flag, r, RANK, RANK, heap_bases, max_spins)
        for start in range(0, n, BLOCK):
            mask = start + offs < n
            message = tl.load(mailbox + start + offs, mask=mask, volatile=True)
            tl.store(received + (r - 1) * n + start + offs, message, mask=mask)
        iris.signal(ack, r, RANK, PEER, heap_bases)


def expected_messages(source: torch.Tensor, rounds: int) -> torch.Tensor:
    """What the consumer must have received in each round."""
    r = torch.arange(1, rounds + 1, device=source.device)
    return source[r % source.shape[0]] + r[:, None].to(source.dtype)


def exchange(ctx, rounds: int, n: int, block: int = 256) -> bool:
    """Run ``rounds`` messages of ``n`` floats from rank 0 to rank 1; True on rank 1 when every
    message arrived intact and in order (rank 0 returns True once it has sent them all)."""
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    source = torch.randn(7, n, generator=generator, device=ctx.device)
    mailbox = ctx.zeros(n, dtype=torch.float32)
    flags = ctx.zeros(2, dtype=torch.int32)  # [flag, ack]
    received = torch.full((rounds, n), float("nan"), device=ctx.device)
    ctx.barrier()
    common = dict(rounds=rounds, n=n, max_spins=ctx.max_spins, RANK=ctx.rank, PEER=1 - ctx.rank, BLOCK=block)
    if ctx.rank == 0:
        producer_kernel[(1,)](source, mailbox, flags[0:], flags[1:], ctx.get_heap_bases(), **common)
    else:
        consumer_kernel[(1,)](mailbox, flags[0:], flags[1:], received, ctx.get_heap_bases(), **common)
    ctx.barrier()
    if ctx.rank == 0:
        return True
    return bool(torch.equal(received, expected_messages(source, rounds)))


def _run(rank: int, rounds: int, n: int) -> bool:
    with iris.create(heap_size="64MiB") as ctx:
        return exchange(ctx, rounds, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--size", type=int, default=1024, help="floats per message")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    rounds = args.rounds or (1000 if device == "cuda" else 20)
    ok = iris.spawn(_run, 2, rounds, args.size, device=device)
    print(f"{rounds} messages of {args.size} floats, rank 0 -> rank 1 on {device}: "
          f"{'all intact' if all(ok) else 'CORRUPTED'}")
    raise SystemExit(0 if all(ok) else 1)


if __name__ == "__main__":
    main()
