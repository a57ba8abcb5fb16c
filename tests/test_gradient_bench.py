"""tools/bench.py gradients: the gradient noise scale's estimators against gradients of known mean and covariance,
and one configuration measured end to end on the shapes base."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import bench  # noqa: E402
from gradient_bench import noise_scale  # noqa: E402

from rayflow.paths import recipe  # noqa: E402

P = 4000  # weights


def synthetic_batches(signal: torch.Tensor, sample_std: float, batch_size: int, batches: int, seed: int = 0) -> torch.Tensor:
    """K batch-mean gradients of per-sample gradients G + sample_std·z, z ~ N(0, I): Σ = sample_std²·I."""
    g = torch.Generator().manual_seed(seed)
    return signal + sample_std / batch_size**0.5 * torch.randn(batches, signal.numel(), generator=g, dtype=torch.float64)


def test_estimates_match_the_known_signal_and_noise():
    signal = torch.full((P,), 0.01, dtype=torch.float64)  # |G|² = 0.4
    est = noise_scale(synthetic_batches(signal, sample_std=0.1, batch_size=16, batches=200), batch_size=16)
    true_g2, true_trace = 0.4, 0.1**2 * P  # tr Σ = 40, B_noise = 100
    assert abs(est["signal_sq"] - true_g2) < 4 * est["signal_sq_se"] and est["signal_sq_se"] < 0.1 * true_g2
    assert est["trace_sigma"] == pytest.approx(true_trace, rel=0.05)
    assert est["b_noise"] == pytest.approx(true_trace / true_g2, rel=0.1)
    assert est["signal_sigmas"] > 10
    # Two batches' gradients share |G|² of their |g|² = |G|² + tr Σ / n: cosine 0.4 / 2.9.
    assert est["mean_cosine"] == pytest.approx(true_g2 / (true_g2 + true_trace / 16), abs=0.02)


def test_pure_noise_is_not_taken_for_signal_and_bounds_the_noise_scale_from_below():
    est = noise_scale(synthetic_batches(torch.zeros(P, dtype=torch.float64), 0.1, 16, 40), batch_size=16)
    assert abs(est["signal_sigmas"]) < 3
    assert est["trace_sigma"] == pytest.approx(40.0, rel=0.1)
    # With |G|² = 0 any finite bound is below the truth (infinite); it is tr Σ over two standard errors.
    assert 0 < est["b_noise_lower"] == pytest.approx(est["trace_sigma"] / (max(est["signal_sq"], 0) + 2 * est["signal_sq_se"]))


def test_fewer_than_three_batches_are_refused():
    with pytest.raises(ValueError, match="got 2 batch gradients; allowed: at least 3"):
        noise_scale(torch.ones(2, 5), batch_size=4)
    with pytest.raises(SystemExit, match="--batches: got 2; allowed: integers >= 3"):
        bench.main(["gradients", "--batches", "2"])
    with pytest.raises(SystemExit, match=r"--recipe: got \['nowhere.yaml'\]; allowed: recipe YAML files"):
        bench.main(["gradients", "--recipe", "nowhere.yaml"])


SMALL = ["sampling.num_steps=4", "algorithm.prompts_per_step=2", "algorithm.group_size=4", "learner.micro_batch_size=4",
         "rollout.micro_batch_size=4"]


@pytest.mark.parametrize("chosen, name", [(["--configs", "flow_grpo_same_noise"], "flow_grpo_same_noise"),
                                          (["--recipe", recipe("flowgrpo_qwen_image.yaml")], recipe("flowgrpo_qwen_image.yaml"))])
def test_a_configuration_measured_on_the_shapes_base(capsys, chosen, name):
    bench.main(["gradients", *chosen, "--batches", "3", "--threads", "1", *SMALL])
    out = capsys.readouterr().out
    result = bench.json.loads(out[out.index("{"):])["configs"][name]
    assert result["samples_per_batch"] == 8
    assert result["weights"] > 0 and result["trace_sigma"] > 0 and result["batch_s"] > 0
    assert -1 <= result["mean_cosine"] <= 1


def test_overrides_may_follow_the_recipes():
    """README: `--recipe FILE [FILE …]` measures any recipes "with any overrides after them"; the override was taken
    for a recipe file and refused ("--recipe: got ['sampling.num_steps=4']")."""
    args = bench.parse_args(["gradients", "--recipe", recipe("flowgrpo_qwen_image.yaml"), "sampling.num_steps=4"])
    assert args.recipe == [recipe("flowgrpo_qwen_image.yaml")] and args.overrides == ["sampling.num_steps=4"]
