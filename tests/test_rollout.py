"""Rollout ranks, replicas and pools against the single-process sampler.

First without Ray (RolloutRank instances as threads over an in-process group, so weight staging can
be placed at an exact step), then on the session's local Ray: W in {1, 2, 3} x N in {1, 2, 3},
bad requests, a pool of replicas, weights staged on live actors, a killed rank, tools/generate.py.
"""

import dataclasses
import importlib.util
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from rayflow.cfg.policy import DualNegativeCFG, TrueCFG, guidance_policy
from rayflow.config import ModelConfig, RolloutConfig
from rayflow.data.prompts import PromptGroup
from rayflow.errors import ConfigError
from rayflow.models.lora import TRAINED_ADAPTER, adapter_parameters, add_lora
from rayflow.models import load_model
from rayflow.rollout.rank import RolloutRank, TimedGroup
from rayflow.rollout.pool import RolloutPool
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.sync.receiver import VOID_VERSION, VersionAbandoned
from rayflow.sampling.denoise import advance, finish_rollout, generate, local_guided_velocity, start_rollout
from rayflow.types import RolloutRequest, SamplingParams
from test_cfg_parallel import ThreadGroup, run_ranks

PROMPTS = ["a red apple", "a blue car on a green hill"]  # different lengths: padded, masked conditioning
POLICIES = {1: TrueCFG(), 2: TrueCFG(), 3: DualNegativeCFG(avoid_prompt="dark")}
LORA = dict(lora_rank=4, lora_alpha=4.0, seed=3)


def request(request_id="r", steps=4, guidance=4.0, seeds=(11, 12), **params) -> RolloutRequest:
    params = SamplingParams(height=32, width=32, num_steps=steps, guidance_scale=guidance, sde_type="sde", **params)
    n = len(seeds)
    return RolloutRequest(request_id, (PROMPTS * n)[:n], list(range(n)), list(range(n)), list(seeds), params)


def spec_for(model_dir, **kwargs) -> RolloutRankSpec:
    return RolloutRankSpec(model=ModelConfig(path=model_dir), **{"collective_timeout_s": 60.0, **LORA, **kwargs})


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g.latents, w.latents) and g.latent_indices == w.latent_indices
        assert torch.equal(g.log_probs, w.log_probs) and torch.equal(g.versions, w.versions)
        assert torch.equal(g.image, w.image) and g.seed == w.seed and g.prompt == w.prompt


def lora_model(model_dir):
    """The oracle's model: the base model with the same LoRA slot a rank adds."""
    model = load_model(model_dir)
    torch.manual_seed(LORA["seed"])
    add_lora(model.transformer, rank=LORA["lora_rank"], alpha=LORA["lora_alpha"], targets=model.lora_target_modules)
    return model


def random_adapter(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    params = adapter_parameters(model.transformer, TRAINED_ADAPTER)
    return {n: 0.3 * torch.randn(p.shape, generator=g) for n, p in params.items()}


@torch.no_grad()
def set_adapter(model, tensors):
    for name, p in adapter_parameters(model.transformer, TRAINED_ADAPTER).items():
        p.copy_(tensors[name])


@torch.no_grad()
def oracle(model, req, policy, switches: dict[int, tuple[int, dict]], version=0):
    """The single-process loop; `switches[k] = (version, weights)` loads weights after step k."""
    state = start_rollout(model, req, policy)
    while not state.done:
        advance(state, local_guided_velocity(model, state, policy), version)
        if state.step - 1 in switches:
            version, weights = switches[state.step - 1]
            set_adapter(model, weights)
    return finish_rollout(model, state)


# --- without Ray ---------------------------------------------------------------------------------


def test_a_one_rank_replica_gathers_without_its_backend():
    """The backend's wait blocked the sampling thread at every step: on a 2-core VM a one-rank replica sampled 20-25%
    slower than the same loop without the gather (README, Pipeline). Its gather is its own tensor."""

    class Refusing:
        rank, size = 0, 1

        def all_gather(self, tensor):
            raise AssertionError("a one-rank gather reached the backend")

    tensor = torch.arange(6.0).reshape(2, 3)
    (gathered,) = TimedGroup(Refusing()).all_gather(tensor)
    assert torch.equal(gathered, tensor) and gathered.data_ptr() != tensor.data_ptr()  # a new tensor, as gloo's


class StageAt:
    """A rank's group that stages weights on its rank right before its `call`-th all_gather."""

    def __init__(self, inner, rank: RolloutRank, call: int, version: int, weights):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.target, self.call, self.version, self.weights, self.calls = rank, call, version, weights, 0

    def all_gather(self, tensor):
        if self.calls == self.call:
            self.target.receiver.stage(self.version, self.weights)
        self.calls += 1
        return self.inner.all_gather(tensor)


def two_ranks(tiny_model_dir, apply_at, weights, stage_call):
    """Two ranks: rank 0 has version 1 staged before the request, rank 1 gets it as its all_gather
    number `stage_call` starts (0 is the request-start agreement, 1 + k that of step k)."""
    spec = spec_for(tiny_model_dir, apply_at=apply_at)
    ranks = [RolloutRank(spec, r, 2) for r in range(2)]
    group = ThreadGroup(2)
    ranks[0].join(group.rank(0))
    ranks[1].join(StageAt(group.rank(1), ranks[1], stage_call, 1, weights))
    ranks[0].receiver.stage(1, weights)
    return ranks


def test_staged_weights_apply_at_the_step_boundary_all_ranks_reach(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    weights, T = random_adapter(model, seed=1), 6
    # Staged while step 1's all_gather is under way: rank 1 announces it in step 2's, applied after step 2.
    ranks = two_ranks(tiny_model_dir, "step", weights, stage_call=2)
    results = run_ranks(2, lambda r: ranks[r].generate(request(steps=T)))
    assert results[1] is None  # rank 0 returns the trajectories
    assert results[0][0].versions.tolist() == [0, 0, 0, 1, 1, 1]
    assert_same(results[0], oracle(model, request(steps=T), TrueCFG(), {2: (1, weights)}))
    for rank in ranks:
        assert rank.version == 1
        got = rank.get_adapter_weights()
        assert all(torch.equal(got[n], weights[n]) for n in weights)


def test_a_request_under_given_weights_samples_under_them_and_restores_the_applied_version(tiny_model_dir):
    """Evaluation of the trainer.ema_decay EMA: one request under other weights, no version applied meanwhile."""
    model = lora_model(tiny_model_dir)
    staged, ema = random_adapter(model, seed=1), random_adapter(model, seed=4)
    applied = adapter_parameters(model.transformer, TRAINED_ADAPTER)
    applied = {n: p.detach().clone() for n, p in applied.items()}
    ranks = two_ranks(tiny_model_dir, "step", staged, stage_call=2)  # version 1 arrives mid-request
    results = run_ranks(2, lambda r: ranks[r].generate(request(steps=6), weights=ema))
    assert results[0][0].versions.tolist() == [0] * 6
    set_adapter(model, ema)
    assert_same(results[0], oracle(model, request(steps=6), TrueCFG(), {}))
    for rank in ranks:
        assert rank.version == 0
        got = rank.get_adapter_weights()
        assert all(torch.equal(got[n], applied[n]) for n in applied)
    # The next request applies the staged version as usual.
    after = run_ranks(2, lambda r: ranks[r].generate(request(steps=2)))[0]
    assert after[0].versions.tolist() == [1, 1]


def test_apply_at_request_keeps_a_request_on_one_version(tiny_model_dir):
    model = lora_model(tiny_model_dir)
    weights = random_adapter(model, seed=2)
    ranks = two_ranks(tiny_model_dir, "request", weights, stage_call=1)
    first = run_ranks(2, lambda r: ranks[r].generate(request("a")))[0]
    assert first[0].versions.tolist() == [0] * 4
    assert_same(first, oracle(model, request("a"), TrueCFG(), {}))
    second = run_ranks(2, lambda r: ranks[r].generate(request("b")))[0]  # agreed before its first step
    set_adapter(model, weights)
    assert_same(second, oracle(model, request("b"), TrueCFG(), {}, version=1))


def test_two_ranks_sharing_the_decode_return_the_single_process_samplers_images(tiny_model_dir):
    """sampling.decode_batch_size=1 on 3 images: rank 0 decodes images 0 and 2, rank 1 image 1; the trajectories (images
    included) are the single-process sampler's with the same params, bit for bit."""
    ranks = [RolloutRank(spec_for(tiny_model_dir), r, 2) for r in range(2)]
    group = ThreadGroup(2)
    for r in range(2):
        ranks[r].join(group.rank(r))
    req = request(seeds=(11, 12, 13), decode_batch_size=1)
    got = run_ranks(2, lambda r: ranks[r].generate(req))
    assert got[1] is None
    assert_same(got[0], oracle(lora_model(tiny_model_dir), req, TrueCFG(), {}))


def test_ranks_on_different_requests_fail_instead_of_mixing(tiny_model_dir):
    ranks = [RolloutRank(spec_for(tiny_model_dir), r, 2) for r in range(2)]
    group = ThreadGroup(2)
    for r in range(2):
        ranks[r].join(group.rank(r))
    with pytest.raises(RuntimeError, match="different requests"):
        run_ranks(2, lambda r: ranks[r].generate(request(f"req-{r}")))


def test_a_wait_abandoned_on_one_rank_fails_the_request_on_every_rank_and_their_collectives_still_pair(tiny_model_dir):
    """The learners died (abandon_waits) while a request for version 1 starts: rank 0 holds 1 already, rank 1 does not.
    Rank 1 raised VersionAbandoned before the request's first collective, which rank 0 was in: rank 0 waited there for
    a peer that never came (its collective would have paired with rank 1's next request). Both ranks raise it, after
    that collective, and stay in step: after the rewind the next request samples on both."""
    model = lora_model(tiny_model_dir)
    weights = random_adapter(model, seed=1)
    ranks = [RolloutRank(spec_for(tiny_model_dir), r, 2) for r in range(2)]
    group = ThreadGroup(2)
    group.barrier = threading.Barrier(2, timeout=5)  # a rank left alone in a collective fails in 5 s, not 30
    for r in range(2):
        ranks[r].join(group.rank(r))
    ranks[0].receiver.stage(1, weights)
    for rank in ranks:
        rank.receiver.abandon_waits()
    errors: list[BaseException | None] = [None, None]

    def start(r: int) -> None:
        try:
            ranks[r].generate(dataclasses.replace(request("waits-for-1"), min_version=1))
        except BaseException as e:  # noqa: BLE001  (checked below, per rank)
            errors[r] = e

    run_ranks(2, start)
    assert [type(e) for e in errors] == [VersionAbandoned, VersionAbandoned], errors
    assert [rank.out_of_step for rank in ranks] == [None, None]
    for rank in ranks:
        rank.receiver.rewind(0)
        rank.receiver.stage(1, weights)  # the new timeline's version 1
    after = dataclasses.replace(request("after-the-rewind"), min_version=1)
    got = run_ranks(2, lambda r: ranks[r].generate(after))
    assert got[1] is None and got[0][0].versions.tolist() == [1] * 4


def test_staging_checks_names_and_shapes_against_the_ranks_lora_slot(tiny_model_dir):
    rank = RolloutRank(spec_for(tiny_model_dir), 0, 1)
    weights = rank.get_adapter_weights()
    name = sorted(weights)[0]
    with pytest.raises(ValueError, match="missing"):
        rank.receiver.stage(1, {n: t for n, t in weights.items() if n != name})
    with pytest.raises(ValueError, match="shape mismatches"):
        rank.receiver.stage(1, {**weights, name: torch.zeros(1)})
    with pytest.raises(ValueError, match="not newer"):
        rank.receiver.stage(0, weights)


def test_a_rewind_voids_newer_versions_until_the_checkpoints_version_arrives_again(tiny_model_dir):
    """The learners restarted from version 2's checkpoint: a rank that applied version 3 (and staged 4) drops them,
    takes version 2 again, and samples under it."""
    model = lora_model(tiny_model_dir)
    v2, v3 = random_adapter(model, seed=1), random_adapter(model, seed=2)
    rank = RolloutRank(spec_for(tiny_model_dir), 0, 1)
    rank.join(ThreadGroup(1).rank(0))
    rank.receiver.stage(3, v3)
    rank.generate(request(steps=2, seeds=(11,)))  # applies version 3 before its first step
    rank.receiver.stage(4, v3)
    rank.receiver.rewind(3)  # the applied version is not after the checkpoint's: kept
    assert rank.version == 3 and rank.receiver.newest() == 3
    rank.receiver.stage(4, v3)
    rank.receiver.rewind(2)
    assert rank.version == VOID_VERSION and rank.receiver.newest() == VOID_VERSION
    rank.receiver.stage(2, v2)
    (trajectory,) = rank.generate(request(steps=2, seeds=(11,)))
    assert trajectory.versions.tolist() == [2, 2] and rank.version == 2
    got = rank.get_adapter_weights()
    assert all(torch.equal(got[n], v2[n]) for n in v2)


def test_spec_from_config_takes_the_learners_lora_and_the_apply_policy():
    from rayflow.config import RayflowConfig

    cfg = RayflowConfig()
    cfg.learner.lora_rank, cfg.learner.lora_targets, cfg.trainer.seed = 16, ["to_q", "to_v"], 7
    cfg.rollout.threads_per_rank, cfg.rollout.batch_branches = 2, True
    spec = RolloutRankSpec.from_config(cfg)
    assert (spec.lora_rank, spec.lora_targets, spec.seed) == (16, ("to_q", "to_v"), 7)
    assert (spec.threads, spec.batch_branches, spec.apply_at) == (2, True, "step")
    assert spec.policy == guidance_policy(cfg.cfg)
    cfg.async_.partial_rollout = False  # a trajectory finishes under the weights it started with
    assert RolloutRankSpec.from_config(cfg).apply_at == "request"


def test_a_rank_whose_weight_sync_join_failed_refuses_a_broadcast_naming_the_failed_join(monkeypatch):
    """join_sync closes the previous generation before forming the next; when forming fails (a peer never joins), the
    rank kept the closed group, and a later receive_weights failed with an AttributeError on its released process group
    (no Ray: the actor's class as a plain object, over loopback)."""
    from types import SimpleNamespace

    from cluster_fake import free_port
    from rayflow.distributed import process_group
    from rayflow.distributed.process_group import Rendezvous
    from rayflow.rollout.worker import RolloutRankHost

    monkeypatch.setattr(process_group, "node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(process_group, "FORM_TIMEOUT_FLOOR_S", 1.0)
    receiver = SimpleNamespace(receive=lambda group, manifest, bucket_bytes: group.broadcast(torch.zeros(2)))
    host = RolloutRankHost()
    host.rank = SimpleNamespace(rank=1, device=torch.device("cpu"), receiver=receiver,
                                spec=SimpleNamespace(collective_timeout_s=1.0))
    host.join_sync(Rendezvous.on_this_node(), "generation-1", 0, 1)
    host.receive_weights(SimpleNamespace(version=1), 1 << 20)
    with pytest.raises(RuntimeError):  # nobody hosts generation 2's store: the connect times out
        host.join_sync(Rendezvous("127.0.0.1", free_port()), "generation-2", 1, 2)
    with pytest.raises(RuntimeError, match=r"rollout rank 1: no weight-sync group to receive version 2 from "
                                           r"\(its last join_sync failed"):
        host.receive_weights(SimpleNamespace(version=2), 1 << 20)
    host.close()


@pytest.mark.parametrize("fails", ["to start", "to be placed"])
def test_requests_waiting_for_a_replacement_that_never_comes_fail_instead_of_waiting_forever(fails, monkeypatch):
    """The pool's only replica died; a request waits for its replacement, which fails to start (or is never placed)
    with the restarts used up: `collect` raises ReplicaError (it returned nothing on every call, and the driver polled
    on forever)."""
    from rayflow.rollout import ReplicaError
    from rayflow.rollout import pool as pool_module

    class Replica:
        def __init__(self, name, reservation=None):
            self.name, self.alive = name, True

        def shutdown(self):
            self.alive = False

        def ready(self):
            raise ReplicaError(f"rollout replica {self.name!r}: rank 0 of 1 failed to start: no weights")

    class Unplaceable:
        bundles = [{"CPU": 1000.0}]

        def placed(self):
            return False

        def shutdown(self):
            pass

    monkeypatch.setattr(pool_module, "REPLACEMENT_PLACEMENT_S", 0.0)
    reserve = (lambda name: Unplaceable()) if fails == "to be placed" else None
    pool = RolloutPool([Replica("rollout-0")], Replica, max_restarts=1, reserve_replica=reserve)
    assert pool.replace(pool.replicas[0])  # the one restart
    future = pool.submit(request("waits"))
    assert pool.waiting == [future]
    with pytest.raises(ReplicaError, match="every rollout replica of the pool is out of service"):
        pool.collect()


# --- on Ray --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(ray_session, tiny_model_dir):
    """One replica per W in {1, 2, 3}, started together (their actors load concurrently)."""
    from rayflow.rollout import RolloutReplica

    spec = spec_for(tiny_model_dir)
    started = {w: RolloutReplica(spec, RolloutConfig(cfg_parallel_size=w), name=f"test-w{w}") for w in (1, 2, 3)}
    try:
        yield {w: r.wait_ready() for w, r in started.items()}
    finally:
        for r in started.values():
            r.shutdown()


@pytest.mark.parametrize("num_branches", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_replica_equals_single_process_sampler(replicas, tiny_model, world_size, num_branches):
    replica = replicas[world_size]
    req = request(guidance=1.0 if num_branches == 1 else 4.0)
    # The second request decodes one image at a time: with W > 1 the ranks share the decode (over the replica's group).
    chunked = request(guidance=req.params.guidance_scale, decode_batch_size=1)
    serial = POLICIES[num_branches]
    parallel = dataclasses.replace(serial, parallel_arithmetic=True)
    futures = [replica.submit(req, serial), replica.submit(chunked, parallel)]
    expected = generate(tiny_model, req, serial)
    assert (expected[0].log_probs[:-1] != 0).all()  # SDE steps: log-probs to compare
    got_serial, got_parallel = (f.result() for f in futures)
    assert_same(got_serial, expected)  # bit for bit, whatever W
    # Distribution adds no error in either order; the parallel order itself differs from the serial
    # one by a few ulp of the latents (up to ~1.7e-6 at |x| ~ 3 in one process).
    assert_same(got_parallel, generate(tiny_model, chunked, parallel))
    for got, want in zip(got_parallel, expected):
        torch.testing.assert_close(got.latents, want.latents, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.log_probs, want.log_probs, rtol=1e-6, atol=1e-6)


BAD_REQUESTS = [
    (dict(seeds=[1, 2, 3]), "request.seeds"),
    (dict(seeds=[5, 5]), "request.seeds"),  # one group, the same seed twice
    (dict(params=dict(height=40)), "sampling.height"),
    (dict(params=dict(num_steps=0)), "request.params.num_steps"),
    (dict(params=dict(return_step_indices=[0, 9])), "request.params.return_step_indices"),
    (dict(params=dict(sde_step_indices=[4])), "request.params.sde_step_indices"),
]


def test_bad_requests_fail_naming_the_field_and_the_replica_keeps_serving(replicas, tiny_model):
    replica, good = replicas[2], request("good")
    futures = []
    for change, field in BAD_REQUESTS:
        bad = dataclasses.replace(good, request_id=field, prompts=PROMPTS[:1] * 2, group_ids=[0, 0])
        bad = dataclasses.replace(bad, seeds=change.get("seeds", bad.seeds),
                                  params=dataclasses.replace(bad.params, **change.get("params", {})))
        futures.append((replica.submit(bad), field))
    after = replica.submit(good)  # queued behind every bad request
    for future, field in futures:
        with pytest.raises((ConfigError, ValueError), match=field.replace(".", r"\.")):
            future.result()
    assert_same(after.result(), generate(tiny_model, good, TrueCFG()))


def test_a_rank_that_raises_mid_request_fails_it_with_its_own_error_and_takes_the_replica_out_of_service(
        ray_session, tiny_model_dir):
    """Rank 1 of a W = 2 replica raises in its forward at step 2; its peer waits in step 2's all_gather. The request
    fails at once with rank 1's own error, and the replica goes out of service: the request queued behind it paired its
    header all_gather with the peer's step all_gather (gloo aborted rank 1's process), and the failed request raised
    rank 0's "ranks run different requests" instead; with nothing queued the peer waited out the collective timeout."""
    import ray

    from rayflow.rollout import ReplicaError, RolloutReplica
    from rayflow.rollout.worker import CONCURRENCY_GROUPS, RolloutRankHost

    @ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
    class FailsOnRank1(RolloutRankHost):
        def __init__(self, spec, rank, world_size):
            self.rank = RolloutRank(spec, rank, world_size)

        @ray.method(num_returns=2)
        def generate(self, request, policy=None, weights=None):
            model, forward, calls = self.rank.model, self.rank.model.predict_velocity, []

            def third_forward_fails(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected: rank 1's forward failed at step 2")
                return forward(*args, **kwargs)

            if self.rank.rank == 1 and request.request_id == "fails":
                model.predict_velocity = third_forward_fails
            try:
                return RolloutRankHost.generate(self, request, policy, weights)
            finally:
                model.predict_velocity = forward

    rollout, spec = RolloutConfig(cfg_parallel_size=2), spec_for(tiny_model_dir, collective_timeout_s=60.0)
    placed = RolloutReplica.reserve(rollout, "test-fails-mid-request").wait()
    replica = RolloutReplica.over("test-fails-mid-request", placed, [placed.spawn(r, FailsOnRank1, spec, r, 2)
                                                                     for r in range(2)], spec.collective_timeout_s)
    placed.owned = True  # shutdown removes it
    try:
        replica.wait_ready()
        start = time.monotonic()
        fails, queued = replica.submit(request("fails")), replica.submit(request("queued"))
        with pytest.raises(RuntimeError, match="injected: rank 1's forward failed at step 2") as raised:
            fails.result(timeout=30)
        assert "raised on rank 1 of 2" in str(raised.value.__notes__)
        assert not replica.alive and "rank 1 of 2" in replica._dead and "left the replica's group" in replica._dead
        refused = r"rank 1 of 2 .* refused request 'queued': rollout rank 1/2 left its replica's group: request 'fails'"
        with pytest.raises(ReplicaError, match=refused):
            queued.result(timeout=30)
        assert time.monotonic() - start < 30  # not the peer's collective timeout
        assert all(ray.get(w.__ray_ready__.remote(), timeout=10) for w in replica.workers)  # no rank was aborted
    finally:
        replica.shutdown()


def test_a_pool_splits_a_group_across_replicas_like_one_replica(replicas, tiny_model):
    from rayflow.rollout import RolloutPool

    group = PromptGroup(group_id=7, prompt_id=3, prompt=PROMPTS[1], seeds=(40, 41, 42, 43))
    requests = group.requests(request().params, micro_batch_size=2)
    pool = RolloutPool([replicas[1], replicas[2]])  # not owned: the fixture shuts them down
    futures = pool.map(requests)
    assert [f.replica for f in futures] == [replicas[1], replicas[2]]  # both replicas serve
    one = [t for r in requests for t in replicas[3].generate(r)]
    assert_same([t for f in futures for t in f.result()], one)
    assert_same(one, [t for r in requests for t in generate(tiny_model, r, TrueCFG())])
    assert [t.seed for t in one] == list(group.seeds) and {t.group_id for t in one} == {7}


def test_a_pool_that_fails_to_start_frees_what_its_started_replicas_hold(ray_session, tiny_model_dir, monkeypatch):
    """The second replica's placement times out (it asks for more CPUs than the session has): the first replica,
    placed and started, is shut down, its placement group removed (it stayed reserved until the driver exited)."""
    import functools

    import ray

    from rayflow.distributed import placement
    from rayflow.rollout import RolloutPool

    monkeypatch.setattr(placement.Reservation, "wait", functools.partialmethod(placement.Reservation.wait, timeout_s=3.0))
    before = ray.available_resources().get("CPU", 0)
    rollout = RolloutConfig(num_replicas=1, cfg_parallel_size=1, cpus_per_rank=1.0)
    too_big = RolloutConfig(num_replicas=1, cfg_parallel_size=1, cpus_per_rank=before + 1)
    reservations = RolloutPool.reserve(rollout, "test-leak-a") + RolloutPool.reserve(too_big, "test-leak-b")
    with pytest.raises(TimeoutError, match="test-leak-b-0"):
        RolloutPool.start(spec_for(tiny_model_dir), rollout, "test-leak", reservations)
    table = {t["name"]: t["state"] for t in ray.util.placement_group_table().values() if t["name"].startswith("test-leak")}
    assert table == {"test-leak-a-0": "REMOVED", "test-leak-b-0": "REMOVED"}
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0) < before and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == before


def test_a_replica_or_pool_created_with_ranks_that_fail_to_start_frees_its_placement(ray_session, tmp_path):
    """RolloutReplica.create and RolloutPool.create (tools/generate.py's and the API's one-call start) whose ranks cannot
    load the model raise, and leave nothing reserved: their placement groups stayed CREATED, holding their CPUs, until
    the driver exited."""
    import ray

    from rayflow.rollout import ReplicaError, RolloutReplica

    spec = spec_for(str(tmp_path / "no-model-here"))
    with pytest.raises(ReplicaError, match="failed to start|died during start-up"):
        RolloutReplica.create(spec, RolloutConfig(cfg_parallel_size=2), name="test-create-leak-r")
    with pytest.raises(ReplicaError, match="failed to start|died during start-up"):
        RolloutPool.create(spec, RolloutConfig(num_replicas=1, cfg_parallel_size=1), name="test-create-leak-p")
    table = {t["name"]: t["state"] for t in ray.util.placement_group_table().values()
             if t["name"].startswith("test-create-leak")}
    # Removed, a placement group's bundles are free and the actors in it are killed. (Counting the session's free
    # CPUs instead raced with earlier tests' actors releasing theirs, and module fixtures hold some all along.)
    assert table == {"test-create-leak-r": "REMOVED", "test-create-leak-p-0": "REMOVED"}


def test_a_replacements_placement_does_not_block_the_pool_and_one_never_placed_counts_as_lost(ray_session,
                                                                                              monkeypatch, caplog):
    """A replacement's placement is asked for and the pool goes on serving; placed, the replica starts in it. Never
    placed (its node type gone), it is given up at its deadline, the restart spent: it blocked the driver up to
    600 s and then stopped the run with a TimeoutError."""
    import logging

    from rayflow.distributed import placement
    from rayflow.rollout import pool as pool_module

    class Replica:
        def __init__(self, name, reservation=None):
            self.name, self.alive, self.reservation = name, True, reservation

        def shutdown(self):
            self.alive = False

        def ready(self):
            return False  # still loading

    started = []

    def start(name, reservation=None):
        started.append(Replica(name, reservation))
        return started[-1]

    monkeypatch.setattr(pool_module, "REPLACEMENT_PLACEMENT_S", 1.0)
    for cpus, placed in ((0.1, True), (1000.0, False)):
        pool = RolloutPool([Replica("rollout-0")], start, max_restarts=1,
                           reserve_replica=lambda name, cpus=cpus: placement.reserve(1, cpus, 0.0, name=f"{name}-{cpus}"))
        begun = time.monotonic()
        assert pool.replace(pool.replicas[0]) and 0 in pool.placing and not pool.starting
        assert time.monotonic() - begun < 1.0  # asked for, not waited for
        deadline = time.monotonic() + 10
        while pool.placing and time.monotonic() < deadline:
            with caplog.at_level(logging.WARNING, logger="rayflow"):
                pool._promote_ready()
            time.sleep(0.1)
        if placed:
            assert pool.starting[0].reservation is not None and started[-1] is pool.starting[0]
            pool.starting[0].reservation.shutdown()  # a real replica would have waited for it and removed it at shutdown
        else:
            assert not pool.starting and "was not placed within 1s" in caplog.text
            assert "its restarts are used up; going on without it" in caplog.text
        pool.shutdown()


def test_the_driver_wakes_for_each_replacement_that_can_move_on_and_never_spins(ray_session):
    """`RolloutPool.replacement_refs`, which the driver's loop waits on with the requests in flight (Trainer._serve):
    a replacement placed, or with every rank up, before the call is there, done (the wait returns at once and `collect`
    takes it in; left out, the driver slept a whole poll: a fault test's step took 63 s with a 60-s poll), and a rank
    up while its peer still loads is not (the wait would return at once, again and again, while the peer loads)."""
    import ray

    @ray.remote(num_cpus=0, max_concurrency=2)
    class Loading:
        def __init__(self):
            self.done = threading.Event()

        def join(self):
            self.done.wait()

        def finish(self):
            self.done.set()

    placed, up, (up_0, up_1), rank = ray.put(None), ray.put(None), (ray.put(0), ray.put(1)), Loading.remote()
    loading = rank.join.remote()
    pool = RolloutPool([SimpleNamespace(name="rollout-0")])
    pool.placing = {0: (SimpleNamespace(ready_ref=lambda: placed), 0.0)}  # placed since the last `collect`
    pool.starting = {1: SimpleNamespace(join_refs=[up, loading]), 2: SimpleNamespace(join_refs=[up_0, up_1])}
    try:
        assert pool.replacement_refs == [placed, loading, up_0, up_1]
        pool.placing, pool.starting = {}, {1: SimpleNamespace(join_refs=[up, loading])}
        refs = pool.replacement_refs
        assert refs == [loading] and not ray.wait(refs, timeout=0.2)[0]
        ray.get(rank.finish.remote())  # returns before `join`'s reply reaches this process: wait for that first
        assert ray.wait(refs, timeout=10)[0] and pool.replacement_refs == [up, loading]
    finally:
        ray.kill(rank)


@pytest.fixture(scope="module")
def fresh_pool(ray_session, tiny_model_dir):
    """A pool built from config (one replica, W = 2) with a short collective timeout; a new one
    after a test killed a rank of the last."""
    from rayflow.rollout import RolloutPool

    pools = []

    def live_pool():
        if not pools or not pools[-1].replicas[0].alive:
            pools.append(RolloutPool.create(
                spec_for(tiny_model_dir, collective_timeout_s=5.0),
                RolloutConfig(num_replicas=1, cfg_parallel_size=2, collective_timeout_s=5.0),
                name=f"test-fresh-{len(pools)}",
            ))
        return pools[-1]

    try:
        yield live_pool
    finally:
        for pool in pools:
            pool.shutdown()


def test_weights_staged_on_live_ranks_apply_when_all_have_them(fresh_pool, tiny_model_dir):
    import ray

    pool = fresh_pool()
    (replica,) = pool.replicas
    model = lora_model(tiny_model_dir)
    v1, v2 = random_adapter(model, seed=4), random_adapter(model, seed=5)
    ray.get(replica.stage_weights(1, v1, ranks=[0]))
    assert replica.generate(request("only-rank-0"))[0].versions.tolist() == [0] * 4  # rank 1 lacks version 1
    ray.get(replica.stage_weights(1, v1))  # every rank
    set_adapter(model, v1)
    assert_same(replica.generate(request("both")), oracle(model, request("both"), TrueCFG(), {}, version=1))
    assert all(torch.equal(w[n], v1[n]) for w in replica.adapter_weights() for n in v1)

    # Mid-request: rank 1 receives version 2 only once it is past step 2.
    T, long = 60, request("partial", steps=60)
    ray.get(replica.stage_weights(2, v2, ranks=[0]))
    future = replica.submit(long)
    while (replica.progress(rank=1) or ("", -1))[1] < 2:
        time.sleep(0.005)
    ray.get(replica.stage_weights(2, v2, ranks=[1]))
    versions = future.result()[0].versions.tolist()
    k = versions.index(2)
    assert 3 <= k < T and versions == [1] * k + [2] * (T - k)
    set_adapter(model, v1)
    assert_same(future.result(), oracle(model, long, TrueCFG(), {k - 1: (2, v2)}, version=1))
    assert all(torch.equal(w[n], v2[n]) for w in replica.adapter_weights() for n in v2)


def test_a_killed_rank_is_reported_with_its_rank_and_node(fresh_pool):
    import ray

    from rayflow.rollout import ReplicaError

    pool = fresh_pool()
    (replica,) = pool.replicas
    future = replica.submit(request("long", steps=400))
    while replica.progress(rank=0) is None:
        time.sleep(0.005)
    start = time.monotonic()
    ray.kill(replica.workers[1])
    with pytest.raises(ReplicaError, match=r"rank 1 of 2 on node 127\.0\.0\.1 \(node id \w+\) died"):
        future.result(timeout=60)
    assert time.monotonic() - start < replica.collective_timeout_s
    with pytest.raises(ReplicaError, match="rank 1 of 2"):
        replica.submit(request("next"))
    with pytest.raises(ReplicaError, match="out of service"):
        pool.submit(request("next"))
    pool.shutdown()  # frees its placement group for the tests after this one


def test_generate_tool_with_cfg_parallel_writes_what_w1_writes(ray_session, tiny_model_dir, tmp_path):
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "generate.py")
    spec = importlib.util.spec_from_file_location("generate_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    outputs = {}
    for w in (1, 2):
        png, pt = tmp_path / f"w{w}.png", tmp_path / f"w{w}.pt"
        tool.main(["--model", tiny_model_dir, "--prompt", PROMPTS[0], "--seed", "9", "--out", str(png),
                   "--save-latents", str(pt), "--cfg-parallel-size", str(w)])
        outputs[w] = np.array(Image.open(png)), torch.load(pt)
    assert np.array_equal(outputs[1][0], outputs[2][0]) and torch.equal(outputs[1][1], outputs[2][1])
    assert ray_session.is_initialized()  # the tool used the session's Ray and left it running
