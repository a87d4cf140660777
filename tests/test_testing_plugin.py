"""iris's pytest plugin (``iris_pytest_plugin``, machinery in ``iris.testing``): the ``iris_ranks``
marker runs a test on N ranks.

The marked tests below are module-level functions taking ``rank_ctx``: each rank makes its own
context and runs the body; the plugin fails the test with every failing rank's traceback. The
plugin loads in every pytest run where iris is installed, so it must not import torch (seconds)
in projects that do not use it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import iris.testing
import iris_pytest_plugin
from iris.testing import rank_device

pytest_plugins = ["pytester"]


@pytest.mark.iris_ranks(2)
def test_all_reduce_on_two_ranks(rank_ctx):
    x = rank_ctx.ones(33) * (rank_ctx.rank + 1)
    rank_ctx.ccl.all_reduce(x)
    assert torch.equal(x.cpu(), torch.full((33,), 3.0))


@pytest.mark.iris_ranks(3, heap_size="16MiB")
def test_remote_views_on_an_odd_world(rank_ctx):
    mine = rank_ctx.full((5,), float(rank_ctx.rank))
    rank_ctx.barrier()
    right = (rank_ctx.rank + 1) % rank_ctx.world_size
    assert torch.equal(rank_ctx.heap.peer_view(mine, right).cpu(), torch.full((5,), float(right)))
    rank_ctx.barrier()


@pytest.mark.parametrize("size", [1, 19])
@pytest.mark.iris_ranks(2)
def test_parameters_and_fixtures_reach_every_rank(rank_ctx, size, tmp_path):
    (tmp_path / f"rank{rank_ctx.rank}").write_text(str(size))  # every rank sees the parent's tmp_path
    x = rank_ctx.full((size,), float(rank_ctx.rank + 1))
    rank_ctx.ccl.all_reduce(x)
    assert torch.equal(x.cpu(), torch.full((size,), 3.0))
    rank_ctx.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_a_fixture_that_does_not_pickle_is_a_usage_error(pytester):
    pytester.makepyfile(textwrap.dedent('''
        import threading

        import pytest

        @pytest.fixture
        def lock():
            return threading.Lock()

        @pytest.mark.iris_ranks(2)
        def test_wants_a_lock(rank_ctx, lock):
            pass
    '''))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*argument 'lock' cannot be sent to the ranks (TypeError: cannot pickle*"])
    assert result.ret != 0


def test_a_destroy_that_raises_is_reported_by_rank(pytester):
    rank_device(2)  # the plugin's ranks: skips where they would be skipped too
    pytester.makepyfile(textwrap.dedent('''
        import pytest

        @pytest.mark.iris_ranks(2)
        def test_destroy_fails_on_rank_one(rank_ctx):
            if rank_ctx.rank == 1:
                real = rank_ctx.destroy

                def destroy():
                    real()
                    raise RuntimeError("destroy went wrong on rank 1")

                rank_ctx.destroy = destroy
    '''))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the test failed on 1 of 2 ranks*", "*--- rank 1 of 2*",
                                 "*ctx.destroy() raised after the test body*", "*destroy went wrong on rank 1*"])


def test_a_failing_rank_is_reported_with_its_traceback(pytester):
    rank_device(2)  # the plugin's ranks: skips where they would be skipped too
    pytester.makepyfile(textwrap.dedent('''
        import pytest

        @pytest.mark.iris_ranks(2)
        def test_only_rank_one_fails(rank_ctx):
            assert rank_ctx.rank != 1, f"rank {rank_ctx.rank} disagrees"
    '''))
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the test failed on 1 of 2 ranks*", "*--- rank 1 of 2*", "*rank 1 disagrees*"])
    assert "--- rank 0 of 2" not in result.stdout.str()


def test_rank_ctx_without_the_marker_is_a_usage_error(pytester):
    pytester.makepyfile("def test_forgot_the_marker(rank_ctx):\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*only for tests marked @pytest.mark.iris_ranks*"])


# -- the plugin in a project that does not use it ----------------------------------------------------------

#: A conftest for the unrelated project: at the end of the session, what was imported, and whether
#: iris's plugin was loaded (its entry point's name is "iris") with its marker.
SESSION_RECORDER = """
import json
import sys
from pathlib import Path


def pytest_sessionfinish(session):
    modules = sorted(m for m in sys.modules if m in ("torch", "triton", "iris") or m.startswith(("torch.", "iris.")))
    Path(__file__).with_name("session.json").write_text(json.dumps({
        "modules": modules,
        "plugin": session.config.pluginmanager.hasplugin("iris"),
        "marker": any(line.startswith("iris_ranks(") for line in session.config.getini("markers")),
    }))
"""


def _iris_entry_point() -> str | None:
    found = [ep.value for ep in importlib.metadata.entry_points(group="pytest11") if ep.name == "iris"]
    return found[0] if found else None


@pytest.mark.parametrize(("args", "outcome"), [
    (["--collect-only", "-q"], "2 tests collected"),
    (["-q", "-m", "not iris_ranks"], "1 passed, 1 deselected"),
], ids=["collect-only", "run-unmarked"])
def test_a_project_that_does_not_use_the_plugin_does_not_import_torch(tmp_path, args, outcome):
    entry_point = _iris_entry_point()
    if entry_point is None:
        pytest.skip("iris is not installed as a distribution here (no pytest11 entry point): pip install -e .")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # the project's root: nothing of iris's tests/
    (tmp_path / "conftest.py").write_text(SESSION_RECORDER)
    (tmp_path / "test_plain.py").write_text("def test_arithmetic():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_marked.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.iris_ranks(2)
        def test_marked(rank_ctx):
            pass
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"pytest failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert outcome in proc.stdout
    session = json.loads((tmp_path / "session.json").read_text())
    assert session["plugin"] and session["marker"], f"iris's plugin was not loaded: {session}"
    assert session["modules"] == [], (f"the plugin (entry point {entry_point!r}) imported {session['modules']}; "
                                      f"if it names iris.testing, reinstall iris (pip install -e .)")


def test_the_marker_is_named_once_by_the_plugin():
    """The plugin owns the marker's name and hands the marker it found to the machinery
    (``iris.testing`` does not import the plugin, which imports it: no import circle)."""
    assert iris_pytest_plugin.MARKER == "iris_ranks"
    assert not hasattr(iris.testing, "MARKER")
    assert _iris_entry_point() in (None, "iris_pytest_plugin")


# -- assert_rank_checks (no ranks needed) -----------------------------------------------------------------


def _reports() -> list[dict]:
    """Two ranks' reports: a section of two checks on each, and rank 0's check of its own."""
    return [{"sum/a": True, "sum/b": True, "sum/completed": True, "sum/root": True, "other/a": True},
            {"sum/a": True, "sum/b": True, "sum/completed": True, "other/a": True}]


def test_assert_rank_checks_takes_the_exact_count_or_names():
    reports = _reports()
    iris.testing.assert_rank_checks(reports, "sum/", 7)
    iris.testing.assert_rank_checks(reports, "sum/", lambda rank: {"sum/a", "sum/b", "sum/completed"} | (
        {"sum/root"} if rank == 0 else set()))
    iris.testing.assert_rank_checks(reports, "other/", {"other/a"})


@pytest.mark.parametrize("expected, message", [
    (6, r"7 checks named sum/\*, expected 6; per rank \[4, 3\]; not on every rank: \['sum/root'\]"),
    (8, r"7 checks named sum/\*, expected 8"),
    ({"sum/a", "sum/b", "sum/c", "sum/completed"},
     r"rank 0: missing \['sum/c'\], extra \['sum/root'\]\n\s*rank 1: missing \['sum/c'\], extra \[\]"),
])
def test_assert_rank_checks_fails_on_a_missing_or_extra_check_naming_it(expected, message):
    # One line per rank (pytest indents the lines after the first where it rewrote iris.testing's asserts).
    with pytest.raises(AssertionError, match=message):
        iris.testing.assert_rank_checks(_reports(), "sum/", expected)


def test_assert_rank_checks_fails_on_a_failed_check_and_an_unfinished_section():
    reports = _reports()
    reports[1]["sum/b"] = "rank 1: 3 != 4"
    with pytest.raises(AssertionError, match=r"1 of 7 failed: \['r1/sum/b'\]\n\s*r1/sum/b: rank 1: 3 != 4"):
        iris.testing.assert_rank_checks(reports, "sum/", 7)
    reports[0]["other/completed"] = "rank 0: Traceback ..."
    with pytest.raises(AssertionError, match=r"r0/other/completed: rank 0: Traceback"):
        iris.testing.assert_rank_checks(reports, "sum/", 7)


@pytest.mark.parametrize("prefix, expected, error", [
    ("", 7, ValueError), ("sum", 7, ValueError), ("/", 7, ValueError), ("sum/", -1, ValueError),
    ("sum/", {"other/a"}, ValueError), ("sum/", "sum/a", TypeError), ("sum/", True, TypeError),
])
def test_assert_rank_checks_refuses_a_prefix_without_its_slash_and_bad_expectations(prefix, expected, error):
    with pytest.raises(error):
        iris.testing.assert_rank_checks(_reports(), prefix, expected)
