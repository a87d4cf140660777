"""``benchmarks.torch_collectives``: its uneven splits and its refusals of bad options (its
``--cpu`` run is part of ``iris bench --cpu``, tests/test_cli.py)."""

from __future__ import annotations


import pytest

from benchmarks.torch_collectives import GRAIN, parse_args, uneven_splits

@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [16, 64, 512, 4096 + 48, 1 << 20])
def test_every_rank_sends_its_whole_input_in_grains_and_the_ranks_receive_unevenly(world, n):
    matrix = uneven_splits(n, world)
    assert len(matrix) == world and all(len(row) == world and sum(row) == n for row in matrix), matrix
    assert all(split >= 0 and split % GRAIN == 0 for row in matrix for split in row), matrix
    received = [sum(column) for column in zip(*matrix)]
    if world > 1 and n >= 64 * GRAIN:  # grains enough for every share to differ
        assert all(len(set(row)) == world for row in matrix) and len(set(received)) == world, matrix


@pytest.mark.parametrize(("options", "message"), [
    (["--sizes", "100"], "size 100 B is not a multiple of 32 B"),
    (["--min", "1MiB", "--max", "1KiB"], "--min 1MiB is larger than --max 1KiB"),
    (["--sizes", "8KiB,lots"], "cannot read size 'lots'"),
    (["--repeats", "0"], "--repeats must be at least 1, got 0"),
])
def test_bad_options_are_refused_with_what_is_wrong(options, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--cpu", *options])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
