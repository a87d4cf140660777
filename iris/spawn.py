"""``iris.spawn``: run a function on N fresh rank processes with torch.distributed ready.

For scripts, notebooks and tests. Each rank is a new process (start method ``spawn``), so CUDA
and Triton start clean; CPU ranks get ``TRITON_INTERPRET=1`` before anything imports Triton.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.multiprocessing as mp

from iris.bootstrap import default_device_type

__all__ = ["spawn", "rank_environment"]


def rank_environment(nprocs: int, device: str, rendezvous: str) -> dict[str, str]:
    """Environment shared by all ranks of a local launch (rank variables are set per process).
    The ranks meet through the file ``rendezvous`` (in a private directory) instead of a TCP
    store, and gloo and NCCL keep their sockets on the loopback interface: nothing of a local
    launch listens on the network."""
    env = {
        "IRIS_RENDEZVOUS_FILE": rendezvous,
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "IRIS_DEVICE": device,
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
    }
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    return env


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables for the children started inside the block, then restore the parent's."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _run_rank(rank: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    import torch.distributed as dist

    from iris.bootstrap import ensure_process_group

    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    ensure_process_group(os.environ["IRIS_DEVICE"], timeout=float(os.environ.get("IRIS_TIMEOUT", 300)),
                         rendezvous_file=os.environ["IRIS_RENDEZVOUS_FILE"])
    try:
        results.put((rank, fn(rank, *args)))
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, device: str | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` new processes and return their results by rank.

    ``torch.distributed`` is initialized in each (gloo on CPU ranks; on GPUs nccl, one GPU per
    rank). ``fn`` and ``args`` must be picklable (a module-level function). An exception on any
    rank stops the others and is raised here with that rank's traceback.
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    device = device or default_device_type()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < nprocs:
        raise ValueError(
            f"spawn(nprocs={nprocs}, device='cuda') needs {nprocs} GPUs but "
            f"{torch.cuda.device_count()} are visible; lower nprocs or use device='cpu'"
        )
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="iris-spawn-") as private:  # 0700
        with _environment(rank_environment(nprocs, device, os.path.join(private, "rendezvous"))):
            procs = mp.start_processes(
                _run_rank, args=(fn, args, results), nprocs=nprocs, join=False, start_method="spawn"
            )
        return _collect(procs, results, nprocs)


def _collect(procs, results, nprocs: int) -> list[Any]:
    """Every rank's result, by rank, once all have exited."""
    # Drain results while waiting: a rank blocks in put() once the pipe is full, so reading only
    # after every rank exited would hang on large results.
    by_rank: dict[int, Any] = {}
    finished = False
    while not finished:
        finished = procs.join(timeout=0.1)
        while not results.empty():
            rank, value = results.get()
            by_rank[rank] = value
    return [by_rank[r] for r in range(nprocs)]
