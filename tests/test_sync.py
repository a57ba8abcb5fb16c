"""Weight sync on Ray: bucket packing (pure), then the WeightSyncActor broadcasting a learner's rollout adapter
to every rank of two rollout replicas (W = 1 and W = 2), in lora and merged mode, for FlowGRPO and
DiffusionNFT; verification failures; a late-joining replica; receivers that die or stall. Every push takes
the learners' path to the actor (rayflow.sync.buckets.to_wire, then WeightSyncActor.push); the version
protocol itself is tested without Ray in test_sync_protocol.py."""

import dataclasses
import os
import re
import signal
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from rayflow import reference
from rayflow.config import RolloutConfig
from rayflow.models.lora import TRAINED_ADAPTER, adapter_parameters, add_lora
from rayflow.learner.worker import LearnerGroup, LearnerWorker
from rayflow.learner.spec import LearnerSpec
from rayflow.models import load_model
from rayflow.rollout.pool import RolloutPool
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.rollout.replica import RolloutReplica
from rayflow.sync.broadcast import ReceiveBuffers, verify_checksums
from rayflow.sync.buckets import checksum, from_wire, make_manifest, pack_all, plan_buckets, to_wire
from rayflow.sync.source import ReceiversLost, WeightSyncError
from rayflow.sync import weight_sync
from rayflow.sync.actor import WeightSyncActor
from rayflow.sync.weight_sync import WeightSync
from rayflow.types import RolloutRequest, SamplingParams
from tiny_run import GRPO, NFT, small_cfg, wait_until_dead

MODEL_CODE = {"diffusers", "transformers", "peft"}


# -- buckets (no Ray) ------------------------------------------------------------------------------

def test_buckets_split_by_size_and_dtype_and_round_trip():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(4, 4, generator=g),  # 64 B
        "b": torch.randn(8, generator=g),  # 32 B
        "c": torch.randn(40, generator=g),  # 160 B: alone, larger than a bucket
        "d": torch.randn(2, 2, generator=g).to(torch.bfloat16),  # another dtype
        "e": torch.randn(3, generator=g),
    }
    manifest = make_manifest(7, tensors, with_checksums=True)
    assert [s.name for s in manifest.specs] == ["a", "b", "c", "d", "e"]
    assert plan_buckets(manifest, bucket_bytes=100) == [[0, 1], [2], [3], [4]]
    packed = pack_all(manifest, tensors, bucket_bytes=100, device="cpu")
    assert [b.numel() for b in packed.buffers] == [24, 40, 4, 3]
    out = packed.tensors()
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
        assert checksum(out[name]) == manifest.checksums[[s.name for s in manifest.specs].index(name)]
    flipped = tensors["a"].clone()
    flipped[0, 0] = torch.nextafter(flipped[0, 0], torch.tensor(10.0))
    assert checksum(flipped) != checksum(tensors["a"])


def test_a_0_dim_tensor_is_checksummed_and_round_trips_through_the_wire_and_buckets():
    """A scalar parameter (none in the supported models yet): its checksum viewed a 0-dim tensor as bytes, which torch
    refuses for any dtype wider than a byte ("self.dim() cannot be 0"), so sync.verify_checksum failed every push."""
    tensors = {"scale": torch.tensor(0.75), "shift": torch.tensor(-2.0, dtype=torch.bfloat16), "w": torch.randn(3, 2)}
    assert checksum(tensors["scale"]) == checksum(torch.tensor([0.75])) != checksum(torch.tensor(0.5))
    manifest = make_manifest(3, tensors, with_checksums=True)
    packed = from_wire(to_wire(3, tensors), bucket_bytes=8, device="cpu", with_checksums=True)
    assert packed.manifest.checksums == manifest.checksums
    out = pack_all(manifest, tensors, bucket_bytes=8, device="cpu").tensors()
    verify_checksums(manifest, out, where="test")
    for name, t in tensors.items():
        assert out[name].shape == t.shape and out[name].dtype == t.dtype and torch.equal(out[name], t)


def test_receive_buffers_are_a_ring_that_never_reuses_a_slot_in_use():
    def staged(ring: ReceiveBuffers, version: int, in_use: set[int]) -> int:
        slot = ring.claim(in_use)
        ring.hold(version, slot)
        return slot

    ring = ReceiveBuffers(slots=3)
    cpu = torch.device("cpu")
    slots = [staged(ring, v, in_use=set(range(5, v))) for v in (5, 6, 7)]  # each one still staged as the next comes
    first = [ring.get(s, 0, 8, torch.float32, cpu) for s in slots]
    assert len({b.data_ptr() for b in first}) == 3  # three versions in use never share memory
    assert ring.get(ring.claim(in_use={6, 7}), 0, 8, torch.float32, cpu) is first[0]  # 8 reuses 5's, no longer used
    assert ring.get(slots[0], 1, 8, torch.float32, cpu) is not first[0]  # per bucket
    # Versions need not follow each other: 5 staged, 6 and 7 lost, the next group generation gets 8 (8 % 3 == 5 % 3).
    ring = ReceiveBuffers(slots=3)
    four, five = staged(ring, 4, in_use=set()), staged(ring, 5, in_use={4})
    assert ring.claim(in_use={4, 5}) not in (four, five)


# -- on Ray ----------------------------------------------------------------------------------------

def tiny_request(version_tag: str) -> RolloutRequest:
    params = SamplingParams(height=32, width=32, num_steps=2, guidance_scale=4.0, sde_type="sde")
    return RolloutRequest(version_tag, ["a red apple"], [0], [0], [5], params)


@pytest.fixture(scope="module", params=["lora", "merged"])
def rollout(request, ray_session, tiny_model_dir, tmp_path_factory):
    """Two replicas (W = 1 and W = 2) in one sync mode, shared by the tests of that mode (each syncs with `fresh_sync`)."""
    mode = request.param
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path_factory.mktemp(mode), f"sync.mode={mode}",
                    "sync.verify_checksum=true", "sync.bucket_mb=0.002", "sync.cpus=0.5")
    spec = dataclasses.replace(RolloutRankSpec.from_config(cfg), collective_timeout_s=60.0)
    replicas = [RolloutReplica(spec, RolloutConfig(cfg_parallel_size=w), name=f"sync-{mode}-w{w}") for w in (1, 2)]
    pool = RolloutPool([r.wait_ready() for r in replicas])
    yield mode, cfg, spec, pool
    pool.shutdown()


def fresh_sync(cfg, spec, pool: RolloutPool, name: str) -> WeightSync:
    """A WeightSync of its own over `pool`, whose ranks first forget the versions earlier tests pushed (as after the
    learners restarted from version 0: WeightSync.rewind's call), so a test's versions are new to them whatever ran
    before it."""
    ray.get([w.rewind_weights.remote(0) for r in pool.replicas for w in r.workers])
    return WeightSync(cfg.sync, spec, pool.replicas, timeout_s=60.0, name=name)


def push(sync: WeightSync, version: int, tensors: dict[str, torch.Tensor]) -> ray.ObjectRef:
    """Hand `tensors` to the sync actor as learner rank 0 does (LearnerWorker.push_weights); resolves once it holds them."""
    return sync.actor.push.remote(to_wire(version, tensors))


def expected_rank_weights(mode, model_dir, adapter: dict[str, torch.Tensor], alpha: float, rank: int):
    """What a rollout rank must hold: the adapter itself, or W + (alpha / r)·B@A for every adapted linear."""
    if mode == "lora":
        return adapter
    base = dict(load_model(model_dir).transformer.named_parameters())
    merged = {}
    for name in adapter:
        if name.endswith("lora_A.weight"):
            module = name[: -len(".lora_A.weight")]
            delta = adapter[f"{module}.lora_B.weight"] @ adapter[name] * (alpha / rank)
            merged[f"{module}.weight"] = base[f"{module}.weight"].detach() + delta
    return merged


@pytest.fixture(scope="module")
def trained_learners(ray_session, tiny_model_dir, tmp_path_factory):
    """[(recipe, steps, learner config, learner group)]: FlowGRPO trained 1 step, DiffusionNFT 2 (so the versions
    they push grow on the ranks), on the reference's rollouts. Shared by both sync modes: only read and pushed from."""
    trained = []
    try:
        for recipe, steps in ((GRPO, 1), (NFT, 2)):
            lcfg = small_cfg(recipe, tiny_model_dir, tmp_path_factory.mktemp("learner"))
            learners = LearnerGroup(LearnerSpec.from_config(lcfg), name=f"sync-learner-{lcfg.algorithm.name}")
            trained.append((recipe, steps, lcfg, learners))
            run = reference.build_run(lcfg)
            for _ in range(steps):
                batch, _ = reference.rollout(run)
                learners.get(learners.train_step(batch))
        yield trained
    finally:
        for *_, learners in trained:
            learners.shutdown()


def test_after_a_sync_every_rank_holds_the_learners_rollout_adapter_bit_for_bit(rollout, trained_learners, tiny_model_dir,
                                                                                monkeypatch):
    mode, cfg, spec, pool = rollout
    if mode == "lora":  # its actor in a plain worker process, as on a GPU machine or a cluster: its imports are its own
        plain = SimpleNamespace(options=lambda **options: WeightSyncActor.options(
            runtime_env={"env_vars": {"RAYFLOW_ZYGOTE": "0"}}, **options))
        monkeypatch.setattr(weight_sync, "WeightSyncActor", plain)
    sync = fresh_sync(cfg, spec, pool, f"sync-{mode}")
    try:
        pushed = 0
        for recipe, steps, lcfg, learners in trained_learners:
            version = learners.get(learners.push_weights(sync.actor))[0]["version"]
            assert version == steps > pushed
            report = sync.wait(version, timeout_s=60)
            pushed = steps
            assert learners.rollout_adapter_name == ("old" if recipe == NFT else TRAINED_ADAPTER)
            adapter = learners.get(learners.adapter_weights(learners.rollout_adapter_name))[0]
            expected = expected_rank_weights(mode, tiny_model_dir, adapter, lcfg.learner.lora_alpha, lcfg.learner.lora_rank)
            assert report.version == version and report.bytes == sum(t.numel() * t.element_size() for t in expected.values())
            for replica in pool.replicas:
                (trajectory,) = replica.generate(tiny_request(f"{mode}-{recipe}-{replica.name}"))
                assert trajectory.versions.tolist() == [version, version]  # applied before the first step
                for rank_weights in replica.adapter_weights():
                    assert rank_weights.keys() == expected.keys()
                    for name, t in expected.items():
                        assert torch.equal(rank_weights[name], t), f"{replica.name}: {name} differs after sync ({mode})"
        # The actor holds every rollout rank's handle (Ray imports the handle's class module) but, in lora mode,
        # never loaded the model code: rayflow/rollout/worker.py imports it when a rank is built (~4 s of CPU at every
        # start of a plain worker). Merged mode loads the transformer it folds into (rayflow.sync.fold).
        if mode == "lora":
            loaded = ray.get(sync.actor.__ray_call__.remote(lambda actor: sorted(MODEL_CODE & set(sys.modules))))
            assert loaded == [], f"the weight-sync actor imported {loaded}"
    finally:
        sync.shutdown()


def adapter_like(spec: RolloutRankSpec, model_dir: str, value: float) -> dict[str, torch.Tensor]:
    """A full rollout adapter (canonical names) filled with `value`: what a learner pushes in either mode."""
    model = load_model(model_dir)
    add_lora(model.transformer, rank=spec.lora_rank, alpha=spec.lora_alpha, targets=model.lora_target_modules)
    return {n: torch.full(p.shape, value) for n, p in adapter_parameters(model.transformer, TRAINED_ADAPTER).items()}


@pytest.mark.parametrize("broken", ["without to_out.0", "empty"])
def test_a_push_that_binds_other_modules_stops_the_sync_naming_them(rollout, tiny_model_dir, broken):
    mode, cfg, spec, pool = rollout
    full = adapter_like(spec, tiny_model_dir, 0.01)
    payload = {n: t for n, t in full.items() if ".to_out.0." not in n} if broken != "empty" else {}
    expected_error = r"missing \d+ tensors of modules .*to_out\.0" if broken != "empty" else r"no tensors given"
    sync = fresh_sync(cfg, spec, pool, f"sync-{mode}-{broken}")
    (before,) = pool.replicas[1].generate(tiny_request(f"before-failure-{mode}-{broken}"))
    try:
        if mode == "merged":  # the folding actor refuses it at once
            with pytest.raises(Exception, match=expected_error):
                ray.get(push(sync, 10, payload))
        else:  # every receiver refuses it; the sync stops
            ray.get(push(sync, 10, payload))
            with pytest.raises(Exception, match=expected_error):
                sync.wait(10, timeout_s=60)
            # The asynchronous driver's watch raises the cause too (it never waits for a version).
            failure = sync.failure(timeout_s=30)
            assert isinstance(failure, WeightSyncError) and re.search(expected_error, str(failure))
            with pytest.raises(Exception, match=expected_error):
                sync.lost_versions()
            with pytest.raises(WeightSyncError, match="stopped at version 10: .*" + expected_error):
                ray.get(push(sync, 11, full))
    finally:
        sync.shutdown()
    # Nothing was staged: the replicas still serve under their previous version.
    (trajectory,) = pool.replicas[1].generate(tiny_request(f"after-failure-{mode}-{broken}"))
    assert trajectory.versions.tolist() == before.versions.tolist()


def test_a_replica_that_joins_later_gets_the_current_version_before_serving(rollout, tiny_model_dir):
    mode, cfg, spec, pool = rollout
    sync = fresh_sync(cfg, spec, pool, f"sync-{mode}-late")
    late = RolloutReplica(spec, RolloutConfig(cfg_parallel_size=1), name=f"late-replica-{mode}").wait_ready()
    try:
        ray.get(push(sync, 20, adapter_like(spec, tiny_model_dir, 0.02)))
        sync.wait(20, timeout_s=60)
        pool.replicas[0].generate(tiny_request(f"apply-20-{mode}"))
        up_to_date = pool.replicas[0].adapter_weights()[0]

        sync.attach(late, [*pool.replicas, late])
        (trajectory,) = late.generate(tiny_request(f"late-{mode}"))
        assert trajectory.versions.tolist() == [20, 20]
        late_weights = late.adapter_weights()[0]
        assert late_weights.keys() == up_to_date.keys()
        assert all(torch.equal(late_weights[n], t) for n, t in up_to_date.items())
        # The new group generation reaches the old replicas and the late one alike.
        ray.get(push(sync, 21, adapter_like(spec, tiny_model_dir, 0.03)))
        sync.wait(21, timeout_s=60)
        for replica in (pool.replicas[1], late):
            (trajectory,) = replica.generate(tiny_request(f"v21-{mode}-{replica.name}"))
            assert trajectory.versions.tolist() == [21, 21]
    finally:
        sync.shutdown()
        late.shutdown()


class StubBackend:
    """What LearnerWorker.push_weights reads of its backend: the version and the rollout weights' wire."""

    def __init__(self, version: int, numel: int):
        self.version, self.numel = version, numel

    def rollout_wire(self):
        return to_wire(self.version, {"a.lora_A.weight": torch.full((self.numel,), float(self.version))})


def test_a_learners_pushes_reach_the_threaded_sync_actor_one_at_a_time_in_version_order(ray_session, tiny_model_dir, tmp_path):
    """The WeightSyncActor is threaded (max_concurrency > 1), so Ray runs its calls out of order and side by side:
    pushes sent back to back (asynchronous mode, short steps) were taken out of order, and the sync stopped with "push of
    version 7: not newer than version 8", or its newest version went back (39 after 40, which a late joiner got)."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "sync.verify_checksum=true", "sync.cpus=0.5")
    sync = WeightSync(cfg.sync, RolloutRankSpec.from_config(cfg), None, timeout_s=60.0, name="sync-push-order")
    try:
        ray.get(sync.actor.settle.remote())  # no group: every broadcast waits for one, only the pushes run
        learner = LearnerWorker(LearnerSpec.from_config(cfg), rank=0)
        for version in range(1, 41):  # large and small pushes in turn: a small one is taken while a large one is checksummed
            learner.backend = StubBackend(version, 2_000_000 if version % 2 else 10)
            learner.push_weights(sync.actor)
        deadline, newest = time.monotonic() + 30.0, None
        while newest != 40 and time.monotonic() < deadline:  # the last push is taken a moment after it is sent
            assert ray.get(sync.actor.lost_versions.remote()) == []  # raises the sync's failure: a push refused
            current = ray.get(sync.actor.current.remote())
            newest = current and current[0]
            time.sleep(0.05)
        assert newest == 40
    finally:
        sync.shutdown()


def test_a_push_the_sync_actor_does_not_take_is_reported_stalled_within_the_timeout_not_waited_for(ray_session,
                                                                                                     tiny_model_dir):
    """A weight-sync actor stuck inside a push (it neither dies nor returns): learner rank 0's next push waited for it
    with no deadline, blocking the learners' step until their watchdog blamed them. It waits spec.push_timeout_s, sends
    nothing, and reports the version not taken; the driver replaces the actor (test_faults.py)."""

    @ray.remote(num_cpus=0, max_concurrency=2)
    class StuckInPush:
        def push(self, wire):
            time.sleep(3600)

    cfg = small_cfg(GRPO, tiny_model_dir, "/tmp/unused-run")
    learner = LearnerWorker(dataclasses.replace(LearnerSpec.from_config(cfg), push_timeout_s=1.0), rank=0)
    actor = StuckInPush.remote()
    try:
        learner.backend = StubBackend(1, 10)
        assert "stalled_version" not in learner.push_weights(actor)  # sent: the actor is stuck in it
        learner.backend = StubBackend(2, 10)
        pushed: list[dict] = []
        thread = threading.Thread(target=lambda: pushed.append(learner.push_weights(actor)), daemon=True)
        start = time.monotonic()
        thread.start()
        thread.join(30.0)
        assert pushed, "learner rank 0 still waits for the push the actor never took"
        assert pushed[0]["stalled_version"] == 1 and pushed[0]["version"] == 2 and time.monotonic() - start < 10.0
    finally:
        ray.kill(actor)


def test_a_rollout_rank_that_does_not_answer_a_rewind_is_named_within_a_deadline_not_waited_for(ray_session):
    """A rollout rank stopped (it neither answers nor dies) after the pool's liveness check as the learners rewind:
    asked with no deadline to forget the newer versions, it hung the driver. The rewind names it after the time a
    join gets; the driver takes it out of service (its liveness check marks it stalled) and asks the rest again."""

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, stopped: bool):
            self.stopped = stopped

        def rewind_weights(self, version: int) -> None:
            if self.stopped:
                time.sleep(3600)

    ranks = [Rank.remote(False), Rank.remote(True)]
    replica = SimpleNamespace(name="r0", world_size=2, workers=ranks, alive=True, describe_rank=lambda r: f"rank {r} of 2")
    sync = object.__new__(WeightSync)  # only what a rewind that fails needs
    sync.actor, sync.deadline_s, sync.timeout_s = Rank.remote(False), 2.0, 1.0
    raised: list[BaseException] = []

    def rewind():
        try:
            sync.rewind(3, [replica])
        except BaseException as e:  # noqa: BLE001 (looked at below)
            raised.append(e)

    try:
        thread = threading.Thread(target=rewind, daemon=True)
        thread.start()
        thread.join(30.0)
        assert raised, "the rewind still waits for the stopped rank"
        assert isinstance(raised[0], TimeoutError)
        assert re.search(r"rank 1 of 2 of rollout replica 'r0' did not answer within 3s", str(raised[0]))
        assert "rank 0 of 2" not in str(raised[0])
    finally:
        for rank in ranks:
            ray.kill(rank)


@pytest.mark.parametrize("collective_timeout_s", [300.0, 600.0])
def test_learner_rank_0_waits_for_a_push_well_within_its_peers_collective_timeout(tiny_model_dir, tmp_path, monkeypatch,
                                                                                  collective_timeout_s):
    """Asynchronous, a step queued behind the one training: its peers go on into that step while learner rank 0 waits
    for the stuck push, and their first collective waits for rank 0 up to the learner group's timeout. Rank 0 waited
    rollout.collective_timeout_s, 300 s by default as the group's: with world size 2, a gloo group of 15 s and a wait
    of 15 s (or 25 s), rank 1 failed "Timed out waiting 15000ms" three times out of three, and the run stopped naming
    the learners. Rank 0 waits at most half the group's timeout."""
    import inspect

    import rayflow.learner.worker as worker

    class Joined(Exception):
        pass

    group_timeouts = []

    def init_default_group(rendezvous, rank, size, device,
                           timeout_s=inspect.signature(worker.init_default_group).parameters["timeout_s"].default):
        group_timeouts.append(timeout_s)
        raise Joined  # the group's timeout is all this test reads of the start-up

    monkeypatch.setattr(worker, "init_default_group", init_default_group)
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "learner.world_size=2",
                    f"rollout.collective_timeout_s={collective_timeout_s}")
    spec = LearnerSpec.from_config(cfg)
    with pytest.raises(Joined):
        LearnerWorker(spec, rank=1).setup(None)
    assert spec.push_timeout_s <= group_timeouts[0] / 2


def test_a_receiver_that_dies_or_stalls_is_left_out_and_the_newest_version_is_sent_again(ray_session, tiny_model_dir, tmp_path):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "sync.cpus=0.5")
    # 3 s, as test_faults.py's weight-sync stalls: the stalled receiver below is waited out in multiples of it.
    spec = dataclasses.replace(RolloutRankSpec.from_config(cfg), collective_timeout_s=3.0)
    pool = RolloutPool([RolloutReplica(spec, RolloutConfig(), name=f"lost-{i}").wait_ready() for i in range(2)])
    sync = WeightSync(cfg.sync, spec, pool.replicas, timeout_s=3.0, name="sync-lost")
    # The broadcast's collectives time out at 3 s, the receivers get as long and a grace to answer, and a waiter a grace
    # past that: the graces are the timeout itself when it is shorter than 10 s (a short timeout asks for quick verdicts).
    assert sync.deadline_s == 2 * 3.0 + 3.0 + 3.0
    replacement, stopped_pid = None, None
    try:
        ray.get(push(sync, 1, adapter_like(spec, tiny_model_dir, 0.01)))
        sync.wait(1, timeout_s=60)
        ray.kill(pool.replicas[1].workers[0])
        wait_until_dead(pool.replicas[1].workers[0])  # a receiver dying but not yet dead holds the send until its timeout
        start = time.monotonic()
        ray.get(push(sync, 2, adapter_like(spec, tiny_model_dir, 0.02)))
        with pytest.raises(ReceiversLost, match=r"receivers \[2\] .* version 2"):
            sync.wait(2, timeout_s=60)
        # The source closes the group as its send fails, so the survivor's side fails at once, not after its
        # collective timeout (0.1 s against the timeout, measured with 30 s; 300 s by default).
        assert time.monotonic() - start < spec.collective_timeout_s
        # Pushes go on; their broadcasts wait for a group without the dead rank.
        newest = adapter_like(spec, tiny_model_dir, 0.03)
        ray.get(push(sync, 3, newest))
        with pytest.raises(ReceiversLost):
            sync.wait(3, timeout_s=60)
        assert sync.lost_versions() == [2, 3]
        assert pool.replicas[0].check_alive() and not pool.replicas[1].check_alive()
        sync.connect(pool.replicas)  # the live replica only; the newest version is sent again
        assert sync.wait(3, timeout_s=60).version == 3 and sync.lost_versions() == []
        (trajectory,) = pool.replicas[0].generate(tiny_request("after-a-lost-receiver"))
        assert trajectory.versions.tolist() == [3, 3]
        held = pool.replicas[0].adapter_weights()[0]
        assert held.keys() == newest.keys() and all(torch.equal(held[n], t) for n, t in newest.items())
        # Later pushes go to the new generation as usual.
        ray.get(push(sync, 4, adapter_like(spec, tiny_model_dir, 0.04)))
        assert sync.wait(4, timeout_s=60).version == 4

        # A receiver stopped by the OS neither answers nor dies: the broadcast fails within its deadline instead
        # of holding the group (and the lock a new generation needs) forever.
        stalled = pool.replicas[0]
        stopped_pid = ray.get(stalled.workers[0].__ray_call__.remote(lambda worker: os.getpid()))
        os.kill(stopped_pid, signal.SIGSTOP)
        replacement = RolloutReplica(spec, RolloutConfig(), name="lost-2")  # loads while the broadcast fails
        start, newest = time.monotonic(), adapter_like(spec, tiny_model_dir, 0.05)
        ray.get(push(sync, 5, newest))
        with pytest.raises(ReceiversLost, match=r"receivers \[1\] .* died or stalled during the broadcast of version 5"):
            sync.wait(5, timeout_s=sync.deadline_s)
        assert time.monotonic() - start < sync.deadline_s
        assert not stalled.check_alive(timeout=2.0)  # what the driver's liveness check then finds
        replacement.wait_ready()
        # Its replacement (started meanwhile) joins a generation without it and is caught up to the newest version.
        sync.attach(replacement, [*pool.replicas, replacement])
        assert sync.wait(5, timeout_s=60).version == 5
        (trajectory,) = replacement.generate(tiny_request("after-a-stalled-receiver"))
        assert trajectory.versions.tolist() == [5, 5]
        held = replacement.adapter_weights()[0]
        assert all(torch.equal(held[n], t) for n, t in newest.items())
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        sync.shutdown()
        pool.shutdown()
        if replacement is not None:
            replacement.shutdown()


@pytest.mark.parametrize("family, expected_targets", [
    ("sd3", {"attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
             "attn.add_v_proj", "attn.to_add_out"}),
    ("flux", {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"}),
])
def test_merged_mode_folds_every_target_of_each_family(tiny_twin, tmp_path, family, expected_targets):
    """The folding actor's work for SD3 and FLUX.1: W + (alpha / r)·B@A for every adapted linear of the
    family's targets (the transport after it is the family-independent one tested above)."""
    from rayflow.paths import recipe as recipe_path
    from rayflow.sync.fold import AdapterFolder

    model_dir = tiny_twin(family)
    cfg = small_cfg(recipe_path(f"flowgrpo_{family}.yaml"), model_dir, tmp_path, "sync.mode=merged")
    spec = RolloutRankSpec.from_config(cfg)
    assert set(load_model(model_dir).lora_target_modules) == expected_targets
    adapter = adapter_like(spec, model_dir, 0.01)
    torch.manual_seed(0)
    adapter = {n: torch.randn_like(t) * 0.01 for n, t in adapter.items()}
    folded = AdapterFolder(spec)(adapter)
    expected = expected_rank_weights("merged", model_dir, adapter, spec.lora_alpha, spec.lora_rank)
    assert folded.keys() == expected.keys()
    assert all(any(name.endswith(f".{t}.weight") for name in folded) for t in expected_targets)
    for name, weight in expected.items():
        torch.testing.assert_close(folded[name], weight, rtol=0, atol=1e-6)
