"""``scripts/upstream_tests.py``: what its glue changes in upstream's tests (Gluon lanes
everywhere; devices on CPU ranks and on ranks sharing a GPU only) and how it sums up the ranks'
JUnit results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import upstream_tests  # noqa: E402 - a script beside the tests, not a package

SOURCE = ('layout = gl.BlockedLayout([1], [64], [1], [0])\n'
          'A = torch.randn(4, 4, device=f"cuda:{rank}")\n'
          'B = torch.zeros(4, device="cuda")\n'
          'heap_size = 2**33\n')


@pytest.mark.parametrize("on_cpu, shared_gpus", [(False, False), (False, True), (True, False)],
                         ids=["gpus", "shared_gpus", "cpu"])
def test_the_glue_rewrites_lanes_everywhere_and_devices_where_ranks_need_it(tmp_path, on_cpu, shared_gpus):
    (tmp_path / "test_k.py").write_text(SOURCE)
    upstream_tests.glue(tmp_path, on_cpu, 1 << 26, shared_gpus)
    glued = (tmp_path / "test_k.py").read_text()
    assert "gl.BlockedLayout([1], [32], [1], [0])" in glued
    assert ('device="cpu"' in glued and f"heap_size = {1 << 26}" in glued) == on_cpu
    assert ('device=f"cuda:{rank % torch.cuda.device_count()}"' in glued) == shared_gpus
    assert (glued.splitlines()[1:] == SOURCE.splitlines()[1:]) == (not on_cpu and not shared_gpus)


def test_the_summary_counts_each_files_outcomes_and_lists_each_failure_once(tmp_path):
    junit = tmp_path / "rank0.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="unittests.test_a" name="t1"/>'
        '<testcase classname="unittests.test_a" name="t2"><failure message="AssertionError: one&#10;more"/></testcase>'
        '<testcase classname="unittests.test_a" name="t3"><failure message="AssertionError: one"/></testcase>'
        '<testcase classname="unittests.test_b" name="t4"><skipped message="skip"/></testcase>'
        '<testcase classname="unittests.test_b" name="t5"><error message="RuntimeError: two"/></testcase>'
        '</testsuite></testsuites>')
    assert upstream_tests._summary(junit).splitlines() == [
        "test_a: 1 passed, 2 failed, 0 skipped", "    AssertionError: one",
        "test_b: 0 passed, 1 failed, 1 skipped", "    RuntimeError: two",
        "total: 1 passed, 3 failed, 1 skipped"]
