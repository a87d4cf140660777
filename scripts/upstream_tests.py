"""Run upstream iris's own tests against this iris: the compatibility evidence.

Upstream's tests (its ``tests/`` folder, from a checkout of upstream iris, passed as
``--upstream``) are copied to a scratch folder, adjusted by launch glue only, and run with pytest
on ``--ranks`` ranks: started by ``iris.spawn`` (CPU ranks without a GPU, with Triton's
interpreter; one GPU per rank), or, with more ranks than GPUs, processes sharing GPU 0 in a gloo
process group (``iris.testing.run_sharing_one_gpu``: NCCL refuses two ranks on one GPU; the
device time-slices their kernels). The glue:

- Gluon kernels lay blocks out over AMD's 64-lane wavefronts (``gl.BlockedLayout([1], [64], ...)``):
  the lane count becomes 32, NVIDIA's warp;
- on CPU ranks, tensors made on ``cuda`` devices are made on the CPU, ``torch.cuda.synchronize``
  does nothing, and heaps are ``--cpu-heap`` bytes (upstream's 8 GiB per rank exceeds a laptop);
- on ranks sharing a GPU, ``cuda:{rank}`` devices take the rank modulo the GPUs there are, and
  ``torch.cuda.set_device`` leaves the rank on its GPU;
- on GPU ranks, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (unless set): memory torch
  allocates can then be mapped into the heap in place, as ``as_symmetric`` does with AMD's.

Each rank writes a JUnit file; the summary lists passed, failed and skipped tests per file, and
every distinct failure message. Example::

    python scripts/upstream_tests.py --upstream ~/src/iris --ranks 2 [-k "not 8192"] x ccl ops unittests
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

#: Upstream test files that exercise HIP/ROCr-only APIs, by name (DMA-BUF, ROCr's behaviour, HIP's
#: calls) or by what they call (HIP's virtual-memory primitives): not run.
AMD_ONLY_NAMES = re.compile(r"dmabuf|hip_apis|rocr")
AMD_ONLY_CALLS = re.compile(r"hipMem|mem_create|mem_address_reserve")
#: The environment glue on GPU ranks: torch's caching allocator makes memory that can be mapped into
#: a heap in place (upstream's ``as_symmetric``), as AMD's allocator makes by default.
GPU_ALLOCATOR = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


#: The glue every upstream file gets: Gluon blocks over AMD's 64 lanes get NVIDIA's 32.
LANES = (r"(BlockedLayout\(\s*\[[^\]]*\],\s*\[)64(\])", r"\g<1>32\2")
#: The glue on CPU ranks: tensors made on ``cuda`` devices are made on the CPU.
CPU_TENSORS = (r"""device=f?["']cuda(:\{?\w*\}?)?["']""", 'device="cpu"')
#: The glue on ranks sharing GPUs: rank ``r``'s ``cuda:{r}`` is GPU ``r`` modulo the GPUs there are.
SHARED_DEVICES = (r"""f(["'])cuda:\{(\w+)\}""", r"f\1cuda:{\2 % torch.cuda.device_count()}")


def glue(folder: Path, on_cpu: bool, cpu_heap: int, shared_gpus: bool = False) -> None:
    """The module's glue applied to every file under ``folder``."""
    for path in folder.rglob("*.py"):
        text = path.read_text()
        text = re.sub(*LANES, text)
        if on_cpu:
            text = re.sub(*CPU_TENSORS, text)
            text = re.sub(r"heap_size = 2\s*\*\*\s*33", f"heap_size = {cpu_heap}", text)
        elif shared_gpus:
            text = re.sub(*SHARED_DEVICES, text)
        path.write_text(text)


def _amd_only(path: Path) -> bool:
    return bool(AMD_ONLY_NAMES.search(path.name) or AMD_ONLY_CALLS.search(path.read_text()))


def _rank(rank: int, world: int, folder: str, files: list[str], out: str, shared_gpus: bool = False,
          select: str | None = None) -> int:
    import pytest
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None
    elif shared_gpus:  # the rank stays on the GPU it was given
        torch.cuda.set_device = lambda *args, **kwargs: None
    os.chdir(folder)
    sys.path.insert(0, folder)
    return int(pytest.main(["-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                            f"--junitxml={out}/rank{rank}.xml", *(["-k", select] if select else []), *files]))


def _summary(junit: Path) -> str:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures: dict[str, list[str]] = collections.defaultdict(list)
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = case.get("classname", "").rsplit(".", 1)[-1]
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        kind = "passed" if outcome is None else {"failure": "failed", "error": "failed"}.get(outcome.tag, "skipped")
        counts[name][kind] += 1
        if kind == "failed":
            message = (outcome.get("message") or "").splitlines()[0][:200] if outcome.get("message") else "?"
            if message not in failures[name]:
                failures[name].append(message)
    lines = []
    for name in sorted(counts):
        c = counts[name]
        lines.append(f"{name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
        lines += [f"    {message}" for message in failures[name]]
    total = sum(counts.values(), collections.Counter())
    lines.append(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, type=Path, help="a checkout of upstream iris")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--cpu-heap", type=int, default=1 << 30, help="bytes of heap per CPU rank")
    parser.add_argument("-k", dest="select", default=None,
                        help="pytest's -k expression: the tests to run (e.g. \"not 8192\": CPU ranks' interpreter "
                             "takes hours for upstream's largest sizes)")
    parser.add_argument("--bound", type=float, default=3600.0,
                        help="seconds ranks sharing a GPU may take in all (then they are killed)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "iris-upstream-tests")
    parser.add_argument("folders", nargs="+", help="folders under upstream's tests/ (x, ccl, ops, unittests)")
    args = parser.parse_args()
    import torch

    import iris

    scratch = Path(tempfile.mkdtemp(prefix="iris-upstream-"))
    shutil.copytree(args.upstream / "tests", scratch / "tests")
    on_cpu = not torch.cuda.is_available()
    shared_gpus = not on_cpu and args.ranks > torch.cuda.device_count()
    glue(scratch / "tests", on_cpu, args.cpu_heap, shared_gpus)
    if not on_cpu:
        os.environ.setdefault(*GPU_ALLOCATOR)
    files = sorted(str(path.relative_to(scratch / "tests")) for folder in args.folders
                   for path in (scratch / "tests" / folder).glob("test_*.py") if not _amd_only(path))
    args.out.mkdir(parents=True, exist_ok=True)
    rank_args = (args.ranks, str(scratch / "tests"), files, str(args.out))
    if shared_gpus:
        from iris.testing import run_sharing_one_gpu

        codes = run_sharing_one_gpu(_rank, *rank_args, True, args.select, world=args.ranks, bound=args.bound)
    else:
        codes = iris.spawn(_rank, args.ranks, *rank_args, False, args.select)
    for rank in range(args.ranks):
        print(f"== rank {rank} (pytest exit code {codes[rank]})")
        junit = args.out / f"rank{rank}.xml"
        print(_summary(junit) if junit.exists() else "no results")
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())
