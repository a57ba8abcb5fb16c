"""The FlowGRPO objective (arXiv 2505.05470): a PPO-clipped ratio per stochastic denoising step, and
GRPO-Guard's regulated clipping of it (arXiv 2510.22319)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    """Scalar to minimise: policy loss + kl_beta · kl."""
    policy: torch.Tensor
    """Scalar clipped-surrogate loss (detached)."""
    kl: torch.Tensor
    """Scalar KL to the reference (detached; 0 when not computed)."""
    clip_frac: torch.Tensor
    """Fraction of samples whose ratio left [1 − ε, 1 + ε]."""
    approx_kl: torch.Tensor
    """½·mean((logp − logp_old)²), a cheap estimate of the KL to the rollout policy."""


def _mean_over_sample(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B]."""
    return x.mean(dim=tuple(range(1, x.ndim)))


@dataclass
class RatioNorm:
    """What GRPO-Guard's ratio normalisation of one SDE step needs besides the log-probs."""

    old_mean: torch.Tensor
    """[B, ...] the transition mean μ_old under the rollout policy (recorded by the sampler)."""
    step_std: torch.Tensor
    """The step's std s·sqrt(−dt), a scalar or [B]."""
    dt: torch.Tensor
    """σ' − σ < 0, a scalar or [B]."""


def guard_log_ratio(log_ratio: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor, step_std: torch.Tensor
                    ) -> torch.Tensor:
    """GRPO-Guard's RatioNorm, [B]: (log r + b)·std with b = mean((μ_θ − μ_old)²) / (2·std²), std the
    step's std s·sqrt(−dt) and log r = log p_θ − log p_old (means over the sample, as flow_grpo's).

    With x' = μ_old + std·ε the raw log r = (2·std·mean(ε·Δμ) − mean(Δμ²)) / (2·std²), Δμ = μ_θ − μ_old:
    centred below 0 by b and scaled by 1/std, which differs step to step. The normalised one is
    mean(ε·Δμ): centred at 0 and on one scale at every step, so the clip acts alike on all of them.

    log_ratio [B]; mean, old_mean [B, ...]; step_std a scalar, [B] or [B, 1, ...].
    """
    per_sample = step_std.reshape(-1) if step_std.ndim else step_std  # a scalar or [B]
    s = per_sample.view(-1, *([1] * (mean.ndim - 1))) if step_std.ndim else step_std  # broadcastable to [B, ...]
    bias = _mean_over_sample((mean - old_mean) ** 2 / (2 * s**2))
    return (log_ratio + bias) * per_sample


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    *,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    ratio_norm: RatioNorm | None = None,
) -> PolicyLoss:
    """Loss of one trained step for a batch of samples.

    Args:
        log_prob: [B] log p_θ(x' | x) of the stored transition under the current policy.
        old_log_prob: [B] the same under the rollout policy (recorded by the sampler).
        advantages: [B].
        clip_range: ε of the ratio clip.
        mean, ref_mean: [B, ...] transition means under the current policy and the reference (base)
            model, for the KL term; std: the std the KL divides by (broadcastable; the objective picks
            flow_grpo's std_dev_t or the transition std, algorithm.kl_type).
        kl_beta: weight of KL = mean((μ_θ − μ_ref)²) / (2·std²), per sample then over the batch.
        ratio_norm: GRPO-Guard (algorithm.ratio_norm): the ratio is exp(guard_log_ratio) and the clipped
            policy loss is weighted by 1/(−dt), which evens the gradient over noise levels (its norm
            otherwise grows with the step size); needs `mean`.

    Returns the mean over samples; average over trained steps outside.
    """
    log_ratio = log_prob - old_log_prob
    clipped_log_ratio, weight = log_ratio, 1.0
    if ratio_norm is not None:
        if mean is None:
            raise ValueError("flow_grpo_loss: ratio_norm needs mean")
        clipped_log_ratio = guard_log_ratio(log_ratio, mean, ratio_norm.old_mean, ratio_norm.step_std)
        weight = 1 / -ratio_norm.dt
    ratio = torch.exp(clipped_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy = (weight * torch.maximum(unclipped, clipped)).mean()
    loss = policy
    kl = torch.zeros((), device=log_prob.device)
    if kl_beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("flow_grpo_loss: kl_beta > 0 needs mean, ref_mean and std")
        # std is a scalar or [B, 1, ...]: constant within a sample, so dividing inside the mean is exact.
        kl = _mean_over_sample(((mean - ref_mean) ** 2) / (2 * std**2)).mean()
        loss = loss + kl_beta * kl
    return PolicyLoss(
        loss=loss,
        policy=policy.detach(),
        kl=kl.detach(),
        clip_frac=((ratio - 1.0).abs() > clip_range).float().mean().detach(),
        approx_kl=(0.5 * log_ratio.detach() ** 2).mean(),
    )


def train_ema_decay(step: int, decay: float) -> float:
    """flow_grpo's train.ema decay after `step` optimizer steps (its EMAModuleWrapper.get_current_decay,
    called with the incremented global_step): min((1 + step)/(10 + step), decay), a warm-up so the
    first updates follow the trained weights closely."""
    return min((1 + step) / (10 + step), decay)
