"""Host time per kernel launch, one GPU: the two ways an iris collective's kernel is enqueued.

- ``jit``: ``kernel[grid](...)``, the first call of any shape (binding, specializing, lookup);
- ``repeat``: the repeat that :meth:`iris_triton.device.frontend.Frontend.launch` returns, which later
  identical calls use (the compiled kernel's runner), on the current stream looked up as the JIT does.

Each round enqueues ``--launches`` launches of a tiny kernel back to back and divides the host
time by their number; rounds alternate between the ways so that drift in the host's speed
hits all alike; the figure is the median over rounds. The kernel's result is checked first.

    python -m benchmarks.launch_overhead [--launches 2000] [--rounds 15] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton.language as tl


def add_one(x, n, BLOCK: tl.constexpr):
    """``x[:n] += 1``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + offs, tl.load(x + offs, mask=offs < n) + 1, mask=offs < n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_overhead needs a GPU")
    from iris_triton.device.frontend import TRITON, current_stream
    from benchmarks.common import write_results

    n = 1024
    x = torch.zeros(n, dtype=torch.int32, device="cuda")
    jitted = TRITON.kernel(add_one)
    repeat = TRITON.launch(add_one, (1,), x=x, n=n, BLOCK=n)
    ways = {"jit": lambda: jitted[(1,)](x, n, BLOCK=n), "repeat": lambda: repeat(current_stream())}
    for launch in ways.values():
        launch()
    torch.cuda.synchronize()
    correct = bool((x == 1 + len(ways)).all())  # the set-up launched once, then once per way
    samples = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, launch in ways.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.launches):
                launch()
            samples[name].append((time.perf_counter() - start) / args.launches * 1e6)
    torch.cuda.synchronize()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    for name, median in medians.items():
        print(f"{name:8s} {median:6.2f} us per launch (host), rounds {min(samples[name]):.2f}-{max(samples[name]):.2f}")
    print(f"correct {correct}")
    path = write_results("launch_overhead", {"unit": "us per launch, host", "correct": correct,
                                             "launches": args.launches, "median": medians, "rounds": samples}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
