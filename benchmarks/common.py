"""What every benchmark records beside its figures: when, where, and with which versions."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def environment() -> dict[str, Any]:
    """Date, machine and software versions of this run."""
    import triton

    import iris

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "iris": iris.__version__,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        info["cpus"] = os.cpu_count()
    return info


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min and max of a list of timings."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "n": len(samples)}


def write_results(name: str, payload: dict[str, Any], out_dir: str | os.PathLike | None = None) -> Path:
    """Write ``payload`` plus the environment as ``<name>-<date>.json``; returns the path."""
    record = {"benchmark": name, "environment": environment(), **payload}
    directory = Path(out_dir) if out_dir else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stamp = record["environment"]["date"][:10]
    path = directory / f"{name}-{stamp}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
