"""Per-component reward normalisation: the formulas written out, unchanged totals without it, and a
synchronous distributed run with normalised components equal to the reference trainer."""

import pytest
import torch

from rayflow import reference
from rayflow.config import RewardFnConfig, from_dict
from rayflow.driver.trainer import Trainer
from rayflow.errors import ConfigError
from rayflow.rewards.normalize import normalize_component, training_rewards
from rayflow.types import TrajectoryRef
from tiny_run import GRPO, small_cfg


def scored(rewards: list[dict[str, float]], groups: list[int], totals: list[float]) -> list[TrajectoryRef]:
    return [TrajectoryRef(None, i, "p", 0, g, i, [0], reward=t, rewards=r)
            for i, (r, g, t) in enumerate(zip(rewards, groups, totals))]


def pair(gap: float) -> float:
    """A pair of values `gap` apart standardised: its mean is gap/2 from each, its population std gap/2."""
    return (gap / 2) / (gap / 2 + 1e-4)


def test_group_and_batch_standardisation_written_out():
    values = torch.tensor([1.0, 3.0, 10.0, 10.0, 20.0, 40.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    # group: a pair a < b -> ∓ pair(b − a); an equal pair -> 0
    assert torch.allclose(normalize_component(values, groups, "group"),
                          torch.tensor([-pair(2), pair(2), 0, 0, -pair(20), pair(20)]), rtol=0, atol=1e-6)
    mean, std = values.mean(), ((values - values.mean()) ** 2).mean().sqrt()
    assert torch.allclose(normalize_component(values, groups, "batch"), (values - mean) / (std + 1e-4))
    assert torch.equal(normalize_component(values, groups, "none"), values)


@pytest.mark.parametrize("mode", ["group", "batch"])
def test_a_flat_group_or_batch_normalises_to_exactly_zero(mode):
    # float32's mean of eight 0.8s misses 0.8 by a rounding error; over std + eps that was an offset of -6e-4 (0.1: -7e-5),
    # and the advantages, under stat_tracking=prompt, graded two flat groups of one prompt by it (+-0.72).
    values = torch.tensor([0.8] * 8 + [0.1] * 8)
    groups = torch.tensor([0] * 8 + [1] * 8)
    flat = values[:8] if mode == "batch" else values
    assert torch.equal(normalize_component(flat, groups[: len(flat)], mode), torch.zeros(len(flat)))


def test_training_rewards_weights_normalised_components_and_keeps_totals_without():
    rewards = [{"a": 0.0, "b": 100.0}, {"a": 1.0, "b": 100.5}, {"a": 0.5, "b": 300.0}, {"a": 0.5, "b": 100.0}]
    trajectories = scored(rewards, [0, 0, 1, 1], totals=[0.1, 0.2, 0.3, 0.4])
    plain = [RewardFnConfig("a", 1.0), RewardFnConfig("b", 0.5)]
    totals, means = training_rewards(trajectories, plain)
    assert totals.tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])  # the scored totals themselves
    assert means == {"reward/a/normalized": 0.5, "reward/b/normalized": 150.125}

    totals, means = training_rewards(trajectories, [RewardFnConfig("a", 1.0, normalize="group"),
                                                    RewardFnConfig("b", 0.5, normalize="group")])
    a, b0, b1 = pair(1.0), pair(0.5), pair(200.0)
    assert torch.allclose(totals, torch.tensor([-a - 0.5 * b0, a + 0.5 * b0, 0.5 * b1, -0.5 * b1]), rtol=0, atol=1e-6)
    assert means["reward/a/normalized"] == pytest.approx(0.0, abs=1e-6)


def test_bad_normalize_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"reward.functions\[0\].normalize: got 'rank'; allowed: one of \['none', 'group', 'batch'\]"):
        from_dict({"reward": {"functions": [{"name": "color", "normalize": "rank"}]}})


def test_synchronous_run_with_normalised_components_equals_the_reference(ray_session, tiny_model_dir, tmp_path):
    overrides = ["trainer.total_steps=1", "trainer.save_every=0", "trainer.eval_every=0", "logging.progress_bar=false",
                 "async.max_staleness=0",
                 "reward.functions=[{name: color, normalize: group}, {name: jpeg_compressibility, weight: 0.5, normalize: batch}]"]
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "distributed", *overrides)
    trainer = Trainer(cfg)
    try:
        history = trainer.run()
    finally:
        trainer.shutdown()
    _, ref_history = reference.train(small_cfg(GRPO, tiny_model_dir, tmp_path / "reference", *overrides), log=lambda *_: None)
    assert [h["loss/policy"] for h in history] == [r.metrics["loss/policy"] for r in ref_history]
    assert [h["train/grad_norm"] for h in history] == [r.grad_norm for r in ref_history]
    assert [h["reward/mean"] for h in history] == [r.reward_mean for r in ref_history]  # raw totals logged
    for h in history:  # one prompt per step: group-standardised colour has mean 0; batch-standardised jpeg too
        assert abs(h["reward/color/normalized"]) < 1e-5 and abs(h["reward/jpeg_compressibility/normalized"]) < 1e-5
        assert h["reward/jpeg_compressibility"] < -0.1  # the raw component (−kB) is logged as it was
