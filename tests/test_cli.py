"""The ``iris`` command, as a user runs it (a subprocess of the installed console script)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

HAS_GPUS = torch.cuda.device_count() >= 2


def iris(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the console script installed beside this Python (else the one on PATH)."""
    beside = Path(sys.executable).parent / "iris"
    executable = str(beside) if beside.is_file() else shutil.which("iris")
    assert executable, "the iris console script is not installed (pip install -e .)"
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("command", [[], ["info"], ["demo"], ["bench"], ["run"]])
def test_every_command_has_help(command):
    proc = iris(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: iris" in proc.stdout


def test_info_names_backends_with_their_distributions_and_the_devices():
    proc = iris("info")
    assert proc.returncode == 0, proc.stderr
    assert "triton     iris_triton:TritonBackend        from iris-triton" in proc.stdout
    assert "heap providers: " in proc.stdout and "shm" in proc.stdout
    assert ("peer access" in proc.stdout) if torch.cuda.is_available() else ("no GPU visible" in proc.stdout)


def test_demo_checks_every_step_against_torch():
    proc = iris("demo", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for step in ("remote store into the next rank", "device-side barrier", "all_reduce (sum, low-latency)",
                 "all_reduce (sum, sentinel)", "all_reduce (sum, one-shot)", "all_reduce (max, two-shot)",
                 "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert any(line.startswith(step) and " ok " in line for line in proc.stdout.splitlines()), proc.stdout


def test_run_starts_ranks_of_a_script(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent('''
        import iris, torch
        ctx = iris.create(heap_size="8MiB")
        x = ctx.ones(5) * (ctx.rank + 1)
        ctx.ccl.all_reduce(x)
        print(f"rank {ctx.rank} of {ctx.world_size}: {x.sum().item():g}")
        ctx.destroy()
    '''))
    proc = iris("run", "-n", "3", "--cpu", str(script), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for rank in range(3):
        assert f"rank {rank} of 3: 30" in proc.stdout  # 5 x (1 + 2 + 3)


@pytest.mark.parametrize("args, message", [
    (["run", "-n", "2", "no_such_script.py"], "iris: error: no such script: no_such_script.py"),
    (["run", "-n", "0", __file__], "iris: error: -n must be at least 1, got 0"),
    (["demo", "--nprocs", "0"], "iris: error: --nprocs must be at least 1, got 0"),
    (["bench", "--only", "nope"], "iris: error: unknown benchmark(s) nope; choose from"),
])
def test_user_mistakes_are_one_line_errors(args, message):
    proc = iris(*args)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(HAS_GPUS, reason="the benchmarks run where 2 GPUs are visible")
def test_bench_without_gpus_says_what_it_needs():
    proc = iris("bench", "--quick")
    assert proc.returncode == 2
    assert proc.stderr == "iris: error: the benchmarks measure 2 GPUs against each other; " \
                          f"{torch.cuda.device_count()} visible\n"
