"""iris's pytest plugin (``iris.testing``): the ``iris_ranks`` marker runs a test on N ranks.

The marked tests below are module-level functions taking ``rank_ctx``: each rank makes its own
context and runs the body; the plugin fails the test with every failing rank's traceback.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

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
