"""The weight-sync version protocol without Ray: the source (rayflow.sync.source.WeightSource) over a fake
group and fake receivers, and one rollout rank's receiver (rayflow.sync.receiver.WeightReceiver) over plain
tensors. The same classes run inside the actors of test_sync.py."""

import threading
import time

import pytest
import torch

from rayflow.sync.buckets import make_manifest, pack_all, to_wire
from rayflow.sync.broadcast import SyncMismatch
from rayflow.sync.receiver import KEEP_STAGED, VOID_VERSION, VersionAbandoned, WeightReceiver
from rayflow.sync.source import ReceiversLost, SyncSpec, WeightSource, WeightSyncError

CPU = torch.device("cpu")
SPEC = SyncSpec(bucket_mb=32 / 2**20, timeout_s=0.2)  # 32-byte buckets: every push spans several broadcasts


def weights(value: float) -> dict[str, torch.Tensor]:
    return {"a.lora_A.weight": torch.full((2, 3), float(value)), "a.lora_B.weight": torch.full((3, 2), value + 0.5)}


# -- fakes of the source's collaborators ------------------------------------------------------------

class FakeGroup:
    """Rank 0 of a collective group: keeps what it broadcast."""

    def __init__(self):
        self.sent: list[torch.Tensor] = []
        self.destroyed = False

    def broadcast(self, tensor, src=0):
        assert src == 0
        self.sent.append(tensor.clone())
        return tensor

    def destroy(self):
        self.destroyed = True


class Died(RuntimeError):
    """A receiver's actor died."""


class FakeCalls:
    def __init__(self, outcomes: list, gate: threading.Event | None):
        self.outcomes, self.gate = outcomes, gate

    def wait(self, timeout_s):
        if self.gate is not None and not self.gate.wait(timeout_s):
            raise TimeoutError("receivers did not answer")
        if "stall" in self.outcomes:
            raise TimeoutError("receivers did not answer")
        for outcome in self.outcomes:
            if isinstance(outcome, Exception):
                raise outcome

    def lost(self, wait_s):
        return [rank for rank, o in enumerate(self.outcomes, start=1) if o == "stall" or isinstance(o, Died)]


class FakeReceivers:
    """Receivers that stage ("ok"), refuse ("refuse": a ValueError of their own), die ("dead") or never answer ("stall")."""

    def __init__(self, behaviours: list[str], gate: threading.Event | None = None):
        self.behaviours, self.gate = behaviours, gate
        self.staged: list[list[int]] = [[] for _ in behaviours]

    def __len__(self):
        return len(self.behaviours)

    def receive(self, manifest, bucket_bytes):
        outcomes = []
        for rank, behaviour in enumerate(self.behaviours):
            if behaviour == "ok":
                self.staged[rank].append(manifest.version)
            outcomes.append({"ok": None, "stall": "stall", "dead": Died("actor died"),
                             "refuse": ValueError("weights do not match the rollout rank's: missing 2 tensors")}[behaviour])
        return FakeCalls(outcomes, self.gate)


def source_with(behaviours, fold=None, gate=None):
    source = WeightSource(SPEC, CPU, fold)
    group, receivers = FakeGroup(), FakeReceivers(behaviours, gate)
    source.join(lambda: group, receivers)
    return source, group, receivers


def sent_values(group: FakeGroup) -> list[float]:
    return torch.cat(group.sent).tolist()


def flat(tensors: dict[str, torch.Tensor]) -> list[float]:
    return torch.cat([tensors[name].reshape(-1) for name in sorted(tensors)]).tolist()


# -- the source ---------------------------------------------------------------------------------------

def test_pushes_are_broadcast_in_push_order_and_wait_returns_each_versions_report():
    source, group, receivers = source_with(["ok", "ok"])
    assert source.current() is None
    for version in (1, 2, 5):
        assert source.push(to_wire(version, weights(version))) == version
    report = source.wait(5, timeout_s=10)
    assert (report.version, report.bytes) == (5, 12 * 4)
    assert source.wait(1, timeout_s=10).version == 1
    assert receivers.staged == [[1, 2, 5], [1, 2, 5]]
    assert sent_values(group) == flat(weights(1)) + flat(weights(2)) + flat(weights(5))
    assert len(group.sent) == 3 * 2  # 24 bytes a tensor: one bucket each
    version, current = source.current()
    assert version == 5 and flat(current) == flat(weights(5))
    source.close()


def test_push_returns_before_the_broadcast_and_wait_times_out_until_the_receivers_answer():
    gate = threading.Event()
    source = WeightSource(SyncSpec(bucket_mb=1, timeout_s=10), CPU)
    source.join(FakeGroup, FakeReceivers(["ok"], gate))
    assert source.push(to_wire(1, weights(1))) == 1
    with pytest.raises(TimeoutError, match="version 1 not done after 0.1s"):
        source.wait(1, timeout_s=0.1)
    gate.set()
    assert source.wait(1, timeout_s=10).version == 1
    source.close()


def test_settle_returns_only_once_the_broadcast_in_flight_has_ended():
    gate = threading.Event()
    source = WeightSource(SyncSpec(bucket_mb=1, timeout_s=10), CPU)
    source.join(FakeGroup, FakeReceivers(["ok"], gate))
    source.push(to_wire(1, weights(1)))
    while not source._lock.locked():  # the broadcast thread has taken version 1
        time.sleep(0.01)
    settled = threading.Event()
    thread = threading.Thread(target=lambda: (source.settle(), settled.set()))
    thread.start()
    assert not settled.wait(0.2), "settled while the receivers had not answered"
    gate.set()
    assert settled.wait(10)
    thread.join()
    assert source.wait(1, timeout_s=10).version == 1
    source.close()


def test_a_push_between_settle_and_join_is_broadcast_to_the_new_generation():
    """connect() settles, then the ranks and the source join a new generation. An asynchronous learner's push in
    between went to the old group, whose ranks were busy joining the new one: the source's join waited behind that
    broadcast until the ranks' join timed out, and the sync failed."""
    source, old_group, old_receivers = source_with(["ok"])
    source.push(to_wire(1, weights(1)))
    source.wait(1, timeout_s=10)
    source.settle()
    source.push(to_wire(2, weights(2)))
    time.sleep(0.2)
    assert old_receivers.staged == [[1]] and sent_values(old_group) == flat(weights(1))  # held
    new_group, new_receivers = FakeGroup(), FakeReceivers(["ok", "ok"])
    source.join(lambda: new_group, new_receivers)
    assert source.wait(2, timeout_s=10).version == 2
    assert new_receivers.staged == [[2], [2]] and sent_values(new_group) == flat(weights(2))
    source.close()


@pytest.mark.parametrize("second", [3, 2])
def test_a_push_not_newer_than_the_last_stops_the_sync_naming_the_version(second):
    source, group, receivers = source_with(["ok"])
    source.push(to_wire(3, weights(3)))
    source.wait(3, timeout_s=10)
    with pytest.raises(WeightSyncError, match=rf"stopped at version {second}: ValueError: push of version {second}: "
                                              r"not newer than version 3"):
        source.push(to_wire(second, weights(0)))
    for call in (lambda: source.wait(4, timeout_s=10), source.lost_versions, source.watch,
                 lambda: source.push(to_wire(4, weights(4)))):
        with pytest.raises(WeightSyncError, match=f"stopped at version {second}"):
            call()
    assert receivers.staged == [[3]]  # the refused push was never broadcast
    source.close()


def test_a_receiver_that_refuses_a_version_stops_the_sync_and_wakes_the_watcher():
    gate = threading.Event()
    source = WeightSource(SPEC, CPU)
    source.join(FakeGroup, FakeReceivers(["ok", "refuse"], gate))
    watched: list[BaseException] = []

    def watch():
        try:
            source.watch()
        except BaseException as e:
            watched.append(e)

    watcher = threading.Thread(target=watch)
    watcher.start()
    source.push(to_wire(1, weights(1)))
    gate.set()
    watcher.join(timeout=10)
    assert len(watched) == 1 and isinstance(watched[0], WeightSyncError)
    assert str(watched[0]) == ("weight sync stopped at version 1: ValueError: weights do not match the rollout rank's: "
                               "missing 2 tensors")
    with pytest.raises(WeightSyncError, match="stopped at version 1"):
        source.wait(1, timeout_s=10)
    source.close()


@pytest.mark.parametrize("loss", ["dead", "stall"])
def test_a_lost_receiver_holds_versions_for_the_next_generation_which_gets_the_newest(loss):
    source, group, receivers = source_with(["ok", loss])
    source.push(to_wire(1, weights(1)))
    with pytest.raises(ReceiversLost, match=r"receivers \[2\] of the weight-sync group \(ranks 1\.\.2\) died or stalled "
                                            r"during the broadcast of version 1"):
        source.wait(1, timeout_s=10)
    source.push(to_wire(2, weights(2)))
    source.push(to_wire(3, weights(3)))
    with pytest.raises(ReceiversLost, match="version 3 waits for a new weight-sync group"):
        source.wait(3, timeout_s=10)
    assert source.lost_versions() == [1, 2, 3]
    assert receivers.staged == [[1], []]  # nothing more was sent to the old generation

    group2, receivers2 = FakeGroup(), FakeReceivers(["ok"])
    source.join(lambda: group2, receivers2)
    assert group.destroyed and not group2.destroyed
    assert source.wait(3, timeout_s=10).version == 3
    assert receivers2.staged == [[3]]  # only the newest version is sent again
    assert sent_values(group2) == flat(weights(3))
    assert source.lost_versions() == []
    source.push(to_wire(4, weights(4)))
    assert source.wait(4, timeout_s=10).version == 4 and receivers2.staged == [[3, 4]]
    source.close()


def test_merged_mode_broadcasts_and_serves_the_folded_tensors():
    def fold(adapter):
        return {"a.weight": adapter["a.lora_B.weight"] @ adapter["a.lora_A.weight"]}

    source, group, receivers = source_with(["ok"], fold=fold)
    source.push(to_wire(1, weights(1)))
    report = source.wait(1, timeout_s=10)
    expected = fold(weights(1))
    assert report.bytes == 3 * 3 * 4 and sent_values(group) == flat(expected)
    assert flat(source.current()[1]) == flat(expected)
    assert flat(source.slot_tensors(weights(2))) == flat(fold(weights(2)))
    source.close()


# -- the receiver -------------------------------------------------------------------------------------

def receiver_with(value: float = 0.0, where: str = "rollout rank 0/1") -> tuple[WeightReceiver, dict[str, torch.Tensor]]:
    synced = weights(value)
    return WeightReceiver(lambda: synced, where), synced


def test_staging_checks_names_shapes_and_that_the_version_is_newer():
    receiver, _ = receiver_with()
    with pytest.raises(ValueError, match="missing 1 tensors"):
        receiver.stage(1, {"a.lora_A.weight": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="shape mismatches"):
        receiver.stage(1, {**weights(1), "a.lora_A.weight": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="rollout rank 0/1: staged version 0 is not newer than the applied version 0"):
        receiver.stage(0, weights(1))
    assert receiver.newest() == 0


def test_ranks_apply_the_minimum_of_their_newest_staged_versions():
    (first, held0), (second, held1) = receiver_with(where="rank 0"), receiver_with(where="rank 1")
    first.stage(1, weights(1))
    first.stage(2, weights(2))
    second.stage(1, weights(1))
    headers = [first.newest(), second.newest()]
    assert headers == [2, 1]
    assert first.agree(headers, apply=False) == 0 and flat(held0) == flat(weights(0))  # not at this boundary
    assert [first.agree(headers, apply=True), second.agree(headers, apply=True)] == [1, 1]
    assert flat(held0) == flat(weights(1)) == flat(held1)
    second.stage(2, weights(2))
    headers = [first.newest(), second.newest()]
    assert [first.agree(headers, apply=True), second.agree(headers, apply=True)] == [2, 2]
    assert flat(held0) == flat(weights(2)) == flat(held1)


def test_a_rank_waits_for_a_requests_min_version_until_the_receiving_thread_stages_it():
    receiver, _ = receiver_with()
    receiver.wait_for(0)  # held already: returns at once
    waited = threading.Event()

    def start_request():  # the sampling thread, as RolloutRank.generate with min_version 2
        receiver.wait_for(2)
        waited.set()

    thread = threading.Thread(target=start_request)
    thread.start()
    receiver.stage(1, weights(1))
    assert not waited.wait(0.2), "started under version 1 while the request asks for 2"
    receiver.stage(2, weights(2))
    assert waited.wait(5.0), "version 2 was staged but the request still waits"
    thread.join()
    assert receiver.agree([receiver.newest()], apply=True) == 2


def test_a_learner_restart_fails_the_requests_waiting_for_a_version_until_the_rewind():
    """A request waiting for version 2 when the learners die: the rewind to 1 voids 2 (and 2's push may have died with
    them), so it waited until the rollout watchdog replaced its replica, the new timeline's requests queued behind it.
    Abandoned, its wait ends at once unmet, and so does every later one of the old timeline, until the rewind (the
    replica's ranks then raise VersionAbandoned together: `check_held`); after it, requests wait for the new timeline's
    versions again."""
    receiver, _ = receiver_with()
    receiver.stage(1, weights(1))
    receiver.agree([1], apply=True)
    failed: list[BaseException] = []

    def start_request(version: int) -> None:  # the sampling thread, as RolloutRank.generate with min_version
        try:
            receiver.wait_for(version)
            receiver.check_held([receiver.newest()], version)
        except VersionAbandoned as e:
            failed.append(e)

    waiting = threading.Thread(target=start_request, args=(2,))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive(), "started without version 2"
    receiver.abandon_waits()
    waiting.join(5.0)
    assert not waiting.is_alive(), "the abandoned request still waits for version 2"
    assert len(failed) == 1 and "rollout rank 0/1: a request waited for version 2 (the replica's ranks hold [1])" in \
        str(failed[0])
    receiver.wait_for(3)  # a later request of the old timeline ends its wait at once, unmet
    with pytest.raises(VersionAbandoned):
        receiver.check_held([receiver.newest()], 3)
    receiver.wait_for(1)  # one the rank holds samples (and is dropped by the driver)
    receiver.check_held([receiver.newest()], 1)
    receiver.rewind(1)
    waiting = threading.Thread(target=start_request, args=(2,))  # the new timeline's version 2
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive() and len(failed) == 1, "after the rewind, a request waits for the new timeline's version"
    receiver.stage(2, weights(2))
    waiting.join(5.0)
    assert not waiting.is_alive() and len(failed) == 1


def test_applying_a_version_drops_older_staged_ones_and_staging_keeps_the_newest_two():
    receiver, held = receiver_with()
    for version in (1, 2, 3):
        receiver.stage(version, weights(version))
    assert KEEP_STAGED == 2 and receiver.newest() == 3
    with pytest.raises(KeyError, match=r"version 1 was agreed by the replica but is not staged on this rank \(staged: \[2, 3\]\)"):
        receiver.agree([3, 1], apply=True)  # a peer that lags by more than KEEP_STAGED - 1 versions
    receiver.stage(4, weights(4))  # 2 dropped: {3, 4}
    assert receiver.agree([4, 3], apply=True) == 3 and flat(held) == flat(weights(3))
    assert receiver.agree([4, 4], apply=True) == 4 and flat(held) == flat(weights(4))
    assert receiver.newest() == 4
    with pytest.raises(KeyError):  # nothing older than the applied version is kept
        receiver.staged.take(3)


def test_a_rewind_voids_newer_versions_until_the_checkpoints_version_is_staged_again():
    receiver, held = receiver_with()
    receiver.stage(3, weights(3))
    receiver.agree([3], apply=True)
    receiver.stage(4, weights(4))
    receiver.rewind(3)  # the applied version is the checkpoint's: kept, the staged later one dropped
    assert receiver.version == 3 and receiver.newest() == 3
    receiver.stage(4, weights(4))
    receiver.rewind(2)
    assert receiver.version == VOID_VERSION and receiver.newest() == VOID_VERSION
    assert receiver.agree([VOID_VERSION], apply=True) == VOID_VERSION and flat(held) == flat(weights(3))
    receiver.stage(2, weights(2))
    assert receiver.agree([2], apply=True) == 2 and flat(held) == flat(weights(2))


class ReplayGroup:
    """The receiving end of a group: each broadcast fills the buffer with the source's next bucket."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers, self.device = list(buffers), CPU

    def broadcast(self, tensor, src=0):
        tensor.copy_(self.buffers.pop(0))
        return tensor


def test_receive_verifies_checksums_stages_and_skips_a_version_it_applied():
    receiver, held = receiver_with(where="rollout rank 1/2")
    manifest = make_manifest(1, weights(1), with_checksums=True)
    packed = pack_all(manifest, weights(1), SPEC.bucket_bytes, CPU)
    receiver.receive(ReplayGroup(packed.buffers), manifest, SPEC.bucket_bytes)
    assert receiver.newest() == 1 and receiver.version == 0
    receiver.agree([1], apply=True)
    assert flat(held) == flat(weights(1))
    receiver.receive(ReplayGroup(packed.buffers), manifest, SPEC.bucket_bytes)  # re-sent to a new generation
    assert receiver.staged.newest(default=-5) == -5  # nothing staged again

    later = make_manifest(2, weights(2), with_checksums=True)
    corrupt = [b.clone() for b in pack_all(later, weights(2), SPEC.bucket_bytes, CPU).buffers]
    corrupt[1][0] += 1
    with pytest.raises(SyncMismatch, match=r"rollout rank 1/2: checksum mismatch after the broadcast of version 2 for "
                                           r"\['a.lora_B.weight'\]"):
        receiver.receive(ReplayGroup(corrupt), later, SPEC.bucket_bytes)
    assert receiver.newest() == 1


def received(receiver: WeightReceiver, version: int) -> None:
    manifest = make_manifest(version, weights(version))
    receiver.receive(ReplayGroup(pack_all(manifest, weights(version), SPEC.bucket_bytes, CPU).buffers), manifest,
                     SPEC.bucket_bytes)


def test_a_staged_version_is_never_overwritten_by_a_later_one_received_after_lost_broadcasts():
    """5 staged; 6 and 7 lost with a receiver of another replica; the next group generation gets only the newest, 8.
    Received into slot version % 3, 8 overwrote 5's tensors, and a replica whose other rank had not staged 8 yet agreed
    on 5 and loaded 8's bytes as version 5."""
    receiver, held = receiver_with()
    for version in (1, 2, 3, 4):
        received(receiver, version)
    receiver.agree([4], apply=True)
    received(receiver, 5)
    received(receiver, 8)
    assert receiver.agree([8, 5], apply=True) == 5 and flat(held) == flat(weights(5))
    assert receiver.agree([8], apply=True) == 8 and flat(held) == flat(weights(8))


class FailingGroup(ReplayGroup):
    """A broadcast that fails after its first bucket: the source closed the group (another receiver died)."""

    def __init__(self, buffers: list[torch.Tensor]):
        super().__init__(buffers)
        self.total = len(buffers)

    def broadcast(self, tensor, src=0):
        if len(self.buffers) < self.total:
            raise RuntimeError("connection closed by peer")
        return super().broadcast(tensor, src)


def test_a_staged_version_sent_again_in_a_broadcast_that_fails_keeps_its_buffers():
    """5 staged; sent again to a new group generation (its broadcast lost a receiver of another replica), and that
    broadcast fails too; the next generation gets 6. The failed reception recorded 5 in the slot it was received into
    again, so 6 was received into the slot 5's staged tensors still lived in: a replica whose other rank had not staged
    6 yet agreed on 5 and loaded 6's bytes as version 5."""
    receiver, held = receiver_with()
    received(receiver, 5)
    manifest = make_manifest(5, weights(5))
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        receiver.receive(FailingGroup(pack_all(manifest, weights(5), SPEC.bucket_bytes, CPU).buffers), manifest,
                         SPEC.bucket_bytes)
    received(receiver, 6)
    assert receiver.agree([6, 5], apply=True) == 5 and flat(held) == flat(weights(5))
    assert receiver.agree([6], apply=True) == 6 and flat(held) == flat(weights(6))


def test_a_reception_waits_while_every_slot_holds_a_version_still_read():
    """Two staged versions and one being applied fill the three slots: the next reception waits for the apply."""
    receiver, held = receiver_with()
    received(receiver, 1)
    received(receiver, 2)
    tensors = receiver.staged.take(1)  # the sampling thread is applying 1
    received(receiver, 3)  # 2 and 3 staged, 1 being read: every slot in use
    arrived = threading.Event()
    thread = threading.Thread(target=lambda: (received(receiver, 4), arrived.set()))
    thread.start()
    assert not arrived.wait(0.3)
    assert flat(tensors) == flat(weights(1))  # untouched while it is read
    receiver.staged.applied()
    assert arrived.wait(10)
    thread.join()
    assert receiver.agree([4], apply=True) == 4 and flat(held) == flat(weights(4))


def test_sampling_under_other_weights_restores_the_applied_ones():
    receiver, held = receiver_with(1.0)
    with receiver.sampling_under(weights(7)):
        assert flat(held) == flat(weights(7))
    assert flat(held) == flat(weights(1.0)) and receiver.version == 0
