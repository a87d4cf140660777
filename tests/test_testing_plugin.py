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
