"""The FlowGRPO objective (arXiv 2505.05470): a PPO-clipped ratio per stochastic denoising step."""

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

    Returns the mean over samples; average over trained steps outside.
    """
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy = torch.maximum(unclipped, clipped).mean()
    loss = policy
    kl = torch.zeros((), device=log_prob.device)
    if kl_beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("flow_grpo_loss: kl_beta > 0 needs mean, ref_mean and std")
        # std is a scalar or [B, 1, ...]: constant within a sample, so dividing inside the mean is exact.
        kl = (((mean - ref_mean) ** 2) / (2 * std**2)).mean(dim=tuple(range(1, mean.ndim))).mean()
        loss = loss + kl_beta * kl
    return PolicyLoss(
        loss=loss,
        policy=policy.detach(),
        kl=kl.detach(),
        clip_frac=((ratio - 1.0).abs() > clip_range).float().mean().detach(),
        approx_kl=(0.5 * log_ratio.detach() ** 2).mean(),
    )
