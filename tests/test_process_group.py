"""CollectiveGroup's two timeouts, in two plain processes over loopback (no Ray): forming a group waits at least
FORM_TIMEOUT_FLOOR_S for a member that joins late, while each collective keeps the short timeout it was given."""

import multiprocessing
import time

import pytest
import torch

from rayflow.distributed import process_group
from rayflow.distributed.process_group import FORM_TIMEOUT_FLOOR_S, CollectiveError, CollectiveGroup, Rendezvous, free_port

LOOPBACK = "127.0.0.1"
COLLECTIVE_S = 1.0
LATE_S = 3.0
"""Rank 1 joins this late: three collective timeouts, well inside the formation floor."""


def member(rank: int, rendezvous: Rendezvous, results) -> None:
    process_group.node_ip = lambda: LOOPBACK  # what Ray reports on a loopback-only node
    if rank == 1:
        time.sleep(LATE_S)
    group = CollectiveGroup("late-join", rendezvous, rank, 2, "cpu", timeout_s=COLLECTIVE_S)
    tensor = torch.full((3,), float(rank + 1))
    results.put((rank, "gathered", [t.tolist() for t in group.all_gather(tensor)]))
    if rank == 1:
        return  # leaves rank 0 alone in the next collective
    start = time.monotonic()
    try:
        group.broadcast(tensor)
        results.put((rank, "broadcast returned", None))
    except CollectiveError as e:
        results.put((rank, "broadcast failed", (time.monotonic() - start, str(e))))


def test_a_late_member_joins_and_a_missing_peer_still_fails_a_collective_within_its_timeout():
    assert LATE_S < FORM_TIMEOUT_FLOOR_S
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    rendezvous = Rendezvous(LOOPBACK, free_port(LOOPBACK))
    ranks = [context.Process(target=member, args=(rank, rendezvous, results)) for rank in (0, 1)]
    for p in ranks:
        p.start()
    got = [results.get(timeout=60) for _ in range(3)]
    for p in ranks:
        p.join(timeout=30)
    gathered = {rank: value for rank, what, value in got if what == "gathered"}
    assert gathered == {0: [[1.0] * 3, [2.0] * 3], 1: [[1.0] * 3, [2.0] * 3]}
    (outcome,) = [(what, value) for rank, what, value in got if what.startswith("broadcast")]
    assert outcome[0] == "broadcast failed", outcome
    seconds, message = outcome[1]
    assert seconds < COLLECTIVE_S + 5.0, f"the broadcast waited {seconds:.1f}s, not its {COLLECTIVE_S}s timeout"
    assert "broadcast in group 'late-join' failed on rank 0/2" in message and "(timeout 1s)" in message
