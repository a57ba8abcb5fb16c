"""SD3 and FLUX.1: rayflow's ODE generation equals diffusers' own pipelines on the tiny offline twins."""

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusion3Pipeline

from rayflow.cfg.policy import CFGPolicy, EmbeddedGuidance
from rayflow.models import load_model
from rayflow.sampling.denoise import generate
from rayflow.types import RolloutRequest, SamplingParams

PROMPTS = ["a red apple", "a blue car"]
SEEDS = [3, 0]
SIZE, STEPS = 32, 4


def oracle(pipe_cls, path: str, **kwargs) -> torch.Tensor:
    pipe = pipe_cls.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    generators = [torch.Generator("cpu").manual_seed(s) for s in SEEDS]
    return pipe(PROMPTS, height=SIZE, width=SIZE, num_inference_steps=STEPS, generator=generators,
                output_type="latent", **kwargs).images


def rayflow_final_latents(path: str, policy: CFGPolicy, scale: float) -> tuple[torch.Tensor, object]:
    model = load_model(path)
    params = SamplingParams(height=SIZE, width=SIZE, num_steps=STEPS, guidance_scale=scale, negative_prompt="",
                            sde_type="ode")
    request = RolloutRequest("r", PROMPTS, [0, 1], [0, 1], SEEDS, params)
    trajectories = generate(model, request, policy)
    return torch.stack([t.latents[-1] for t in trajectories]), model


def test_sd3_generation_equals_pipeline(tiny_twin):
    path = tiny_twin("sd3")
    expected = oracle(StableDiffusion3Pipeline, path, guidance_scale=4.5)  # [B, C, h, w]; negative prompt ""
    got, model = rayflow_final_latents(path, CFGPolicy(), 4.5)
    assert type(model).__name__ == "SD3Model"
    # The scheduler's own static shift (3.0 in the twin, as SD3.5's) made the sigmas.
    assert model.pipe.scheduler.config.shift == 3.0
    torch.testing.assert_close(got, expected.flatten(2).transpose(1, 2), rtol=0, atol=1e-5)
    assert not torch.allclose(got[0], got[1], atol=1e-2)


@pytest.mark.parametrize("policy, scale, pipe_kwargs", [
    # FLUX.1-dev's guidance-distilled path: one branch, the scale goes into the guidance embedding.
    (EmbeddedGuidance(), 3.5, dict(guidance_scale=3.5)),
    # FluxPipeline's true_cfg_scale path: two branches, embedded guidance at the pipeline default 3.5.
    (CFGPolicy(), 4.0, dict(true_cfg_scale=4.0, negative_prompt="")),
])
def test_flux_generation_equals_pipeline(tiny_twin, policy, scale, pipe_kwargs):
    path = tiny_twin("flux")
    expected = oracle(FluxPipeline, path, **pipe_kwargs)  # packed [B, N, 4C]
    got, model = rayflow_final_latents(path, policy, scale)
    assert model.pipe.scheduler.config.use_dynamic_shifting
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_flux_mu_from_image_sequence_length(tiny_twin):
    """sigma' = e^mu / (e^mu + 1/sigma - 1) (exponential time shift), mu linear in the packed token count."""
    model = load_model(tiny_twin("flux"))
    config = model.pipe.scheduler.config
    for size in (32, 64):
        tokens = (size // 16) ** 2
        slope = (config.max_shift - config.base_shift) / (config.max_image_seq_len - config.base_image_seq_len)
        mu = tokens * slope + config.base_shift - slope * config.base_image_seq_len
        sigmas = torch.linspace(1.0, 1 / STEPS, STEPS, dtype=torch.float64)
        shifted = torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + (1 / sigmas - 1))
        schedule = model.schedule(STEPS, size, size)
        torch.testing.assert_close(schedule.sigmas[:-1].double(), shifted, rtol=0, atol=1e-6)
        assert schedule.sigmas[-1] == 0


def test_tiny_arch_and_size_are_checked_before_anything_starts():
    from rayflow.config import load_config
    from rayflow.errors import ConfigError
    from rayflow.paths import recipe

    with pytest.raises(ConfigError, match=r"model\.tiny_arch.*'sdxl'.*\['qwen_image', 'sd3', 'flux'\]"):
        load_config(recipe("flowgrpo_sd3.yaml"), ["model.tiny_arch=sdxl"])
    with pytest.raises(ConfigError, match=r"model\.tiny_size.*'small'.*\['tiny'\] for tiny_arch=flux"):
        load_config(recipe("flowgrpo_flux.yaml"), ["model.tiny_size=small"])
    # The size multiple comes from the tiny twin's family before any model is built.
    with pytest.raises(ConfigError, match=r"sampling\.height.*40.*multiple of 16.*StableDiffusion3Pipeline"):
        load_config(recipe("flowgrpo_sd3.yaml"), ["sampling.height=40"])


def test_flux_embedded_guidance_reaches_the_transformer(tiny_twin):
    """The embedded policy's scale is the transformer's guidance input, in its branch and in the arguments
    DiffusionNFT adds to its conditional velocity; without one, FluxPipeline's default 3.5 applies."""
    model = load_model(tiny_twin("flux"))
    cond = model.encode_prompt(["a red apple"])
    x, _ = model.prepare_latents([0], SIZE, SIZE)
    t = model.schedule(STEPS, SIZE, SIZE).timesteps[1]
    policy = EmbeddedGuidance()
    (branch,) = policy.build({"positive": cond}, 2.0)
    assert branch.kwargs == {"cond": cond, **policy.conditional_kwargs(2.0)} and policy.conditional_kwargs(2.0) == {"guidance": 2.0}
    assert CFGPolicy().conditional_kwargs(2.0) == {}
    with torch.no_grad():
        v2 = model.predict_velocity(x, t, height=SIZE, width=SIZE, **branch.kwargs)
        v_default = model.predict_velocity(x, t, cond, SIZE, SIZE)
        v35 = model.predict_velocity(x, t, cond, SIZE, SIZE, guidance=3.5)
    assert torch.equal(v_default, v35) and not torch.allclose(v2, v35, atol=1e-4)
