"""The FSDP2 learner: sharding, adapter swaps, skipped steps, and equivalence of world sizes 1 and 2
with the single-process reference trainer on the same trajectories."""

import dataclasses
import datetime
import os

import pytest
import ray
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

from rayflow import reference
from rayflow.checkpoint import load_checkpoint, save_checkpoint
from rayflow.distributed.process_group import Rendezvous, init_default_group
from rayflow.models import load_model, lora
from rayflow.learner.backend import LearnerBackend
from rayflow.learner.minibatches import train_batch
from rayflow.learner.model import load_policy_model
from rayflow.learner.optim import SkipRuns
from rayflow.learner.prefetch import TrajectoryCache
from rayflow.learner.spec import LearnerSpec
from rayflow.distributed.parallelize import build_mesh, reshard
from rayflow.learner.state import adapter_state, full_tensor, load_adapter_state, param_names
from rayflow.learner.worker import LearnerError, LearnerGroup
from rayflow.models.base import PromptEmbeds
from rayflow.sync.buckets import from_wire
from ranks import run_ranks
from tiny_run import GRPO, NFT, small_cfg, wait_until_dead

CPU = torch.device("cpu")
STEPS = 3

SHARD1 = "learner.shard=always"  # backend tests on a one-rank mesh check FSDP2 itself: shard that rank too

SAMPLER_STATE = {"groups_drawn": 1, "seed": 0}
"""A prompt sampler's position, as the driver stores it with every checkpoint."""


@pytest.fixture(scope="module")
def mesh1():
    """A one-rank CPU mesh in this process (gloo on loopback), for backends driven without Ray."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # set by init_default_group; restored after
            mp.setenv(name, "lo")
        init_default_group(Rendezvous.on_this_node(), 0, 1, CPU)
        yield build_mesh(CPU, 1)
        dist.destroy_process_group()


def velocity(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, cond = torch.randn(2, 4, 16, generator=g), PromptEmbeds(torch.randn(2, 5, 32, generator=g), None)
    return model.predict_velocity(x, torch.tensor(500.0), cond, 32, 32)


def randomize_adapters(transformers, seed=1):
    """Give every adapter of each transformer the same random values (B != 0, so A gets gradients too)."""
    g = torch.Generator().manual_seed(seed)
    for name in lora.adapter_names(transformers[0]):
        values = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in adapter_state(transformers[0], name).items()}
        for t in transformers:
            load_adapter_state(t, name, values)


def test_fsdp_shards_each_block_then_the_root_and_computes_as_the_plain_model(mesh1, tiny_model_dir, tmp_path):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, SHARD1)
    spec = LearnerSpec.from_config(cfg)
    backend, plain = LearnerBackend(spec, mesh1, CPU), load_policy_model(spec, CPU)
    t = backend.transformer
    assert isinstance(t, FSDPModule) and all(isinstance(b, FSDPModule) for b in t.transformer_blocks)
    outside_blocks = [m for n, m in t.named_modules() if n and not n.startswith("transformer_blocks")]
    assert outside_blocks and not any(isinstance(m, FSDPModule) for m in outside_blocks)
    for p in t.parameters():
        assert isinstance(p, DTensor) and p.device_mesh.device_type == "cpu" and p.placements == (Shard(0),)
    randomize_adapters([t, plain.transformer])
    with torch.no_grad():
        torch.testing.assert_close(velocity(backend.model), velocity(plain), rtol=0, atol=1e-6)


@pytest.mark.parametrize("recipe, expected", [(GRPO, "default"), (NFT, "old")])
def test_rollout_adapter_name(mesh1, tiny_model_dir, tmp_path, recipe, expected):
    backend = LearnerBackend(LearnerSpec.from_config(small_cfg(recipe, tiny_model_dir, tmp_path, SHARD1)), mesh1, CPU)
    assert backend.rollout_adapter_name == expected
    randomize_adapters([backend.transformer])  # "old" and "default" now differ
    wire = backend.rollout_wire()  # what learner rank 0 hands the weight-sync actor
    assert wire.manifest.version == 0
    tensors = from_wire(wire, bucket_bytes=2**30, device="cpu", with_checksums=False).tensors()
    # Exactly the named adapter's tensors, under their canonical names.
    assert tensors.keys() == lora.adapter_parameters(backend.transformer, expected).keys()
    for name, p in lora.adapter_parameters(backend.transformer, expected).items():
        assert torch.equal(tensors[name], full_tensor(p))
    if expected == "old":
        default = adapter_state(backend.transformer, "default")
        assert not any(torch.equal(tensors[k], default[k]) for k in default)


def assert_only_default_trainable(transformer):
    for name, p in transformer.named_parameters():
        is_default = (".lora_A.default." in name) or (".lora_B.default." in name)
        assert p.requires_grad == is_default, name


def test_swapping_adapters_keeps_default_trainable_without_resharding(mesh1, tiny_model_dir, tmp_path):
    # reshard_after_forward=False keeps blocks unsharded after a forward: a swap then flips requires_grad on
    # the unsharded parameters only, and FSDP2 copies the sharded flag back at the next all-gather.
    cfg = small_cfg(NFT, tiny_model_dir, tmp_path, SHARD1, "learner.reshard_after_forward=false")
    spec = LearnerSpec.from_config(cfg)
    backend, plain = LearnerBackend(spec, mesh1, CPU), load_policy_model(spec, CPU)
    models = [backend.model, plain]
    randomize_adapters([m.transformer for m in models])
    for swap in (lambda t: lora.using_adapter(t, "old"), lora.base_model, lambda t: lora.using_adapter(t, "old")):
        for m in models:
            with torch.no_grad(), swap(m.transformer):
                velocity(m)
            assert_only_default_trainable(m.transformer)  # the unsharded parameters, for the backend
    for seed in (1, 2):  # two passes without a swap in between: the second all-gathers afresh
        for m in models:
            (velocity(m, seed) ** 2).mean().backward()
        reshard(backend.transformer)
        assert_only_default_trainable(backend.transformer)  # the sharded parameters
        got = lora.adapter_parameters(backend.transformer, "default")
        expected = lora.adapter_parameters(plain.transformer, "default")
        # The last block's text-stream output feeds nothing, so its to_add_out gets no gradient.
        with_grad = sorted(n for n, p in expected.items() if p.grad is not None)
        assert len(with_grad) >= len(expected) - 2
        assert sorted(n for n, p in got.items() if p.grad is not None) == with_grad
        for name in with_grad:
            torch.testing.assert_close(full_tensor(got[name].grad), expected[name].grad, rtol=1e-4, atol=1e-7)
        for p in [*got.values(), *expected.values()]:
            p.grad = None


def test_activation_checkpointing_recomputes_each_block_with_the_same_gradients(mesh1, tiny_model_dir, tmp_path):
    grads, calls = {}, {}
    for ac in (False, True):
        cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, SHARD1, f"learner.activation_checkpointing={str(ac).lower()}")
        backend = LearnerBackend(LearnerSpec.from_config(cfg), mesh1, CPU)
        randomize_adapters([backend.transformer])
        count = []
        # A submodule's hook: the block's own hooks (FSDP2's among them) run outside its checkpoint, once.
        backend.transformer.transformer_blocks[0].attn.register_forward_pre_hook(lambda *args: count.append(1))
        (velocity(backend.model) ** 2).mean().backward()
        calls[ac] = len(count)
        grads[ac] = {k: full_tensor(p.grad) for k, p in lora.adapter_parameters(backend.transformer, "default").items()
                     if p.grad is not None}
    assert calls == {False: 1, True: 2}  # the block's forward runs again in backward
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.equal(grads[True][k], grads[False][k]) for k in grads[False])


def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_shards(mesh1, tiny_model_dir, tmp_path):
    cfg = small_cfg(NFT, tiny_model_dir, tmp_path, "learner.mixed_precision=bf16")
    backend = LearnerBackend(LearnerSpec.from_config(cfg), mesh1, CPU)
    assert all(p.dtype == torch.float32 for p in backend.transformer.parameters())
    with torch.no_grad():
        assert velocity(backend.model).dtype == torch.bfloat16
    reshard(backend.transformer)
    wire = backend.rollout_wire()
    assert all(s.dtype == torch.float32 for s in wire.manifest.specs)


@pytest.fixture(scope="module")
def grpo_batches(tiny_model_dir, tmp_path_factory):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path_factory.mktemp("grpo"))
    run = reference.build_run(cfg)
    return [reference.rollout(run)[0] for _ in range(2)]


def test_non_finite_grad_norm_skips_the_step_and_counts_it(mesh1, tiny_model_dir, tmp_path, grpo_batches):
    backend = LearnerBackend(LearnerSpec.from_config(small_cfg(GRPO, tiny_model_dir, tmp_path, SHARD1)), mesh1, CPU)
    before = adapter_state(backend.transformer, "default")
    poisoned = [dataclasses.replace(t, advantage=float("nan")) for t in grpo_batches[0]]
    metrics = backend.train_step(poisoned)
    assert metrics["train/skipped"] == 1 and metrics["train/skipped_steps"] == 1 and metrics["train/version"] == 1
    assert SkipRuns.from_metrics(metrics) == SkipRuns(leading=1, longest=1, trailing=1)  # where: the driver counts runs
    after = adapter_state(backend.transformer, "default")
    assert all(torch.equal(before[k], after[k]) for k in before)
    metrics = backend.train_step(grpo_batches[1])
    assert metrics["train/skipped"] == 0 and metrics["train/skipped_steps"] == 1 and metrics["train/version"] == 2
    assert SkipRuns.from_metrics(metrics) == SkipRuns(0, 0, 0)
    trained = adapter_state(backend.transformer, "default")
    assert any(not torch.equal(after[k], trained[k]) for k in after)


@pytest.mark.parametrize("hold", [True, False], ids=["one-rank-holds", "of-several-pulls-to-node"])
def test_prefetched_requests_are_served_from_the_cache_and_the_rest_fetched_the_same(ray_session, grpo_batches,
                                                                                       monkeypatch, hold):
    import rayflow.learner.prefetch as prefetch
    requests = [grpo_batches[0][:2], grpo_batches[0][2:4]]  # two rollout requests' lists, as rollout ranks return them
    refs = [ray.put(r) for r in requests]
    shard = [(refs[1], 1, -0.5), (refs[0], 0, 1.5), (refs[1], 0, 0.25)]
    cache = TrajectoryCache(max_staleness=1, hold=hold)
    cache.prefetch([ray.put(requests[0])], version=0)  # the same objects under another ref: a different request
    cache.prefetch([refs[0]], version=0)
    gets, real_get = [], ray.get
    monkeypatch.setattr(prefetch.ray, "get", lambda r: gets.append(r) or real_get(r))
    got, stats = cache.fetch(shard)
    # Each request's list once, for all of its entries: held, only the one not prefetched; pulled onto the node
    # only (a rank of several), both, deserialized now from the node's object store.
    assert gets == ([[refs[1]]] if hold else [[refs[1], refs[0]]])
    assert (stats.requests, stats.prefetched) == (2, 1) and stats.wait_s >= 0
    for (ref, index, advantage), t in zip(shard, got):
        source = requests[refs.index(ref)][index]
        assert t.advantage == advantage and t.image is None and source.image is not None
        assert t.seed == source.seed and torch.equal(t.latents, source.latents) and torch.equal(t.log_probs, source.log_probs)

    cache.forget([refs[0]])
    assert len(cache) == 1  # the other request
    cache.forget_before(2)  # trained at version <= 0 + max_staleness, with one version of slack
    assert len(cache) == 1
    cache.forget_before(3)
    assert len(cache) == 0


@pytest.mark.parametrize("hold", [True, False])
def test_a_failed_prefetch_is_fetched_again_by_the_train_step_and_raises_there(ray_session, hold):
    @ray.remote
    def lost_rollout():
        raise RuntimeError("rollout rank died")

    ref = lost_rollout.remote()
    cache = TrajectoryCache(max_staleness=0, hold=hold)
    cache.prefetch([ref], version=0)  # keeps the failure; does not raise in the prefetch thread
    with pytest.raises(ray.exceptions.RayTaskError, match="rollout rank died"):
        cache.fetch([(ref, 0, 1.0)])


def test_a_prefetch_that_failed_is_fetched_by_the_step_and_not_counted_as_prefetched(ray_session, grpo_batches,
                                                                                      monkeypatch):
    import rayflow.learner.prefetch as prefetch
    ref = ray.put(grpo_batches[0][:2])
    real_get, calls = ray.get, []

    def lost_once(r):  # the prefetch's get fails (say, its object was being reconstructed); the step's succeeds
        calls.append(r)
        if len(calls) == 1:
            raise RuntimeError("object lost")
        return real_get(r)

    monkeypatch.setattr(prefetch.ray, "get", lost_once)
    cache = TrajectoryCache(max_staleness=0, hold=True)
    cache.prefetch([ref], version=0)
    got, stats = cache.fetch([(ref, 0, 1.0), (ref, 1, -1.0)])
    assert [t.advantage for t in got] == [1.0, -1.0] and len(calls) == 2
    assert (stats.requests, stats.prefetched) == (1, 0)  # perf/prefetched: the step fetched it itself


@pytest.fixture(scope="module")
def learners2(ray_session, tiny_model_dir, tmp_path_factory):
    """get(recipe, untrained) -> (config, world-size-2 LearnerGroup at lr 0.001). A group costs two actors' start-up:
    a test that only compares the group with itself takes the one an earlier test trained (the newest of its recipe);
    a test that needs the initial weights gets a new one. Every group is shut down with the module."""
    newest, started = {}, []

    def get(recipe: str, untrained: bool):
        if untrained or recipe not in newest:
            # Adam divides by the gradient's scale, so rounding differences in how ranks sum gradients move the
            # LoRA by ~lr x relative rounding of the smallest gradients: lr 1e-3 keeps 3 steps well inside 1e-5.
            cfg = small_cfg(recipe, tiny_model_dir, tmp_path_factory.mktemp("learners2"), "learner.world_size=2",
                            "learner.lr=0.001")
            newest[recipe] = cfg, LearnerGroup(LearnerSpec.from_config(cfg), name=f"test-learners2-{len(started)}")
            started.append(newest[recipe][1])
        return newest[recipe]

    try:
        yield get
    finally:
        for group in started:
            group.shutdown()


@pytest.mark.parametrize("recipe", [GRPO, NFT])
def test_world_size_2_and_1_end_where_the_reference_does(mesh1, learners2, tiny_model_dir, recipe):
    cfg2, group = learners2(recipe, untrained=True)
    cfg1 = dataclasses.replace(cfg2, learner=dataclasses.replace(cfg2.learner, world_size=1, shard="always"))
    ws1, run = LearnerBackend(LearnerSpec.from_config(cfg1), mesh1, CPU), reference.build_run(cfg1)
    initial = adapter_state(run.model.transformer, "default")
    for _ in range(STEPS):
        batch, _ = reference.rollout(run)  # on-policy for all three: they hold the same LoRA
        refs = group.train_step(batch)
        m1 = ws1.train_step(batch)
        m_ref, res = reference.learn(run, batch)
        m2 = group.get(refs)[0]
        for m in (m1, m2):
            assert m["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-4, abs=1e-6)
            # Clipping and the skip decision use the global norm, not a rank's share of it.
            assert m["train/grad_norm"] == pytest.approx(res.grad_norm, rel=1e-5)
    ckpt = group.checkpoint(STEPS, data=SAMPLER_STATE)
    assert ckpt.version == STEPS and sorted(ckpt.adapters) == lora.adapter_names(run.model.transformer)
    for name in ckpt.adapters:
        expected = adapter_state(run.model.transformer, name)
        got1 = adapter_state(ws1.transformer, name)
        for k, v in expected.items():
            torch.testing.assert_close(ckpt.adapters[name][k], v, rtol=0, atol=1e-5)
            torch.testing.assert_close(got1[k], v, rtol=0, atol=1e-5)
    assert max((initial[k] - ckpt.adapters["default"][k]).abs().max() for k in initial) > 1e-3  # it trained
    tensors = group.get(group.adapter_weights(group.rollout_adapter_name))[0]
    assert tensors.keys() == ckpt.adapters[group.rollout_adapter_name].keys()
    assert all(torch.equal(tensors[k], v) for k, v in ckpt.adapters[group.rollout_adapter_name].items())


def training(metrics: dict[str, float]) -> dict[str, float]:
    """A train step's metrics without its timings (perf/*), which differ between any two runs."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def test_world_size_2_resumes_bit_identically_and_reports_a_dead_rank(learners2, grpo_batches, tmp_path):
    _, group = learners2(GRPO, untrained=False)  # compared with itself only; this test ends it (kills a rank)
    group.get(group.train_step(grpo_batches[0]))
    path = save_checkpoint(str(tmp_path / "ckpt"), group.checkpoint(1, data=SAMPLER_STATE), keep=1)
    uninterrupted = [group.get(group.train_step(b))[0] for b in grpo_batches]
    final = group.checkpoint(3, data=SAMPLER_STATE).adapters["default"]
    group.restore(load_checkpoint(path, group.identity))
    resumed = [group.get(group.train_step(b))[0] for b in grpo_batches]
    assert [training(m) for m in resumed] == [training(m) for m in uninterrupted]
    again = group.checkpoint(3, data=SAMPLER_STATE).adapters["default"]
    assert all(torch.equal(again[k], final[k]) for k in final)

    ray.kill(group.workers[1])
    with pytest.raises(LearnerError, match=r"learner rank 1 of 2 on node 127\.0\.0\.1 \(node id \w+\)"):
        group.get(group.train_step(grpo_batches[0]))


def test_a_rank_that_dies_while_the_restarted_group_builds_its_model_restarts_it_again(ray_session, tiny_model_dir,
                                                                                        tmp_path, grpo_batches, monkeypatch):
    """A rank of the restarted group that dies before its model is built (its node short of memory, say) is a death
    like the first: the group starts again on the same budget. It stopped the run with restarts left, and removed the
    group's placement group."""
    group = LearnerGroup(LearnerSpec.from_config(small_cfg(GRPO, tiny_model_dir, tmp_path / "run")),
                         name="test-restart-in-setup")
    setup = LearnerGroup._setup

    def dies_in_the_first_restarts_setup(self, *args, **kwargs):
        if self.restarts == 1:
            ray.kill(self.workers[0])
            wait_until_dead(self.workers[0])
        return setup(self, *args, **kwargs)

    monkeypatch.setattr(LearnerGroup, "_setup", dies_in_the_first_restarts_setup)
    try:
        group.restart(LearnerError("learner rank 0 of 1 failed: ActorDiedError"))
        assert group.restarts == 2
        assert group.get(group.train_step(grpo_batches[0]))[0]["train/version"] == 1
    finally:
        group.shutdown()


def _train_one_batch_on_rank(rank: int, cfg, batch: list, store: str, out: str) -> None:
    """Rank `rank` of 2 processes (a gloo group of their own): train `batch` once; rank 0 saves the "default" adapter."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))  # a collective that never pairs up fails fast
    try:
        backend = LearnerBackend(LearnerSpec.from_config(cfg), build_mesh(CPU, 2), CPU)
        backend.train_step(batch)
        state = adapter_state(backend.transformer, "default")  # a collective: every rank
        if rank == 0:
            torch.save(state, out)
    finally:
        dist.destroy_process_group()


def test_ranks_whose_shards_need_unequal_passes_train_as_the_reference(tiny_model_dir, tmp_path):
    """An asynchronous batch may mix SDE windows (a window per version); micro-batches are cut where they change, so
    one rank's shard can need more forward/backward passes than another's. Every FSDP2 pass is collectives, so the
    ranks run as many (the others of zero weight); with unequal counts they parted and the step hung until the
    collective timeout."""
    cfgs = [small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "learner.world_size=2", "learner.lr=0.001",
                      f"sampling.sde_step_indices={window}") for window in ("[0,1]", "[1,2]")]
    runs = [reference.build_run(cfg) for cfg in cfgs]
    early, late = (reference.rollout(run)[0] for run in runs)
    # Rank 0 trains samples 0-1 (two windows: two micro-batches of 1), rank 1 samples 2-3 (one micro-batch of 2).
    batch = [dataclasses.replace(t, image=None) for t in (early[0], late[1], early[2], early[3])]
    out = tmp_path / "default.pt"
    run_ranks(_train_one_batch_on_rank, 2, cfgs[0], batch, str(tmp_path / "store"), str(out))
    run = runs[0]
    train_batch(run.spec, run.model, run.optimizer, run.spec.policy, [batch], version=0)
    expected, got = adapter_state(run.model.transformer, "default"), torch.load(out)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-5)


def _fetch_ema_weights_on_rank(rank: int, cfg, store: str, out: str) -> None:
    """Rank `rank` of 2 processes: adapter_weights("ema"), counting the whole tensors copied to host memory."""
    import rayflow.learner.state as state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        backend = LearnerBackend(LearnerSpec.from_config(cfg), build_mesh(CPU, 2), CPU)
        copied, full_tensor_of = [], state.full_tensor
        state.full_tensor = lambda t: copied.append(t.numel()) or full_tensor_of(t)
        tensors = backend.adapter_weights("ema")
        torch.save({"tensors": tensors, "copied": sum(copied),
                    "whole": sum(p.numel() for p in backend.transformer.parameters())}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_only_rank_0_holds_the_whole_ema_weights_of_full_fine_tuning(tiny_model_dir, tmp_path):
    """The evaluation's "ema" weights under learner.train_mode=full are a whole transformer: every rank takes part in
    the gathers, only rank 0 keeps them (every rank had copied the whole transformer into host memory to drop it)."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "learner.world_size=2", "learner.train_mode=full",
                    "sync.mode=merged", "trainer.ema_decay=0.9")
    out = str(tmp_path / "fetched")
    run_ranks(_fetch_ema_weights_on_rank, 2, cfg, str(tmp_path / "store"), out)
    rank0, rank1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    assert rank1["tensors"] is None and rank1["copied"] == 0
    assert rank0["copied"] == rank0["whole"] == sum(t.numel() for t in rank0["tensors"].values())
    plain = load_policy_model(LearnerSpec.from_config(cfg), CPU, transformer_only=True).transformer  # "ema" starts as it
    assert all(torch.equal(rank0["tensors"][name], p) for name, p in plain.named_parameters())


def test_autocast_trains_fp32_lora_over_bf16_weights(mesh1, tiny_model_dir, tmp_path, grpo_batches):
    """learner.mixed_precision=autocast: bf16 base weights, fp32 LoRA masters and AdamW state, bf16 matmuls."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "model.dtype=bfloat16", "learner.mixed_precision=autocast")
    assert not cfg.learner.sharded  # autocast needs no FSDP2 mixed-precision policy
    backend = LearnerBackend(LearnerSpec.from_config(cfg), mesh1, CPU)
    lora_params = lora.adapter_parameters(backend.transformer, "default")
    assert {p.dtype for p in lora_params.values()} == {torch.float32}
    assert {p.dtype for n, p in backend.transformer.named_parameters() if ".lora_" not in n} == {torch.bfloat16}
    seen = []
    backend.transformer.transformer_blocks[0].attn.to_q.base_layer.register_forward_hook(
        lambda module, args, out: seen.append(out.dtype))
    before = adapter_state(backend.transformer, "default")
    metrics = backend.train_step(grpo_batches[0])
    assert seen and set(seen) == {torch.bfloat16}
    assert metrics["train/skipped"] == 0 and all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    after = adapter_state(backend.transformer, "default")
    assert all(t.dtype == torch.float32 for t in after.values()) and any(not torch.equal(before[k], after[k]) for k in before)
    states = [s for state in backend.optimizer.state.values() for s in state.values() if torch.is_tensor(s) and s.ndim]
    assert states and {s.dtype for s in states} == {torch.float32}


def test_flow_grpo_kl_types_divide_by_std_dev_t_or_the_transition_variance(tiny_model_dir, tmp_path):
    """flow_grpo (scripts/train_sd3.py): KL = mean((μ_θ − μ_ref)²) / (2·std_dev_t²), std_dev_t = a·sqrt(σ/(1 − σ̃)),
    recomputed here from the step's means; "transition" divides by the step's variance std_dev_t²·(σ − σ')
    instead. One trained step, so the two differ by exactly that factor."""
    from rayflow.learner.objective import _conds, _guided_velocity, backward
    from rayflow.sampling.flow_sde import flow_step

    j = 1
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "algorithm.kl_beta=0.01", f"sampling.sde_step_indices=[{j}]")
    run = reference.build_run(cfg)
    with torch.no_grad():  # move off the base model (LoRA B starts at 0: policy = reference)
        g = torch.Generator().manual_seed(0)
        for _, p in sorted(lora.adapter_parameters(run.model.transformer, "default").items()):
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    batch, _ = reference.rollout(run)
    kls = {}
    for kl_type in ("flow_grpo", "transition"):
        typed = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, kl_type=kl_type))
        kls[kl_type] = backward(LearnerSpec.from_config(typed), run.model, run.spec.policy, batch, version=0)["loss/kl"]
        run.optimizer.zero_grad(set_to_none=True)

    t, params = batch[0], batch[0].params
    sigma, sigma_next, sigma_max = float(t.sigmas[j]), float(t.sigmas[j + 1]), float(t.sigmas[1])
    std_dev_t = params.noise_level * (sigma / (1 - (sigma_max if sigma == 1 else sigma))) ** 0.5
    x, x_next = (torch.stack([b.latent(i) for b in batch]) for i in (j, j + 1))
    conds = _conds(batch, CPU)

    def mean(v):
        return flow_step(v, x, t.sigmas[j], t.sigmas[j + 1], sde_type="sde", noise_level=params.noise_level,
                         prev_sample=x_next, sigma_max=t.sigmas[1])[2]

    with torch.no_grad():
        mu = mean(_guided_velocity(run.model, run.spec.policy, x, t.timesteps[j], conds, params))
        with lora.base_model(run.model.transformer):
            mu_ref = mean(_guided_velocity(run.model, run.spec.policy, x, t.timesteps[j], conds, params))
    expected = (((mu - mu_ref) ** 2).mean(dim=tuple(range(1, mu.ndim))) / (2 * std_dev_t**2)).mean()
    assert float(expected) > 0
    assert kls["flow_grpo"] == pytest.approx(float(expected), rel=1e-4)
    assert kls["transition"] == pytest.approx(kls["flow_grpo"] / (sigma - sigma_next), rel=1e-5)


def test_nft_old_adapter_is_updated_once_per_batch_with_eta_after_the_batchs_steps(tiny_model_dir, tmp_path):
    from rayflow.algorithms.diffusion_nft import ema_decay

    cfg = small_cfg(NFT, tiny_model_dir, tmp_path, "algorithm.num_minibatches=2", "algorithm.ema_uprate=0.1",
                    "algorithm.ema_flat=1", "algorithm.ema_uphold=0.9")
    run = reference.build_run(cfg)
    for version in range(2):
        batch, _ = reference.rollout(run)
        old_before = adapter_state(run.model.transformer, lora.EMA_ADAPTER)
        _, result = reference.learn(run, batch)
        eta = ema_decay(2 * (version + 1), flat=1, uprate=0.1, uphold=0.9)  # 2 optimizer steps per batch
        assert result.ema_decay == pytest.approx(eta) and eta > 0
        default = adapter_state(run.model.transformer, "default")
        old = adapter_state(run.model.transformer, lora.EMA_ADAPTER)
        for name, value in old.items():
            torch.testing.assert_close(value, eta * old_before[name] + (1 - eta) * default[name], rtol=0, atol=1e-7)


@pytest.mark.parametrize("blends", [1, 2])
def test_eval_ema_follows_flow_grpos_ema_module_wrapper_rule(tiny_model_dir, tmp_path, blends):
    """blends=2: flow_grpo with train.gradient_accumulation_steps=2 calls ema.step after each of a step's two
    micro-batches, with the same global_step and weights (trainer.ema_blends)."""
    from rayflow.learner.optim import update_eval_ema

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.ema_decay=0.2", "trainer.ema_every=2",
                    f"trainer.ema_blends={blends}")
    spec = LearnerSpec.from_config(cfg)
    assert spec.ema_blends == blends
    model = load_policy_model(spec, CPU)
    assert lora.adapter_names(model.transformer) == ["default", "ema"]
    expected = adapter_state(model.transformer, lora.EVAL_EMA_ADAPTER)
    assert all(torch.equal(v, adapter_state(model.transformer, "default")[k]) for k, v in expected.items())  # starts as a copy
    g = torch.Generator().manual_seed(0)
    for n in range(1, 6):  # flow_grpo: ema.step(params, global_step) after global_step += 1
        default = {k: torch.randn(v.shape, generator=g) for k, v in expected.items()}
        load_adapter_state(model.transformer, "default", default)
        update_eval_ema(model.transformer, cfg.trainer.ema_decay, cfg.trainer.ema_every, n, spec.ema_blends)
        if (n + 1) % 2 == 0:  # its update_step_interval rule
            d = min((1 + n) / (10 + n), 0.2)  # its get_current_decay
            for _ in range(blends):
                expected = {k: v + (1 - d) * (default[k] - v) for k, v in expected.items()}
        got = adapter_state(model.transformer, lora.EVAL_EMA_ADAPTER)
        for k, v in expected.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)


def test_rollouts_record_each_stochastic_steps_mean_for_ratio_norm(tiny_model_dir, tmp_path):
    """GRPO-Guard compares μ_θ with the rollout's μ_old: the sampler's recorded means are the learner's replayed
    ones, so on-policy the normalised ratio is exactly 1 (nothing clipped)."""
    from rayflow.learner.objective import _conds, _guided_velocity, backward
    from rayflow.sampling.flow_sde import flow_step

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "algorithm.ratio_norm=true", "sampling.sde_step_indices=[1,2]")
    run = reference.build_run(cfg)
    batch, _ = reference.rollout(run)
    t, params = batch[0], batch[0].params
    assert t.means.shape[0] == 2
    with pytest.raises(KeyError, match="not stochastic"):
        t.step_mean(0)
    with torch.no_grad():
        conds = _conds(batch, CPU)
        for j in (1, 2):
            x, x_next = (torch.stack([b.latent(i) for b in batch]) for i in (j, j + 1))
            v = _guided_velocity(run.model, run.spec.policy, x, t.timesteps[j], conds, params)
            _, _, mean, _ = flow_step(v, x, t.sigmas[j], t.sigmas[j + 1], sde_type="sde", noise_level=params.noise_level,
                                      prev_sample=x_next, sigma_max=t.sigmas[1])
            assert torch.equal(torch.stack([b.step_mean(j) for b in batch]), mean)
    metrics = backward(run.spec, run.model, run.spec.policy, batch, version=0)
    assert metrics["train/clip_frac"] == 0


FULL = ("learner.train_mode=full", "sync.mode=merged")


def test_full_fine_tuning_shards_every_weight_and_forwards_under_each_copy_as_the_plain_model(mesh1, tiny_model_dir, tmp_path):
    """Every parameter trained and sharded, "old" and the KL's "base" whole-weight copies sharded alike; a forward
    under a copy (swapped in place) equals the plain model's, and leaves the trained weights as they were, even with
    reshard_after_forward=False (which keeps a forward's gathered weights)."""
    from rayflow.models import weight_copies
    from rayflow.learner.model import add_full_weight_copies
    from rayflow.models.weight_sets import named_weights, using_reference, using_weights

    cfg = small_cfg(NFT, tiny_model_dir, tmp_path, SHARD1, *FULL, "algorithm.kl_beta=0.01", "learner.reshard_after_forward=false")
    spec = LearnerSpec.from_config(cfg)
    backend, plain = LearnerBackend(spec, mesh1, CPU), load_policy_model(spec, CPU)
    add_full_weight_copies(spec, plain.transformer)
    params = dict(backend.transformer.named_parameters())
    assert weight_copies.weight_names(backend.transformer) == ["default", "old"]  # what checkpoints hold (not the base)
    assert all(p.requires_grad and isinstance(p, DTensor) and p.placements == (Shard(0),) for p in params.values())
    assert {id(p) for g in backend.optimizer.param_groups for p in g["params"]} == {id(p) for p in params.values()}
    for name in ("old", "base"):
        copy = named_weights(backend.transformer, name)
        assert copy.keys() == params.keys() and all(copy[n].placements == params[n].placements for n in copy)
    g = torch.Generator().manual_seed(0)
    for name in ("default", "old"):  # three different weight sets, the same in both models
        values = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in plain.transformer.named_parameters()}
        for m in (backend.model, plain):
            load_adapter_state(m.transformer, name, values)
    trained = adapter_state(backend.transformer, "default")
    with torch.no_grad():
        velocities = {}
        for label, swap in (("old", lambda t: using_weights(t, "old")), ("base", using_reference), ("default", lambda t: using_weights(t, "default"))):
            with swap(plain.transformer):
                expected = velocity(plain)
            with swap(backend.transformer):
                velocities[label] = velocity(backend.model)
            torch.testing.assert_close(velocities[label], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(velocity(backend.model), velocities["default"], rtol=0, atol=0)  # not a stale gather
    assert len({float(v.abs().sum()) for v in velocities.values()}) == 3
    after = adapter_state(backend.transformer, "default")
    assert all(torch.equal(after[n], trained[n]) for n in trained)


def test_full_fine_tuning_refuses_checkpoint_storage_a_learner_rank_does_not_see(ray_session, tiny_model_dir, tmp_path):
    """Each rank writes its shards into the run's checkpoints itself: a rank on a node that does not see the driver's
    trainer.output_dir (its own disk, as on the shipped cluster configs, whose driver runs on the head) is named when
    the group starts, not by the first save's error."""
    from rayflow.errors import ConfigError

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, shared: bool):
            self.shared = shared

        def sees(self, path: str) -> bool:
            return self.shared and os.path.exists(path)

    class Placed:
        def describe(self, rank: int) -> str:
            return f"{rank} of 2 on node 10.0.0.{7 + rank}"

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "learner.train_mode=full", "sync.mode=merged")
    group = LearnerGroup.__new__(LearnerGroup)
    group.spec, group.placed = LearnerSpec.from_config(cfg), Placed()
    group.workers = [Rank.remote(True), Rank.remote(True)]
    group.check_shared_checkpoints()
    group.workers = [Rank.remote(True), Rank.remote(False)]
    with pytest.raises(ConfigError, match=rf"^trainer\.output_dir: got '{tmp_path}'; allowed: storage the driver's node "
                                          rf"and every learner node share .*learner rank 1 of 2 on node 10\.0\.0\.8 does "
                                          rf"not see .*\.shared-probe-"):
        group.check_shared_checkpoints()
    assert os.listdir(cfg.trainer.run_dir + "/checkpoints") == []  # the probe removed


def test_full_fine_tuning_on_2_ranks_follows_the_reference_and_resumes_across_world_sizes(ray_session, tiny_model_dir, tmp_path):
    """FlowGRPO with a KL to the frozen base: 2 FSDP2 ranks step as the reference trainer does; the checkpoint the 2
    ranks write in shards loads into the single-process reference exactly, and the reference's into the 2 ranks."""
    from rayflow.learner.sharded import read_weights

    overrides = (*FULL, "algorithm.kl_beta=0.01", "learner.lr=0.001")  # lr: see learners2
    cfg2 = small_cfg(GRPO, tiny_model_dir, tmp_path / "ws2", *overrides, "learner.world_size=2")
    cfg1 = small_cfg(GRPO, tiny_model_dir, tmp_path / "ws1", *overrides)
    group, run = LearnerGroup(LearnerSpec.from_config(cfg2), name="test-full-2"), reference.build_run(cfg1)
    try:
        base = {n: p.detach().clone() for n, p in run.model.transformer.named_parameters()}
        batch, _ = reference.rollout(run)
        m2 = group.get(group.train_step(batch))[0]
        m_ref, res = reference.learn(run, batch)
        assert m2["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-4, abs=1e-6)
        assert m2["loss/kl"] == pytest.approx(m_ref["loss/kl"], rel=1e-4) and m_ref["loss/kl"] == 0  # one step from the base
        assert m2["train/grad_norm"] == pytest.approx(res.grad_norm, rel=1e-5)

        path2 = save_checkpoint(str(tmp_path / "ckpt2"), group.checkpoint(1, data=SAMPLER_STATE), keep=1)
        assert sorted(f for f in os.listdir(os.path.join(path2, "weights")) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        saved = read_weights(os.path.join(path2, "weights"), "default")
        ref = dict(run.model.transformer.named_parameters())
        assert saved.keys() == ref.keys()
        for name, value in saved.items():
            torch.testing.assert_close(value, ref[name].detach(), rtol=0, atol=1e-5)
        assert max(float((saved[n] - base[n]).abs().max()) for n in base) > 5e-4  # every weight may move: it trained
        # 2 ranks' shards -> 1 process: exactly what was saved.
        fresh = reference.build_run(cfg1)
        reference.resume(fresh, path2)
        assert all(torch.equal(p, saved[n]) for n, p in fresh.model.transformer.named_parameters())
        # 1 process -> 2 ranks: the group now holds the reference's weights and moments, bit for bit.
        path1 = reference.save(run)
        group.restore(load_checkpoint(path1, group.identity))
        again = group.checkpoint(1, data=SAMPLER_STATE)
        for name, p in run.model.transformer.named_parameters():
            assert torch.equal(read_weights(again.sharded.directory, "default")[name], p.detach()) or pytest.fail(name)
        # Both resumed runs step alike: the AdamW moments came across too (fresh ones would step ~lr apart).
        m2, (m_ref, _) = group.get(group.train_step(batch))[0], reference.learn(fresh, batch)
        assert m2["loss/policy"] == pytest.approx(m_ref["loss/policy"], rel=1e-4, abs=1e-6) and m2["loss/kl"] > 0
        stepped = read_weights(group.checkpoint(2, data=SAMPLER_STATE).sharded.directory, "default")
        for name, p in fresh.model.transformer.named_parameters():
            torch.testing.assert_close(stepped[name], p.detach(), rtol=0, atol=1e-5)
    finally:
        group.shutdown()


def test_autocast_full_fine_tuning_trains_fp32_master_weights_over_a_bf16_model(mesh1, tiny_model_dir, tmp_path, grpo_batches):
    """learner.mixed_precision=autocast with train_mode=full: every weight cast to fp32 as its block is sharded (the
    bf16 values exactly), bf16 matmuls, and an AdamW step far below bf16's resolution kept by the fp32 masters."""
    from rayflow.models import load_model

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, SHARD1, *FULL, "model.dtype=bfloat16", "learner.mixed_precision=autocast",
                    "learner.lr=1e-6")
    backend = LearnerBackend(LearnerSpec.from_config(cfg), mesh1, CPU)
    bf16 = dict(load_model(tiny_model_dir, dtype=torch.bfloat16, transformer_only=True).transformer.named_parameters())
    before = adapter_state(backend.transformer, "default")
    assert before.keys() == bf16.keys() and all(v.dtype == torch.float32 and torch.equal(v, bf16[k].float()) for k, v in before.items())
    seen = []
    backend.transformer.transformer_blocks[0].attn.to_q.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    metrics = backend.train_step(grpo_batches[0])
    assert seen and set(seen) == {torch.bfloat16} and metrics["train/skipped"] == 0
    after = adapter_state(backend.transformer, "default")
    moved = [k for k in after if not torch.equal(after[k], before[k])]
    names = param_names(backend.transformer, backend.optimizer)
    stepped = sorted(names[p] for p, state in backend.optimizer.state.items() if state)
    # Nearly every weight took its ~1e-6 step (a few have an exactly zero gradient: biases a softmax or norm cancels) ...
    assert set(moved) <= set(stepped) and len(moved) > len(after) * 0.8
    # ... which bf16 rounds away wherever |w| > 1e-3 (half a bf16 ulp there exceeds the step): only fp32 masters keep it.
    large = {k: bf16[k].float().abs() > 1e-3 for k in moved}
    kept = sum(int((after[k] != before[k])[large[k]].sum()) for k in moved)
    in_bf16 = sum(int((after[k].bfloat16() != bf16[k])[large[k]].sum()) for k in moved)
    assert kept > 10_000 and in_bf16 == 0
    states = [s for state in backend.optimizer.state.values() for s in state.values() if torch.is_tensor(s) and s.ndim]
    assert states and {s.dtype for s in states} == {torch.float32}


def test_fsdp_shards_flux_single_stream_blocks_too(mesh1, tiny_twin):
    """FLUX.1's 38 single-stream blocks (half its weights) are FSDP2 groups of their own, not part of the root group
    gathered whole through the forward and backward; only embeddings, norms and projections stay in the root."""
    from rayflow.distributed.parallelize import apply_fsdp

    model = load_model(tiny_twin("flux"))
    t = model.transformer
    assert len(t.single_transformer_blocks) > 0
    apply_fsdp(t, mesh1)
    assert all(isinstance(b, FSDPModule) for b in (*t.transformer_blocks, *t.single_transformer_blocks))
    outside = [m for n, m in t.named_modules() if n and not n.startswith(("transformer_blocks", "single_transformer_blocks"))]
    assert outside and not any(isinstance(m, FSDPModule) for m in outside)  # the root group: what no block owns
