"""A deterministic second-order step for flow-matching ODE rollouts: DPM-Solver++(2M) in its
data-prediction form (Lu et al. 2022, arXiv 2211.01095), as DiffusionNFT rolls out.

For a flow-matching model x_σ = (1 − σ)·x0 + σ·ε, so α = 1 − σ, the noise scale is σ, the data
prediction is x0 = x − σ·v and the half log-SNR is λ(σ) = log(1 − σ) − log σ. One step from σ to σ'
with h = λ(σ') − λ(σ):

    first order:   x' = (σ'/σ)·x − (1 − σ')·(e^(−h) − 1)·x0              (= the Euler step)
    second order:  x' = first order − ½·(1 − σ')·(e^(−h) − 1)·D1,
                   D1 = (x0 − x0_prev) / r,  r = (λ(σ) − λ(σ_prev)) / h     (the "midpoint" variant)

diffusers' DPMSolverMultistepScheduler (use_flow_sigmas, prediction_type="flow_prediction",
solver_order=2, algorithm_type="dpmsolver++", final_sigmas_type="zero") takes the first step and the
step to σ' = 0 first-order; so does `dpm2_step` when given no x0_prev, or σ' = 0 (x' = x0 there).
Sigmas are explicit, as in flow_sde: no hidden step counter.
"""

from __future__ import annotations

import torch


def _half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """λ(σ) = log(1 − σ) − log σ: −inf at σ = 1 (pure noise), +inf at σ = 0."""
    return torch.log(1 - sigma) - torch.log(sigma)


def dpm2_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    sigma_prev: float | torch.Tensor | None = None,
    x0_prev: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DPM-Solver++(2M) step of a flow-matching ODE from σ to σ' (scalars, σ' < σ).

    Args:
        model_output: v, [B, ...] in any float dtype.
        sample: x, [B, ...].
        sigma_prev, x0_prev: σ and x0 of the previous step; None for the first step (first order).

    Returns:
        prev_sample: x', [B, ...] in model_output's dtype (fp32 inside, as diffusers' step).
        x0: the data prediction x − σ·v, [B, ...] float32: the next step's x0_prev.
    """
    x = sample.to(torch.float32)
    s, s_next = (torch.as_tensor(t, dtype=torch.float32, device=x.device) for t in (sigma, sigma_next))
    x0 = x - s * model_output.to(torch.float32)
    lam, lam_next = _half_log_snr(s), _half_log_snr(s_next)
    h = lam_next - lam
    # At σ' = 0, h = +inf and e^(−h) = 0: x' = x0 exactly, the first-order step diffusers takes there.
    coeff = (1 - s_next) * (torch.exp(-h) - 1)
    prev = (s_next / s) * x - coeff * x0
    if x0_prev is not None and float(s_next) > 0:
        r = (lam - _half_log_snr(torch.as_tensor(sigma_prev, dtype=torch.float32, device=x.device))) / h
        # σ_prev = 1 gives r = inf and D1 = 0: the step stays first-order, as in diffusers.
        prev = prev - 0.5 * coeff * (x0 - x0_prev) / r
    return prev.to(model_output.dtype), x0
