import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rayflow.algorithms.advantages import assign_advantages, grpo_advantages
from rayflow.algorithms.diffusion_nft import diffusion_nft_loss, ema_decay, ema_step, ema_update, optimality_probability
from rayflow.algorithms.flow_grpo import RatioNorm, flow_grpo_loss, guard_log_ratio
from rayflow.sampling.flow_sde import flow_step

EPS = 1e-4


# --- GRPO advantages -------------------------------------------------------------------------

def test_group_advantages_population_std():
    # Groups interleaved and not numbered 0..n-1: group 7 = [1, 2, 3], group 3 = [5, 5, 5].
    rewards = torch.tensor([1.0, 5.0, 2.0, 5.0, 3.0, 5.0])
    groups = torch.tensor([7, 3, 7, 3, 7, 3])
    adv = grpo_advantages(rewards, groups)
    std = math.sqrt(2 / 3)  # population std of [1, 2, 3]
    expected = torch.tensor([-1 / (std + EPS), 0, 0, 0, 1 / (std + EPS), 0])
    torch.testing.assert_close(adv.values, expected)
    assert (adv.num_groups, adv.zero_signal_groups) == (2, 1)
    assert torch.equal(adv.values[1::2], torch.zeros(3))


def test_global_std():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), global_std=True)
    std = math.sqrt(((1 - 3.5) ** 2 + (2 - 3.5) ** 2 + (3 - 3.5) ** 2 + 3 * (5 - 3.5) ** 2) / 6)
    torch.testing.assert_close(adv.values, torch.tensor([-1, 0, 1, 0, 0, 0]) / (std + EPS))
    assert adv.zero_signal_groups == 1


@pytest.mark.parametrize("clip_max, top", [(5.0, 9 / (3 + EPS)), (2.0, 2.0)])
def test_clipping(clip_max, top):
    # Nine zeros and a ten: mean 1, population std 3, the ten is 3 std above.
    rewards = torch.tensor([0.0] * 9 + [10.0])
    adv = grpo_advantages(rewards, torch.zeros(10, dtype=torch.long), clip_max=clip_max)
    torch.testing.assert_close(adv.values, torch.tensor([-1 / (3 + EPS)] * 9 + [top]))


def test_equal_rewards_give_exact_zeros():
    # 0.1 is not representable: the group mean is off by rounding, yet the advantages are exactly 0.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.2, 0.3])
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 2, 2]))
    assert torch.equal(adv.values[:5], torch.zeros(5))
    assert (adv.num_groups, adv.zero_signal_groups) == (3, 2)
    torch.testing.assert_close(adv.values[5:], torch.tensor([-0.05, 0.05]) / (0.05 + EPS))


# --- FlowGRPO --------------------------------------------------------------------------------

def test_flow_grpo_clipped_surrogate_by_hand():
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.5, 1.1])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    old = torch.tensor([-1.0, -2.0, 0.5, 0.0, -3.0])
    log_prob = (old + ratio.log()).requires_grad_()
    out = flow_grpo_loss(log_prob, old, advantages, clip_range=0.2)
    # Per sample max(−A·r, −A·clip(r, 0.8, 1.2)):
    #   r=1,   A=1:  −1               r=1.5, A=1:  max(−1.5, −1.2) = −1.2 (clipped)
    #   r=0.5, A=−1: max(0.5, 0.8)=0.8 (clipped)   r=1.5, A=−1: max(1.5, 1.2) = 1.5
    #   r=1.1, A=2:  −2.2 (inside the clip)
    per_sample = [-1.0, -1.2, 0.8, 1.5, -2.2]
    assert out.loss.item() == pytest.approx(sum(per_sample) / 5, abs=1e-6)
    assert out.policy.item() == pytest.approx(sum(per_sample) / 5, abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(3 / 5)
    assert out.approx_kl.item() == pytest.approx(0.5 * (ratio.log() ** 2).mean().item(), rel=1e-5)
    assert out.kl.item() == 0
    out.loss.backward()
    # d/dlogp of −A·r is −A·r; clipped samples pass no gradient.
    torch.testing.assert_close(log_prob.grad, torch.tensor([-1.0, 0.0, 0.0, 1.5, -2.2]) / 5)


@pytest.mark.parametrize("std, expected_kl", [(torch.tensor(0.5), (2 + 8) / 2), (torch.tensor([0.5, 1.0]).view(2, 1, 1), (2 + 2) / 2)])
def test_flow_grpo_kl_term(std, expected_kl):
    mean = torch.zeros(2, 3, 4)
    ref_mean = torch.stack([torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)])
    zeros = torch.zeros(2)
    # Sample 0: mean(1²)/(2·0.25) = 2; sample 1: mean(2²)/(2·std²) = 8 (std 0.5) or 2 (std 1).
    out = flow_grpo_loss(zeros, zeros, torch.tensor([1.0, -1.0]), 0.2, mean=mean, ref_mean=ref_mean, std=std, kl_beta=0.1)
    assert out.kl.item() == pytest.approx(expected_kl)
    assert out.loss.item() == pytest.approx(0.0 + 0.1 * expected_kl)  # ratio 1: surrogate (−1 + 1)/2 = 0


def test_flow_grpo_kl_needs_means():
    zeros = torch.zeros(2)
    with pytest.raises(ValueError, match="kl_beta > 0 needs mean, ref_mean and std"):
        flow_grpo_loss(zeros, zeros, zeros, 0.2, mean=torch.zeros(2, 3), std=torch.tensor(1.0), kl_beta=0.1)


def guard_step(sigma: float, sigma_next: float, seed: int = 0):
    """An SDE step sampled under v_old and scored under v_θ: (log r, μ_θ, μ_old, std, ε)."""
    g = torch.Generator().manual_seed(seed)
    x, v_old = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    v_theta = v_old + 0.05 * torch.randn(3, 4, 5, generator=g)
    step = dict(sde_type="sde", noise_level=0.7, sigma_max=0.9)
    x_next, old_log_prob, old_mean, std = flow_step(v_old, x, sigma, sigma_next, generator=g, **step)
    _, log_prob, mean, _ = flow_step(v_theta, x, sigma, sigma_next, prev_sample=x_next, **step)
    return log_prob - old_log_prob, mean, old_mean, std, (x_next - old_mean) / std


@pytest.mark.parametrize("sigma, sigma_next", [(0.9, 0.8), (0.3, 0.1)])
def test_guard_log_ratio_is_the_noise_projected_on_the_mean_shift(sigma, sigma_next):
    # GRPO-Guard's RatioNorm written out: with x' = μ_old + std·ε, (log r + mean(Δμ²)/(2std²))·std = mean(ε·Δμ).
    log_ratio, mean, old_mean, std, eps = guard_step(sigma, sigma_next)
    expected = (eps * (mean - old_mean)).mean(dim=(1, 2))
    torch.testing.assert_close(guard_log_ratio(log_ratio, mean, old_mean, std), expected, rtol=1e-3, atol=1e-6)
    # Per-sample stds, [B] or shaped like the latents' leading dimension ([B, 1, 1]), give the same [B].
    for per_sample in (std.expand(3), std.expand(3, 1, 1)):
        torch.testing.assert_close(guard_log_ratio(log_ratio, mean, old_mean, per_sample), expected, rtol=1e-3, atol=1e-6)


def test_flow_grpo_loss_with_ratio_norm_clips_the_normalised_ratio_and_weights_by_one_over_dt():
    log_ratio, mean, old_mean, std, eps = guard_step(0.6, 0.4, seed=1)
    advantages = torch.tensor([1.0, -1.0, 0.5])
    zeros = torch.zeros(3)
    clip_range = 1e-3
    out = flow_grpo_loss(log_ratio, zeros, advantages, clip_range, mean=mean,
                         ratio_norm=RatioNorm(old_mean=old_mean, step_std=std, dt=torch.tensor(0.4 - 0.6)))
    ratio = torch.exp((eps * (mean - old_mean)).mean(dim=(1, 2)))
    surrogate = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_range, 1 + clip_range))
    assert out.policy.item() == pytest.approx((surrogate / 0.2).mean().item(), rel=1e-3)
    assert out.clip_frac.item() == pytest.approx(((ratio - 1).abs() > clip_range).float().mean().item())
    with pytest.raises(ValueError, match="ratio_norm needs mean"):
        flow_grpo_loss(zeros, zeros, advantages, 0.2, ratio_norm=RatioNorm(old_mean, std, torch.tensor(-0.2)))


# --- DiffusionNFT ----------------------------------------------------------------------------

def nft_formula(v_theta, v_old, x0, x_t, t, r, beta, m):
    """DESIGN §7 written out; returns (loss, w_pos, w_neg) with the weights as plain numbers."""
    t = t.view(-1, 1, 1)
    x0_pos = x_t - t * ((1 - beta) * v_old + beta * v_theta)
    x0_neg = x_t - t * ((1 + beta) * v_old - beta * v_theta)
    w_pos = (x0_pos - x0).abs().mean(dim=(1, 2)).detach().clamp(min=1e-5)
    w_neg = (x0_neg - x0).abs().mean(dim=(1, 2)).detach().clamp(min=1e-5)
    pos = ((x0_pos - x0) ** 2).mean(dim=(1, 2)) / w_pos
    neg = ((x0_neg - x0) ** 2).mean(dim=(1, 2)) / w_neg
    return (m * (r * pos + (1 - r) * neg) / beta).mean(), w_pos, w_neg


def nft_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old, v_theta = (torch.randn(3, 4, 2, generator=g) for _ in range(4))
    t = torch.tensor([0.9, 0.5, 0.2])
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    return v_theta, v_old, x0, x_t, t, torch.tensor([0.1, 0.5, 0.95])


def test_nft_by_hand():
    # x_t = [1, 1], t = ½, x0 = 0, v_old = 1, v_θ = 0, β = 1:
    # x̂0⁺ = x_t − t·v_θ = 1 → mean(1)/mean|1| = 1;  v⁻ = 2·v_old − v_θ = 2 → x̂0⁻ = 0 → 0 / 1e-5 = 0.
    ones = torch.ones(1, 1, 2)
    out = diffusion_nft_loss(0 * ones, ones, 0 * ones, ones, torch.tensor([0.5]), torch.tensor([0.75]), beta=1.0, adv_clip_max=5.0)
    assert out.loss.item() == pytest.approx(5.0 * 0.75)


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_nft_matches_formula_with_detached_weights(beta):
    v_theta, v_old, x0, x_t, t, r = nft_inputs()
    v_theta.requires_grad_()
    out = diffusion_nft_loss(v_theta, v_old, x0, x_t, t, r, beta=beta, adv_clip_max=5.0)
    expected, w_pos, w_neg = nft_formula(v_theta, v_old, x0, x_t, t, r, beta, 5.0)
    torch.testing.assert_close(out.loss, expected)
    assert out.policy.item() == pytest.approx(expected.item()) and out.kl.item() == 0
    (grad,) = torch.autograd.grad(out.loss, v_theta)
    # Gradient of the formula with the weights as constants, written out:
    # d/dv_θ of mean((x̂0± − x0)²)/w± is 2(x̂0± − x0)·(∓β·t)/(n·w±).
    tt, n = t.view(-1, 1, 1), x0[0].numel()
    e_pos = x_t - tt * ((1 - beta) * v_old + beta * v_theta.detach()) - x0
    e_neg = x_t - tt * ((1 + beta) * v_old - beta * v_theta.detach()) - x0
    rr, wp, wn = r.view(-1, 1, 1), w_pos.view(-1, 1, 1), w_neg.view(-1, 1, 1)
    expected_grad = 5.0 / beta / 3 * (rr * 2 * e_pos * (-beta * tt) / (n * wp) + (1 - rr) * 2 * e_neg * (beta * tt) / (n * wn))
    torch.testing.assert_close(grad, expected_grad)


def test_nft_kl_term():
    v_theta, v_old, x0, x_t, t, r = nft_inputs(1)
    v_ref = v_theta + torch.arange(3.0).view(3, 1, 1)  # (v_θ − v_ref)² = 0, 1, 4 per sample
    out = diffusion_nft_loss(v_theta, v_old, x0, x_t, t, r, beta=1.0, adv_clip_max=5.0, v_ref=v_ref, kl_beta=0.2)
    assert out.kl.item() == pytest.approx(5 / 3)
    assert out.loss.item() == pytest.approx(out.policy.item() + 0.2 * 5 / 3, rel=1e-6)
    with pytest.raises(ValueError, match="needs v_ref"):
        diffusion_nft_loss(v_theta, v_old, x0, x_t, t, r, beta=1.0, adv_clip_max=5.0, kl_beta=0.2)


def test_optimality_probability():
    adv = torch.tensor([-10.0, -5.0, -1.0, 0.0, 2.5, 7.0])
    torch.testing.assert_close(optimality_probability(adv, 5.0), torch.tensor([0.0, 0.0, 0.4, 0.5, 0.75, 1.0]))


@pytest.mark.parametrize("step, eta", [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.1), (5, 0.3), (6, 0.35), (100, 0.35)])
def test_ema_decay_schedule(step, eta):
    assert ema_decay(step, flat=2, uprate=0.1, uphold=0.35) == pytest.approx(eta)


def test_ema_update_in_place():
    old = [torch.tensor([1.0, 2.0]), torch.tensor([[4.0]])]
    ema_update(old, [torch.tensor([3.0, 6.0]), torch.tensor([[0.0]])], eta=0.25)
    assert torch.equal(old[0], torch.tensor([2.5, 5.0])) and torch.equal(old[1], torch.tensor([[1.0]]))
    ema_update(old, [torch.tensor([7.0, 8.0]), torch.tensor([[9.0]])], eta=0.0)  # η = 0 copies
    assert torch.equal(old[0], torch.tensor([7.0, 8.0])) and torch.equal(old[1], torch.tensor([[9.0]]))


def diffusion_nft_return_decay(step, decay_type):
    """scripts/train_nft_sd3.py's return_decay, written out."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    return 0.0 if step < flat else min((step - flat) * uprate, uphold)


@pytest.mark.parametrize("decay_type", [1, 2])
@pytest.mark.parametrize("steps_per_batch", [1, 2, 4])
def test_nft_ema_schedule_is_indexed_and_timed_as_diffusion_nft(decay_type, steps_per_batch):
    # The reference: per epoch, `global_step += 1` after each optimizer step, then once
    # decay = return_decay(global_step) and old <- decay·old + (1 − decay)·current.
    flat, uprate, uphold = {1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[decay_type]
    expected, global_step = [], 0
    for _ in range(120):
        global_step += steps_per_batch
        expected.append(diffusion_nft_return_decay(global_step, decay_type))
    got = [ema_decay(ema_step(v, steps_per_batch), flat, uprate, uphold) for v in range(120)]
    print(f"decay_type {decay_type}, {steps_per_batch} steps/batch, eta of batches 0..5: {got[:6]}; "
          f"first non-zero at batch {next(i for i, e in enumerate(got) if e > 0)}")
    assert got == expected
    assert got[0] == (uprate * steps_per_batch if flat == 0 else 0.0)  # the first batch already lags when flat = 0


def per_prompt_stat_tracker(prompts, rewards, global_std):
    """flow_grpo/stat_tracking.py PerPromptStatTracker.update (type "grpo", one batch), written out in float64."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    for prompt in np.unique(prompts):
        mine = rewards[prompts == prompt]
        std = (np.std(rewards) if global_std else np.std(mine)) + 1e-4
        advantages[prompts == prompt] = (mine - np.mean(mine)) / std
    return advantages


@dataclass
class Scored:
    prompt: str
    group_id: int
    reward: float
    advantage: float | None = None


@pytest.mark.parametrize("global_std", [True, False])
def test_prompt_stat_tracking_is_flow_grpos_per_prompt_tracker(global_std):
    # Two groups of prompt "a" (ids 0 and 2) in one batch share their statistics; "b" has its own.
    prompts = ["a"] * 3 + ["b"] * 3 + ["a"] * 3
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    rewards = [0.1, 0.5, 0.2, 0.9, 0.3, 0.4, 0.8, 0.7, 0.6]
    batch = [Scored(p, g, r) for p, g, r in zip(prompts, groups, rewards)]
    expected = per_prompt_stat_tracker(prompts, rewards, global_std)
    assign_advantages(batch, global_std=global_std, clip_max=5.0, stat_tracking="prompt")
    got = np.array([t.advantage for t in batch])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    assign_advantages(batch, global_std=global_std, clip_max=5.0, stat_tracking="group")
    assert np.abs(np.array([t.advantage for t in batch]) - expected).max() > 0.1  # groups 0 and 2 apart differ
    assign_advantages(batch, global_std=global_std, clip_max=5.0, stat_tracking="batch")
    r = np.array(rewards)
    np.testing.assert_allclose([t.advantage for t in batch], (r - r.mean()) / (r.std() + 1e-4), rtol=1e-5, atol=1e-5)


def diffusion_nft_r(advantages, m, adv_mode):
    """scripts/train_nft_sd3.py: clamp, then adv_mode, then r = clamp((Â / m) / 2 + ½, 0, 1)."""
    a = torch.clamp(advantages, -m, m)
    if adv_mode == "positive_only":
        a = torch.clamp(a, 0, m)
    elif adv_mode == "negative_only":
        a = torch.clamp(a, -m, 0)
    elif adv_mode == "one_only":
        a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    elif adv_mode == "binary":
        a = torch.sign(a)
    return torch.clamp((a / m) / 2.0 + 0.5, 0, 1)


@pytest.mark.parametrize("adv_mode", ["all", "positive_only", "negative_only", "one_only", "binary"])
@pytest.mark.parametrize("m", [5.0, 0.5])
def test_nft_adv_modes_are_diffusion_nfts(adv_mode, m):
    advantages = torch.tensor([-7.0, -1.5, -0.2, 0.0, 0.3, 2.0, 9.0])
    got = optimality_probability(advantages, m, adv_mode)
    torch.testing.assert_close(got, diffusion_nft_r(advantages, m, adv_mode), rtol=0, atol=1e-7)
    assert got.min() >= 0 and got.max() <= 1


@pytest.mark.parametrize("advantages, unit, kept_nonzero, total", [
    ([0.5, 0.0, -0.5, 0.0, 1.0, 0.0, 0.0, -1.0], 2, 4, 4),   # 4 with signal: already a multiple of 2
    ([0.5, 0.0, -0.5, 0.0, 1.0, 0.0, 0.0, 0.0], 2, 3, 4),    # 3 -> topped up with one zero sample
    ([0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 4, 1, 4),     # 1 -> 4
    ([0.0] * 8, 2, 0, 2),                                     # nothing to learn: one unit of zeros still trains
])
def test_flow_grpo_drops_zero_advantage_samples_up_to_a_multiple_of_the_minibatches(advantages, unit, kept_nonzero, total):
    from rayflow.learner.minibatches import trained_subset

    kept = trained_subset(advantages, unit, run_seed=0, version=3)
    assert kept == sorted(set(kept)) and len(kept) == total and total % unit == 0
    assert sum(advantages[i] != 0 for i in kept) == kept_nonzero == sum(a != 0 for a in advantages)
    assert kept == trained_subset(advantages, unit, run_seed=0, version=3)  # a pure function of (seed, version)
