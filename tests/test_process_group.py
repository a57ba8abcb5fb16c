"""CollectiveGroup's two timeouts, in plain processes over loopback (no Ray): forming a group waits at least
FORM_TIMEOUT_FLOOR_S for a member that joins late, while each collective keeps the short timeout it was given; and a
rank whose collective failed releases its connections when it destroys the group, so its peers fail at once."""

import gc
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from ranks import FORKSERVER
from rayflow.distributed import process_group
from rayflow.distributed.process_group import (
    FORM_TIMEOUT_FLOOR_S,
    CollectiveError,
    CollectiveGroup,
    Rendezvous,
    listening_socket,
)

LOOPBACK = "127.0.0.1"
COLLECTIVE_S = 1.0
LATE_S = 3.0
"""Rank 1 joins this late: three collective timeouts, well inside the formation floor."""


def meet(rank: int, size: int, rendezvous_queue) -> Rendezvous:
    """Rank 0 takes a port of its own, held until its store opens on it (as a GroupHost does), and hands it to the
    others. A port picked free in the test's process could be taken by another process in the seconds before rank 0,
    a new process, bound it (a CI run met that race on a cluster's port: tests/cluster_weight_sync.py)."""
    process_group.node_ip = lambda: LOOPBACK  # what Ray reports on a loopback-only node
    if rank > 0:
        return rendezvous_queue.get(timeout=60)
    rendezvous = Rendezvous.on_this_node()
    for _ in range(size - 1):
        rendezvous_queue.put(rendezvous)
    return rendezvous


def member(rank: int, rendezvous_queue, results) -> None:
    rendezvous = meet(rank, 2, rendezvous_queue)
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


def test_a_rendezvous_holds_its_port_until_rank_0_opens_the_store_on_it(monkeypatch):
    """The port was picked free and let go until rank 0 bound it again: another group's rank 0 on the node could take
    it in between. Held, no other socket binds it; rank 0 opens its store on the held socket."""
    import datetime
    import errno
    import socket

    from rayflow.distributed.process_group import open_store

    monkeypatch.setattr(process_group, "node_ip", lambda: LOOPBACK)
    rendezvous = Rendezvous.on_this_node()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError) as taken:
        other.bind((LOOPBACK, rendezvous.port))
    assert taken.value.errno == errno.EADDRINUSE
    store, listener = open_store(rendezvous, 0, 1, datetime.timedelta(seconds=10))
    try:
        assert listener.getsockname() == (LOOPBACK, rendezvous.port)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store  # it closes the socket it listened on (as CollectiveGroup.destroy has it)
        listener.detach()


def test_a_late_member_joins_and_a_missing_peer_still_fails_a_collective_within_its_timeout():
    assert LATE_S < FORM_TIMEOUT_FLOOR_S
    context = FORKSERVER
    results, rendezvous = context.Queue(), context.Queue()
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


SURVIVOR_TIMEOUT_S = 30.0
"""The waiting peer's collective timeout: far longer than the test may take, as the default 300 s is."""


def broadcaster(rank: int, rendezvous_queue, results) -> None:
    """Rank 0 (the weight-sync source), rank 1 (a receiver that lives), rank 2 (a receiver that dies)."""
    rendezvous = meet(rank, 3, rendezvous_queue)
    group = CollectiveGroup("lost-receiver", rendezvous, rank, 3, "cpu", timeout_s=SURVIVOR_TIMEOUT_S)
    tensor = torch.full((3,), float(rank + 1))
    group.broadcast(tensor)
    if rank == 2:
        results.put((rank, "exits", None))
        return
    if rank == 0:
        time.sleep(1.0)  # rank 2 is gone and its connection known closed
        try:
            group.broadcast(tensor)
            results.put((rank, "broadcast returned", None))
        except CollectiveError as e:
            group.destroy()  # as rayflow.sync.source does, with the error still held
            results.put((rank, "broadcast failed", str(e)))
            time.sleep(SURVIVOR_TIMEOUT_S)  # alive: only destroy() can close its connections
        return
    time.sleep(2.0)  # rank 1 joins after rank 0 gave up
    start = time.monotonic()
    try:
        group.broadcast(tensor)
        results.put((rank, "survivor's broadcast ended", time.monotonic() - start))
    except CollectiveError:
        results.put((rank, "survivor's broadcast ended", time.monotonic() - start))


def test_a_destroyed_group_fails_the_peers_still_waiting_at_once_not_at_their_timeout():
    context = FORKSERVER
    results, rendezvous = context.Queue(), context.Queue()
    ranks = [context.Process(target=broadcaster, args=(rank, rendezvous, results), daemon=True) for rank in (0, 1, 2)]
    for p in ranks:
        p.start()
    try:
        got = {what: value for _, what, value in (results.get(timeout=60) for _ in range(3))}
    finally:
        for p in ranks:
            p.kill()
    assert "closed by peer" in got["broadcast failed"] and "rank 0/3" in got["broadcast failed"]
    waited = got["survivor's broadcast ended"]
    assert waited < 5.0, f"the survivor waited {waited:.1f}s for connections the source had destroyed"


class RefusingBackend:
    """A process group whose collectives fail as they are enqueued, with `error` (NCCL raises DistBackendError there
    on a communicator aborted by an earlier failure; gloo has no such path on the CPU)."""

    def __init__(self, error: Exception):
        self.error = error

    def broadcast(self, *args):
        raise self.error

    def allgather(self, *args):
        raise self.error


def test_a_collective_the_backend_refuses_as_it_is_enqueued_raises_collective_error(monkeypatch):
    """It came out of the enqueue raw, outside the wait's handling: a rollout replica took the DistBackendError for the
    request's own error, not a fault of the replica. An argument the backend refuses stays the caller's error."""
    monkeypatch.setattr(process_group, "node_ip", lambda: LOOPBACK)
    group = CollectiveGroup("aborted", Rendezvous.on_this_node(), 0, 1, "cpu", timeout_s=COLLECTIVE_S)
    live = group._pg
    try:
        group._pg = RefusingBackend(dist.DistBackendError("NCCL communicator was aborted on rank 0. Original reason"))
        for what, call in (("broadcast", lambda: group.broadcast(torch.ones(2))),
                           ("all_gather", lambda: group.all_gather(torch.ones(2)))):
            with pytest.raises(CollectiveError) as failed:
                call()
            assert f"{what} in group 'aborted' failed on rank 0/1" in str(failed.value)
            assert "NCCL communicator was aborted on rank 0" in str(failed.value)
            assert isinstance(failed.value.__cause__, dist.DistBackendError)
        group._pg = RefusingBackend(ValueError("Tensors must be contiguous"))
        with pytest.raises(ValueError, match="contiguous"):
            group.broadcast(torch.ones(2))
    finally:
        group._pg = live
        group.destroy()


class PolledWork:
    """A collective that completes at its `done_after`-th poll (never: None); its wait raises `error`, if any."""

    def __init__(self, done_after: int | None, error: RuntimeError | None = None):
        self.done_after, self.error, self.polls, self.waits = done_after, error, 0, 0

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done_after is not None and self.polls >= self.done_after

    def wait(self) -> None:
        self.waits += 1
        if self.error is not None:
            raise self.error


class PolledBackend:
    def __init__(self, work: PolledWork):
        self.work = work

    def allgather(self, *args):
        return self.work


def test_a_spinning_group_polls_its_collective_before_it_waits_and_still_raises_its_failure(monkeypatch):
    """spin_s (a CFG-parallel rollout rank's per-step gather): poll, yielding the core, until the collective completes
    or spin_s passes, then wait as before, so a failed or timed-out collective still raises CollectiveError."""
    monkeypatch.setattr(process_group, "node_ip", lambda: LOOPBACK)
    spin_s = 0.2
    group = CollectiveGroup("spin", Rendezvous.on_this_node(), 0, 1, "cpu", timeout_s=COLLECTIVE_S, spin_s=spin_s)
    live = group._pg
    try:
        group._pg = PolledBackend(done := PolledWork(done_after=3))
        group.all_gather(torch.ones(2))
        assert (done.polls, done.waits) == (3, 1)

        group._pg = PolledBackend(stuck := PolledWork(done_after=None, error=RuntimeError("Timed out waiting 1000ms")))
        start = time.perf_counter()
        with pytest.raises(CollectiveError, match="all_gather in group 'spin' failed on rank 0/1.*Timed out"):
            group.all_gather(torch.ones(2))
        assert time.perf_counter() - start >= spin_s and stuck.polls > 1 and stuck.waits == 1

        group.spin_s = 0.0  # the default: wait at once
        group._pg = PolledBackend(plain := PolledWork(done_after=1))
        group.all_gather(torch.ones(2))
        assert (plain.polls, plain.waits) == (0, 1)
    finally:
        group._pg = live
        group.destroy()


def test_a_group_that_fails_to_form_releases_its_port_at_once_and_its_socket_once(monkeypatch):
    """A member that never joins fails rank 0's construction (DistStoreError). The half-built group, held by the error's
    traceback, kept the port listening as long as the error lived, and the garbage collector then closed the listening
    descriptor twice: as the socket (the ResourceWarning) and as the store's server, which owns it."""
    monkeypatch.setattr(process_group, "node_ip", lambda: LOOPBACK)
    monkeypatch.setattr(process_group, "FORM_TIMEOUT_FLOOR_S", COLLECTIVE_S)
    rendezvous = Rendezvous.on_this_node()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(dist.DistStoreError) as failed:
            CollectiveGroup("never-joined", rendezvous, 0, 2, "cpu", timeout_s=COLLECTIVE_S)
        listening_socket(LOOPBACK, rendezvous.port).close()  # free while the error is still held (EADDRINUSE before)
        del failed
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed, unclosed
