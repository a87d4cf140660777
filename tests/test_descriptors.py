"""File descriptors handed between the ranks of one machine (:mod:`iris.heap.descriptors`): more
than one ``SCM_RIGHTS`` message holds, and different counts per rank, each arriving as the
file its sender meant (read back through the received descriptor)."""

from __future__ import annotations

import os

import pytest

from iris.context.bootstrap import Communicator
from iris.heap.descriptors import exchange
from iris.testing import RankReport, assert_rank_checks, spawn_reports

#: Descriptors rank ``r`` hands over: more than one message's worth on rank 0, none on the last.
COUNTS = {2: [300, 0], 3: [300, 1, 0]}


def _content(rank: int, index: int) -> bytes:
    return f"rank {rank} file {index}".encode()


def _handed(rank: int) -> bytes:
    report = RankReport(rank)
    comm = Communicator()
    counts = COUNTS[comm.world_size]
    mine = []
    for index in range(counts[rank]):
        fd = os.memfd_create("iris-test")
        os.write(fd, _content(rank, index))
        mine.append(fd)
    with report.section("exchange"):
        received = exchange(mine, counts, comm, "test")
        for peer, fds in enumerate(received):
            contents = [os.pread(fd, 64, 0) for fd in fds]
            report.check(f"exchange/from{peer}", contents == [_content(peer, i) for i in range(counts[peer])])
            for fd in fds:
                os.close(fd)
    return report.packed()


@pytest.mark.parametrize("world", sorted(COUNTS))
def test_descriptors_reach_every_peer_in_batches(world):
    reports = spawn_reports(_handed, world, device="cpu")
    assert_rank_checks(reports, "exchange/", {f"exchange/from{peer}" for peer in range(world)} | {"exchange/completed"})

