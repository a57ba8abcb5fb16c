"""DiffusionNFT (arXiv 2509.16117): negative-aware fine-tuning on the forward (noising) process,
and the EMA schedule of the "old" adapter it rolls out under."""

from __future__ import annotations

from dataclasses import dataclass

import torch


ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float, adv_mode: str = "all") -> torch.Tensor:
    """r in [0, 1] from advantages [B]: Â / (2m) + ½ with Â = clip(A, ±m) then, by DiffusionNFT's
    train.adv_mode: "all" Â; "positive_only" max(Â, 0); "negative_only" min(Â, 0); "one_only"
    1 where Â > 0 else 0; "binary" sign(Â)."""
    m = adv_clip_max
    a = advantages.clamp(-m, m)
    if adv_mode == "positive_only":
        a = a.clamp(0, m)
    elif adv_mode == "negative_only":
        a = a.clamp(-m, 0)
    elif adv_mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif adv_mode == "binary":
        a = torch.sign(a)
    elif adv_mode != "all":
        raise ValueError(f"adv_mode: got {adv_mode!r}; allowed: {list(ADV_MODES)}")
    return (a / (2 * m) + 0.5).clamp(0, 1)  # one_only/binary exceed 1 when m < 1; DiffusionNFT clamps too


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε; x0, noise [B, ...], t [B]."""
    t = t.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0 + t * noise


@dataclass
class NFTLoss:
    loss: torch.Tensor
    """Scalar to minimise: policy loss + kl_beta · kl."""
    policy: torch.Tensor
    kl: torch.Tensor


def _mean_over_sample(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim)))


def diffusion_nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    v_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> NFTLoss:
    """Loss at one timestep for a batch of samples.

    Args:
        v_theta: [B, ...] velocity of the trained policy at (x_t, t) (with grad).
        v_old: [B, ...] velocity of the old (EMA) policy, no grad.
        x0: [B, ...] the clean sample (the rollout's final latent); x_t: [B, ...]; t: [B] sigmas.
        r: [B] optimality probability (optimality_probability of the advantages).
        beta: mixing coefficient between the old and the current policy.
        v_ref, kl_beta: velocity of the base model and the weight of kl = mean((v_θ − v_ref)²).

    Returns the mean over samples; average over timesteps outside.
    """
    t = t.view(-1, *([1] * (x0.ndim - 1))).to(torch.float32)
    v_theta, v_old = v_theta.float(), v_old.float()
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    x0_pos = x_t - t * v_pos
    x0_neg = x_t - t * v_neg
    # Adaptive weights: per-sample mean absolute x0 error, detached and floored.
    w_pos = _mean_over_sample((x0_pos - x0).abs()).detach().clamp(min=1e-5)
    w_neg = _mean_over_sample((x0_neg - x0).abs()).detach().clamp(min=1e-5)
    pos = _mean_over_sample((x0_pos - x0) ** 2) / w_pos
    neg = _mean_over_sample((x0_neg - x0) ** 2) / w_neg
    policy = (adv_clip_max * (r * pos + (1 - r) * neg) / beta).mean()
    loss = policy
    kl = torch.zeros((), device=x0.device)
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("diffusion_nft_loss: kl_beta > 0 needs v_ref")
        kl = _mean_over_sample((v_theta - v_ref.float()) ** 2).mean()
        loss = loss + kl_beta * kl
    return NFTLoss(loss=loss, policy=policy.detach(), kl=kl.detach())


def ema_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """η of the "old" adapter's EMA after `step` optimizer steps: 0 until `flat`, then growing by
    `uprate` per step up to `uphold` (DiffusionNFT's return_decay; its decay_type 1 is (0, 0.001, 0.5),
    2 is (75, 0.0075, 0.999)). η = 0 makes old a copy of the current policy."""
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def ema_step(version: int, steps_per_batch: int) -> int:
    """The step η is evaluated at when batch `version` (0-based) has been trained: the optimizer steps
    applied so far, this batch's included — DiffusionNFT's global_step at its once-per-epoch
    return_decay call, which follows the epoch's `global_step += 1`s."""
    return (version + 1) * steps_per_batch


@torch.no_grad()
def ema_update(old: list[torch.Tensor], current: list[torch.Tensor], eta: float) -> None:
    """old ← η·old + (1 − η)·current, in place."""
    for o, c in zip(old, current, strict=True):
        o.mul_(eta).add_(c.detach().to(o.dtype), alpha=1 - eta)
