"""dpm2_step against diffusers' own flow-matching DPM-Solver++(2M), stepped with the same velocity
function over the same sigmas, and the sampler's use of it (sampling.solver=dpm2)."""

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from rayflow.errors import ConfigError
from rayflow.sampling.dpm_solver import dpm2_step
from rayflow.types import SamplingParams

SHAPE = (2, 16, 8)  # [B, N, C]


def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """A smooth, x- and σ-dependent stand-in for a transformer (so a second-order step differs from Euler)."""
    return torch.tanh(x) * (1 + sigma) - 0.3 * x * sigma**2


def diffusers_run(sigmas: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True, prediction_type="flow_prediction", solver_order=2, algorithm_type="dpmsolver++",
        solver_type="midpoint", lower_order_final=True, final_sigmas_type="zero",
    )
    T = len(sigmas) - 1
    scheduler.set_timesteps(T)
    scheduler.sigmas = sigmas.clone()  # the same sigmas as rayflow's (its own are only shifted differently)
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, float(sigmas[i])), t, x).prev_sample
    return x


def rayflow_run(sigmas: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dpm2 sample, the Euler sample) over `sigmas`."""
    euler, x0 = x, None
    for i in range(len(sigmas) - 1):
        x, x0 = dpm2_step(velocity(x, float(sigmas[i])), x, sigmas[i], sigmas[i + 1],
                          sigma_prev=sigmas[i - 1] if i else None, x0_prev=x0)
        euler = euler + (sigmas[i + 1] - sigmas[i]) * velocity(euler, float(sigmas[i]))
    return x, euler


@pytest.mark.parametrize("sigmas", [
    [1.0, 0.9, 0.75, 0.5, 0.25, 0.0],       # starts at pure noise (Qwen-Image's schedules): step 1 is first-order too
    [0.97, 0.85, 0.6, 0.4, 0.2, 0.05, 0.0],  # every middle step second-order
])
def test_dpm2_equals_diffusers_flow_dpm_solver_pp_2m(sigmas):
    sigmas = torch.tensor(sigmas, dtype=torch.float32)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    ours, euler = rayflow_run(sigmas, x)
    theirs = diffusers_run(sigmas, x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (ours - euler).abs().max() > 1e-3  # a second-order solver, not Euler again


def test_dpm2_first_step_is_euler_and_last_step_lands_on_x0():
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    v = velocity(x, 0.8)
    first, x0 = dpm2_step(v, x, 0.8, 0.5)
    torch.testing.assert_close(first, x + (0.5 - 0.8) * v)  # DPM-Solver++ first order = DDIM = Euler for flows
    torch.testing.assert_close(x0, x - 0.8 * v)
    last, _ = dpm2_step(v, x, 0.8, 0.0, sigma_prev=0.9, x0_prev=torch.zeros_like(x))
    torch.testing.assert_close(last, x - 0.8 * v, rtol=0, atol=0)


def test_dpm2_is_refused_with_stochastic_steps():
    with pytest.raises(ConfigError, match="sampling.solver"):
        SamplingParams(sde_type="sde", solver="dpm2").validate()
    with pytest.raises(ConfigError, match="sampling.solver"):
        SamplingParams(sde_type="ode", solver="heun").validate()
    SamplingParams(sde_type="ode", solver="dpm2").validate()
