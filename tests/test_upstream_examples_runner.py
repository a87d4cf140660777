"""``scripts/upstream_examples.py``: how it reads an upstream example's outcome (whole lines, so a
success line never matches inside a failure line) and what its glue changes."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest
import torch

_SPEC = importlib.util.spec_from_file_location("upstream_examples",
                                               Path(__file__).parents[1] / "scripts" / "upstream_examples.py")
runner = sys.modules["upstream_examples"] = importlib.util.module_from_spec(_SPEC)  # dataclasses look it up
_SPEC.loader.exec_module(runner)

STORE = runner.EXAMPLES["01_store"]
ALL_STORE = runner.EXAMPLES["03_all_store"]


@pytest.mark.parametrize(("output", "code", "expected"), [
    ("[Iris] [0/2] Validation successful.\n", 0, "validated"),
    ("Validation successful.\n", 0, "validated"),
    ("[Iris] [0/2] Validation not successful.\n", 0, "failed"),
    ("[Iris] [0/2] Validation successful. (after a retry)\n", 0, "failed"),
    ("[Iris] [0/2] Validation successful.\n[Iris] [1/2] Validation failed.\n", 0, "failed"),
    ("[Iris] [0/2] Validation successful.\n", 1, "failed"),
    ("", 0, "failed"),
])
def test_a_run_is_validated_only_by_its_whole_success_line(output, code, expected):
    assert runner.outcome(STORE, 2, code, output) == expected


def test_an_upstream_check_that_cannot_pass_is_told_apart_only_where_it_cannot():
    failing = "[Iris] [0/1] Mismatch at index 3\n[Iris] [0/1] Validation failed.\n"
    assert runner.outcome(ALL_STORE, 1, 0, failing) == "upstream check"
    assert runner.outcome(ALL_STORE, 2, 0, failing) == "failed"
    assert runner.outcome(ALL_STORE, 1, 1, failing) == "failed"


def test_examples_that_cannot_run_here_say_why():
    assert "2 ranks only" in runner.why_not(runner.EXAMPLES["06_put"], 1, True)
    assert "Gluon" in runner.why_not(runner.EXAMPLES["06_gluon"], 2, True)
    assert runner.why_not(runner.EXAMPLES["06_gluon"], 2, False) is None  # ranks share the GPUs there are
    assert runner.why_not(STORE, 2, True) is None and runner.why_not(STORE, 1, False) is None


@pytest.mark.parametrize("on_cpu, shared_gpus", [(False, False), (False, True), (True, False)],
                         ids=["gpus", "shared_gpus", "cpu"])
def test_the_glue_rewrites_lanes_everywhere_and_devices_where_ranks_need_it(tmp_path, on_cpu, shared_gpus):
    source = tmp_path / "upstream" / "examples" / "k.py"
    source.parent.mkdir(parents=True)
    source.write_text('layout = gl.BlockedLayout([1], [64], [1], [0])\nx = torch.zeros(4, device="cuda")\n'
                      'dist.init_process_group(backend="nccl", device_id=torch.device(f"cuda:{rank}"))\n'
                      'y = torch.ones(2, device=f"cuda:{rank}")\n'
                      'backend = "nccl" if torch.cuda.is_available() else "gloo"\n')
    root = runner.glued_copy(tmp_path / "upstream", tmp_path / "scratch", on_cpu, shared_gpus)
    glued = (root / "examples" / "k.py").read_text()
    assert "gl.BlockedLayout([1], [32], [1], [0])" in glued
    assert ('device="cpu"' in glued) == on_cpu and ('device="cuda"' in glued) == (not on_cpu)
    assert ('backend="gloo", device_id=None' in glued) == (on_cpu or shared_gpus)
    assert ('f"cuda:{rank % torch.cuda.device_count()}"' in glued) == shared_gpus
    assert ("nccl" in glued.splitlines()[-1]) == (not shared_gpus)  # on CPU ranks CUDA's absence chooses gloo
    site = root / "sitecustomize.py"
    assert site.exists() == (on_cpu or shared_gpus)
    assert shared_gpus == (site.exists() and "_shared_index" in site.read_text())


def test_ranks_sharing_a_gpu_take_the_gpu_of_their_index_modulo_the_gpus(tmp_path, monkeypatch):
    chosen, asked = [], []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_properties", asked.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    (tmp_path / "examples").mkdir()
    root = runner.glued_copy(tmp_path, tmp_path / "scratch", False, True)
    exec((root / "sitecustomize.py").read_text(), {})
    devices = (0, 1, 3, "cuda:5", torch.device("cuda:2"), "cuda", None, -1)
    for device in devices:
        torch.cuda.set_device(device)
        torch.cuda.get_device_properties(device)
    assert chosen == asked == [0, 1, 1, 1, 0, None, None, -1]  # no index: the current GPU, as torch takes it


def test_a_run_past_its_time_is_stopped_with_the_ranks_it_spawned(tmp_path):
    # The child holds the output pipe open: the run returns soon only if the child is killed too.
    spawner = ("import subprocess, sys, time; "
               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    started = time.monotonic()
    output, code = runner._run([sys.executable, "-c", spawner], tmp_path, dict(os.environ), timeout=1)
    assert code == -1 and "timed out after 1 s" in output
    assert time.monotonic() - started < 30
