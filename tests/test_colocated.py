"""Colocated placement (placement.mode=colocated): one actor per device samples under the adapter it trains.

Synchronous runs equal the single-process reference trainer: bit for bit on one device (the reference's own loop),
to rounding on two FSDP2-sharded devices (their gradient all-reduce sums in another order, as the disaggregated
world-size-2 learners do), with no weight broadcast."""

import math

import pytest
import torch

from rayflow import reference
from rayflow.config import load_config
from rayflow.distributed.colocated import replica_ranks
from rayflow.distributed.placement import PlacedGroup
from rayflow.distributed.resources import role_demand
from rayflow.driver.trainer import Trainer
from rayflow.errors import ConfigError
from rayflow.learner.worker import LearnerError
from rayflow.paths import recipe as recipe_path
from rayflow.planning.memory import GiB, check_fits, plan_config
from tiny_run import GRPO, NFT, final_adapters, small_cfg

STEPS = 2
SYNCHRONOUS = [f"trainer.total_steps={STEPS}", f"trainer.save_every={STEPS}", "logging.progress_bar=false",
               "async.max_staleness=0", "placement.mode=colocated"]


def run_both(recipe: str, tiny_model_dir: str, tmp_path, *overrides: str, then=None):
    """(colocated history, its trainer's start-up phases, its final adapters, reference history, reference adapters);
    `then(trainer)` runs after the colocated run, before its trainer shuts down."""
    cfg = small_cfg(recipe, tiny_model_dir, tmp_path / "colocated", *SYNCHRONOUS, *overrides)
    trainer = Trainer(cfg)
    try:
        history = trainer.run()
        if then is not None:
            then(trainer)
    finally:
        trainer.shutdown()
    ref_cfg = small_cfg(recipe, tiny_model_dir, tmp_path / "reference", *SYNCHRONOUS, *overrides)
    _, ref_history = reference.train(ref_cfg, log=lambda *_: None)
    weights = [final_adapters(c.trainer.run_dir, STEPS) for c in (cfg, ref_cfg)]
    return history, trainer.startup_s, weights[0], ref_history, weights[1]


@pytest.mark.parametrize("train_mode", ["lora", "full"])
def test_one_device_equals_the_reference_trainer_bit_for_bit(ray_session, tiny_model_dir, tmp_path, train_mode):
    """DiffusionNFT (rollouts under the EMA "old": an adapter the forward switches to, or whole weights swapped into
    the parameters for the sampling phase) with the evaluation EMA, evaluated on the device at the last step (the
    "ema" tensors sampled in the slot, then put back), optimizer offload on: every weight set equal."""
    full = ("learner.train_mode=full", "learner.lr=0.0001", "algorithm.kl_beta=0.01") if train_mode == "full" else ()
    setup = {}
    history, startup, adapters, ref_history, expected = run_both(
        NFT, tiny_model_dir, tmp_path, "trainer.ema_decay=0.9", "trainer.ema_every=1", f"trainer.eval_every={STEPS}",
        "learner.offload_optimizer_during_rollout=true", *full, then=lambda t: setup.update(t.learners.setup_seconds()))
    assert [h["reward/mean"] for h in history] == [r.reward_mean for r in ref_history]
    assert [h["loss/policy"] for h in history] == [r.metrics["loss/policy"] for r in ref_history]
    assert [h["train/grad_norm"] for h in history] == [r.grad_norm for r in ref_history]
    assert sorted(adapters) == ["default", "ema", "old"]
    for name in expected:
        for key, value in expected[name].items():
            assert torch.equal(adapters[name][key], value), f"{name}/{key} differs from the reference"
    # Nothing was sent: no weight-sync actor started, and a version's hand-off took no time.
    assert "devices" in startup and "weight sync" not in startup
    # The launcher's breakdown of the device's start-up: the parts after the process started lie inside the phase.
    assert list(setup) == ["process age", "device", "process group", "model", "rollout rank"]
    assert setup["process age"] > 0 and setup["model"] > 0
    assert sum(setup.values()) - setup["process age"] < startup["devices"]
    assert all(h["perf/sync_s"] == 0 for h in history)


def test_two_sharded_devices_serve_uneven_requests_end_where_the_reference_does_and_stop_when_one_dies(
        ray_session, tiny_model_dir, tmp_path):
    """FlowGRPO on two FSDP2 ranks, each a rollout replica: 3 requests per step, so one replica samples two and the
    other one. The gathered weights serve them with no collective per forward; one per forward would leave the busier
    replica waiting for a partner until rollout.collective_timeout_s. lr 1e-3 keeps the all-reduce's rounding
    (~lr x relative rounding) well inside 1e-5, as in test_learner's world-size-2 test."""
    def kill_a_device(trainer):
        """Then a device dies: its learner rank's optimizer shard is gone with it, so the run stops, naming it and
        how to continue, instead of training on without that rank."""
        ray_session.kill(trainer.learners.workers[1])
        trainer.cfg.trainer.total_steps += 1
        with pytest.raises(LearnerError, match=r"learner rank 1 of 2 on node .* in placement.mode=colocated .* trainer.resume=auto"):
            trainer.run()

    history, _, adapters, ref_history, expected = run_both(
        GRPO, tiny_model_dir, tmp_path, "learner.world_size=2", "rollout.num_replicas=2", "algorithm.prompts_per_step=3",
        "learner.lr=0.001", "rollout.collective_timeout_s=60", then=kill_a_device)
    for h, r in zip(history, ref_history, strict=True):
        assert h["reward/mean"] == pytest.approx(r.reward_mean, rel=1e-5)
        assert h["loss/policy"] == pytest.approx(r.metrics["loss/policy"], rel=1e-4, abs=1e-6)
        # Step 2 samples under step 1's rounding too: the norm moves ~1e-5 relative (measured 1.1e-5).
        assert h["train/grad_norm"] == pytest.approx(r.grad_norm, rel=1e-4)
    for key, value in expected["default"].items():
        torch.testing.assert_close(adapters["default"][key], value, rtol=0, atol=1e-5)
    trained = max(float(v.abs().max()) for k, v in expected["default"].items() if ".lora_B." in k)
    assert trained > 1e-4  # B starts at 0: the adapter moved, far beyond the tolerance


def test_full_fine_tuning_under_autocast_samples_its_fp32_masters_over_a_bf16_pipeline(ray_session, tiny_model_dir, tmp_path):
    """learner.mixed_precision=autocast keeps fp32 master weights over a model.dtype=bfloat16 pipeline: the device
    samples with them under the learner's autocast (its bf16 latents met fp32 weights: "mat1 and mat2 must have the
    same dtype" at the first rollout), and its rewards follow the disaggregated run's, whose rollout ranks sample a
    bf16 copy of the same weights, to bf16's rounding."""
    full = ("learner.train_mode=full", "learner.lr=0.0001", "model.dtype=bfloat16", "learner.mixed_precision=autocast")
    histories = []
    for placement in (SYNCHRONOUS, [s for s in SYNCHRONOUS if s != "placement.mode=colocated"] + ["sync.mode=merged"]):
        trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path / str(len(histories)), *placement, *full))
        try:
            histories.append(trainer.run())
        finally:
            trainer.shutdown()
    colocated, disaggregated = histories
    assert [h["reward/mean"] for h in colocated] == pytest.approx([h["reward/mean"] for h in disaggregated], rel=1e-2)
    assert all(math.isfinite(h["train/grad_norm"]) and h["train/grad_norm"] > 0 for h in colocated)


def test_cfg_parallel_ranks_of_a_replica_share_a_node():
    """Replica i takes devices i·W .. i·W+W−1 (in the placement's rank order, grouped by node); a replica whose
    ranks would span two nodes is refused naming rollout.cfg_parallel_size and the devices per node."""
    two_nodes = PlacedGroup(pg=None, rank_bundles=[0, 1, 2, 3], bundle_nodes={0: "a" * 16, 1: "a" * 16, 2: "b" * 16, 3: "b" * 16},
                           bundles=[{"CPU": 1.0}] * 4)
    assert replica_ranks(two_nodes, 4, 2) == [[0, 1], [2, 3]]
    uneven = PlacedGroup(pg=None, rank_bundles=[0, 1, 2, 3], bundle_nodes={0: "a" * 16, 1: "a" * 16, 2: "a" * 16, 3: "b" * 16},
                        bundles=[{"CPU": 1.0}] * 4)
    with pytest.raises(ConfigError) as info:
        replica_ranks(uneven, 4, 2)
    assert info.value.key == "rollout.cfg_parallel_size" and "{'aaaaaaaaaaaa': 3, 'bbbbbbbbbbbb': 1}" in info.value.allowed
    # Nodes of 4 devices each, which 2 divides: the group was split because something else held a device of node a.
    with pytest.raises(ConfigError) as info:
        replica_ranks(uneven, 4, 2, node_capacity={"a" * 16: 4, "b" * 16: 4})
    assert "{'aaaaaaaaaaaa': '3 of its 4', 'bbbbbbbbbbbb': '1 of its 4'}" in info.value.allowed
    assert "held by other placement groups or actors" in info.value.allowed


def test_colocated_recipes_ask_for_one_bundle_per_device_and_fit_their_gpus():
    """The one-GPU recipes are the 8-GPU ones (their `base`) on one colocated device; each device asks Ray for
    placement.gpus_per_device and no weight-sync actor; the planner fits them on an 80 GB GPU, the sharded 8-GPU
    ones with the whole transformer gathered while they sample, full fine-tuning included."""
    for name in ("flowgrpo_qwen_image", "diffusion_nft_qwen_image"):
        one, eight = load_config(recipe_path(f"{name}_1gpu.yaml")), load_config(recipe_path(f"{name}_8gpu.yaml"))
        assert (one.placement.mode, one.learner.world_size, one.async_.max_staleness) == ("colocated", 1, 0)
        assert (one.algorithm.name, one.sampling, one.model) == (eight.algorithm.name, eight.sampling, eight.model)
        assert role_demand(one, cluster_has_gpus=True) == {"devices": {"CPU": 8.0, "GPU": 1.0}, "reward": {"CPU": 4.0}}
    cfg = load_config(recipe_path("flowgrpo_qwen_image_8gpu_colocated.yaml"))
    (device, _), _ = plan_config(cfg)
    transformer = device.resident["transformer weights (shard)"] * 8  # 8 shards of bf16 weights
    assert device.phases["denoising (transformer forward)"] > transformer
    check_fits(cfg, [device], int(79.6 * GiB))
    # Full fine-tuning of the 20B transformer: AdamW's moments leave the GPU while it samples, and come back to train.
    cfg = load_config(recipe_path("flowgrpo_qwen_image_8gpu_full.yaml"))
    (device, _), _ = plan_config(cfg)
    assert "gradients + AdamW states" not in device.resident
    check_fits(cfg, [device], int(79.6 * GiB))
