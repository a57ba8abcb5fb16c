"""One denoising step of a flow-matching model: ODE (Euler), SDE (Flow-GRPO) or CPS, with log-probs.

Notation (DESIGN §4): x the current latent, v the model's velocity, σ the current sigma, σ' the
next (smaller) one, dt = σ' − σ < 0, a = noise_level, ε ~ N(0, I).

Sigmas are passed explicitly (no hidden step counter), so the learner can re-evaluate any step
of a stored trajectory: pass `prev_sample` and get that sample's log-prob under the new v.
"""

from __future__ import annotations

import math

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)

Generators = torch.Generator | list[torch.Generator] | None


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] sigma as a float32 tensor broadcastable against `like` [B, ...]."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        return t
    return t.view(-1, *([1] * (like.ndim - 1)))


def draw_noise(shape: torch.Size, generator: Generators, device: torch.device) -> torch.Tensor:
    """ε of `shape` [B, ...] in float32. With a list of generators, sample i is drawn from generator i
    alone, so a sample's noise does not depend on which other samples share its batch."""
    if isinstance(generator, list):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {shape[0]}")
        noise = [torch.randn((1, *shape[1:]), generator=g, dtype=torch.float32) for g in generator]
        return torch.cat(noise).to(device)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)


def _mean_over_sample(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B]: the mean over every non-batch dim."""
    return x.mean(dim=tuple(range(1, x.ndim)))


def sde_std_dev(sigma: torch.Tensor, noise_level: float, sigma_max: float | torch.Tensor | None) -> torch.Tensor:
    """Flow-GRPO's s = a·sqrt(σ / (1 − σ̃)), σ̃ = σ_max where σ = 1 (σ/(1−σ) is infinite there), else σ:
    the SDE's diffusion coefficient, flow_grpo's `std_dev_t` (the step's std is s·sqrt(−dt))."""
    if sigma_max is None and bool((sigma == 1).any()):
        raise ValueError("flow_step: sigma == 1 needs sigma_max (the schedule's sigmas[1]) for sde_type='sde'")
    sigma_tilde = sigma if sigma_max is None else torch.where(sigma == 1, _per_sample(sigma_max, sigma), sigma)
    return noise_level * torch.sqrt(sigma / (1 - sigma_tilde))


def flow_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    sde_type: str,
    noise_level: float,
    generator: Generators = None,
    prev_sample: torch.Tensor | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Take one step from σ to σ', or score a given next sample.

    Args:
        model_output: v, [B, ...] in any float dtype.
        sample: x, [B, ...].
        sigma, sigma_next: σ and σ' as scalars or [B] tensors (σ' < σ).
        sde_type: "ode", "sde" or "cps".
        noise_level: a; for "cps", in [0, 1].
        generator: a torch.Generator or one per sample, for ε (unused with `prev_sample` or "ode").
        prev_sample: a stored x' to score instead of sampling a new one (the learner's re-evaluation).
        sigma_max: σ̃ used by "sde" where σ = 1 (where σ/(1−σ) is infinite); the schedule's sigmas[1].

    Returns:
        prev_sample: x', [B, ...]. For "ode" in model_output's dtype, exactly as diffusers'
            FlowMatchEulerDiscreteScheduler.step; otherwise float32.
        log_prob: [B] float32, the mean over non-batch dims of log N(x'; μ, std²); zeros for "ode".
        mean: μ, [B, ...] float32 (x' itself for "ode").
        std: the transition std, broadcastable to [B, ...] (s·sqrt(−dt) for "sde", s for "cps", 0 for "ode").
    """
    x = sample.to(torch.float32)
    sigma_t = _per_sample(sigma, x)
    sigma_next_t = _per_sample(sigma_next, x)
    dt = sigma_next_t - sigma_t

    if sde_type == "ode":
        # Same dtype handling as FlowMatchEulerDiscreteScheduler.step: fp32 sample, cast back at the end.
        mean = x + dt * model_output
        zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        new = mean.to(model_output.dtype) if prev_sample is None else prev_sample
        return new, zeros, mean.float(), torch.zeros_like(sigma_t)

    v = model_output.to(torch.float32)
    if sde_type == "sde":
        s = sde_std_dev(sigma_t, noise_level, sigma_max)
        mean = x * (1 + s**2 / (2 * sigma_t) * dt) + v * (1 + s**2 * (1 - sigma_t) / (2 * sigma_t)) * dt
        std = s * torch.sqrt(-dt)
    elif sde_type == "cps":
        s = sigma_next_t * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sigma_t * v
        x1_hat = x + (1 - sigma_t) * v
        mean = (1 - sigma_next_t) * x0_hat + torch.sqrt(sigma_next_t**2 - s**2) * x1_hat
        std = s
    else:
        raise ValueError(f"sde_type: got {sde_type!r}; allowed: 'ode', 'sde', 'cps'")

    if prev_sample is None:
        prev_sample = mean + std * draw_noise(x.shape, generator, x.device)
    target = prev_sample.detach().to(torch.float32)
    if sde_type == "sde":
        log_prob = -((target - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    else:
        # CPS drops the constants (and the std, which does not depend on the policy).
        log_prob = -((target - mean) ** 2)
    return prev_sample, _mean_over_sample(log_prob), mean, std
