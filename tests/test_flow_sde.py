"""flow_step against the DESIGN §4 formulas, written out again here in float64."""

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rayflow.sampling.flow_sde import flow_step

SHAPE = (3, 16, 8)  # [B, N, C]
# (σ, σ', σ̃ used where σ = 1); float32-representable, so the float64 reference sees the same sigmas.
SIGMAS = [(1.0, 0.9, 0.9), (0.999, 0.95, None), (0.9, 0.75, None), (0.5, 0.3, None), (0.2, 0.02, None), (0.02, 0.0, None)]


def f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)  # x, v


def reference(sde_type, x, v, sigma, sigma_next, a, sigma_max=None):
    """(μ, std) of the transition, float64."""
    x, v, sigma, sigma_next = x.double(), v.double(), f32(sigma), f32(sigma_next)
    dt = sigma_next - sigma
    if sde_type == "sde":
        sigma_tilde = f32(sigma_max) if sigma == 1 else sigma
        s = a * math.sqrt(sigma / (1 - sigma_tilde))
        mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, s * math.sqrt(-dt)
    s = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    return (1 - sigma_next) * x0_hat + math.sqrt(sigma_next**2 - s**2) * x1_hat, s


def reference_log_prob(sde_type, x_next, mean, std):
    sq = (x_next.double() - mean) ** 2
    if sde_type == "sde":
        return (-sq / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))
    return (-sq).mean(dim=(1, 2))


def assert_close64(actual, expected, tol=2e-5):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual.double(), expected, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("sigma, sigma_next, sigma_max", SIGMAS)
@pytest.mark.parametrize("a", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_mean_std_and_sampling_match_formula(sde_type, sigma, sigma_next, sigma_max, a, seed):
    x, v = inputs(seed)
    mean_ref, std_ref = reference(sde_type, x, v, sigma, sigma_next, a, sigma_max)
    x_next, log_prob, mean, std = flow_step(
        v, x, sigma, sigma_next, sde_type=sde_type, noise_level=a,
        generator=torch.Generator().manual_seed(100 + seed), sigma_max=sigma_max,
    )
    assert x_next.dtype == log_prob.dtype == torch.float32 and log_prob.shape == (3,)
    assert_close64(mean, mean_ref)
    assert float(std) == pytest.approx(std_ref, rel=1e-5, abs=1e-7)
    # x' − μ = std·ε with ε from an identically seeded generator.
    eps = torch.randn(SHAPE, generator=torch.Generator().manual_seed(100 + seed))
    assert_close64(x_next - mean, std_ref * eps.double())
    assert_close64(log_prob, reference_log_prob(sde_type, x_next, mean_ref, std_ref), tol=1e-4)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("sigma, sigma_next, sigma_max", SIGMAS[:4])
def test_scoring_a_given_sample(sde_type, sigma, sigma_next, sigma_max):
    x, v = inputs(2)
    given = torch.randn(SHAPE, generator=torch.Generator().manual_seed(7))
    mean_ref, std_ref = reference(sde_type, x, v, sigma, sigma_next, 0.7, sigma_max)
    out, log_prob, _, _ = flow_step(
        v, x, sigma, sigma_next, sde_type=sde_type, noise_level=0.7, prev_sample=given, sigma_max=sigma_max
    )
    assert out is given
    assert_close64(log_prob, reference_log_prob(sde_type, given, mean_ref, std_ref), tol=1e-4)


def test_sde_log_prob_is_the_gaussian_density():
    x, v = inputs(3)
    x_next, log_prob, mean, std = flow_step(
        v, x, 0.6, 0.45, sde_type="sde", noise_level=0.7, generator=torch.Generator().manual_seed(0)
    )
    density = torch.distributions.Normal(mean.double(), float(std)).log_prob(x_next.double()).mean(dim=(1, 2))
    torch.testing.assert_close(log_prob.double(), density, rtol=0, atol=1e-5)


def test_sde_samples_have_the_stated_distribution():
    x, v = torch.zeros(20000, 4), torch.ones(20000, 4)
    x_next, log_prob, mean, std = flow_step(
        v, x, 0.6, 0.45, sde_type="sde", noise_level=0.7, generator=torch.Generator().manual_seed(0)
    )
    z = (x_next - mean) / std
    assert abs(z.mean().item()) < 0.02 and abs(z.std().item() - 1) < 0.02
    # E[log N(x'; μ, std²)] = −½ − log std − ½ log 2π (minus the entropy).
    entropy = 0.5 + math.log(float(std)) + 0.5 * math.log(2 * math.pi)
    assert log_prob.mean().item() == pytest.approx(-entropy, abs=0.01)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_per_sample_generators_make_noise_independent_of_the_batch(sde_type):
    x, v = inputs(4)
    seeds = [10, 11, 12]
    batch, _, _, _ = flow_step(
        v, x, 0.7, 0.5, sde_type=sde_type, noise_level=0.7,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
    )
    for i, seed in enumerate(seeds):
        alone, _, _, _ = flow_step(
            v[i : i + 1], x[i : i + 1], 0.7, 0.5, sde_type=sde_type, noise_level=0.7,
            generator=[torch.Generator().manual_seed(seed)],
        )
        assert torch.equal(batch[i : i + 1], alone)
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        flow_step(v, x, 0.7, 0.5, sde_type=sde_type, noise_level=0.7, generator=[torch.Generator()] * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ode_is_the_euler_step_bit_for_bit(dtype):
    x, v = inputs(5)
    v = v.to(dtype)
    sigma, sigma_next = torch.tensor(0.8), torch.tensor(0.55)  # float32, as schedules store them
    x_next, log_prob, mean, std = flow_step(v, x.to(dtype), sigma, sigma_next, sde_type="ode", noise_level=0.7)
    expected = (x.to(dtype).float() + (sigma_next - sigma) * v).to(dtype)
    assert x_next.dtype == dtype and torch.equal(x_next, expected)
    assert torch.equal(log_prob, torch.zeros(3)) and float(std) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ode_equals_diffusers_scheduler_step(dtype):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(6)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(6)).to(dtype)
    ours = x
    for i, t in enumerate(scheduler.timesteps):
        v = torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)
        x = scheduler.step(v, t, x, return_dict=False)[0]
        ours, _, _, _ = flow_step(v, ours, scheduler.sigmas[i], scheduler.sigmas[i + 1], sde_type="ode", noise_level=0.0)
        assert torch.equal(ours, x)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "ode"])
def test_per_sample_sigmas_broadcast(sde_type):
    x, v = inputs(8)
    sigma, sigma_next = torch.tensor([1.0, 0.5, 0.2]), torch.tensor([0.9, 0.3, 0.1])
    given = torch.randn(SHAPE, generator=torch.Generator().manual_seed(9))
    kwargs = dict(sde_type=sde_type, noise_level=0.7, sigma_max=0.9)
    batched = flow_step(v, x, sigma, sigma_next, prev_sample=given, **kwargs)
    for i in range(3):
        row = flow_step(v[i : i + 1], x[i : i + 1], sigma[i].item(), sigma_next[i].item(), prev_sample=given[i : i + 1], **kwargs)
        torch.testing.assert_close(batched[1][i : i + 1], row[1], rtol=1e-6, atol=1e-6)  # log_prob
        torch.testing.assert_close(batched[2][i : i + 1], row[2], rtol=1e-6, atol=1e-6)  # mean


def test_sigma_one_needs_sigma_max_and_unknown_type_raises():
    x, v = inputs(0)
    with pytest.raises(ValueError, match="sigma_max"):
        flow_step(v, x, 1.0, 0.9, sde_type="sde", noise_level=0.7, generator=torch.Generator())
    with pytest.raises(ValueError, match="sde_type: got 'ddim'"):
        flow_step(v, x, 0.5, 0.4, sde_type="ddim", noise_level=0.7, generator=torch.Generator())
