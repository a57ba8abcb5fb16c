import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

from rayflow.cfg.policy import TrueCFG
from rayflow.models import load_model, model_class, pipeline_class_of, registered_pipeline_classes
from rayflow.models.qwen_image import QwenImageModel
from rayflow.models.tiny import save_tiny_model
from rayflow.sampling.denoise import generate
from rayflow.types import RolloutRequest, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHAT_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]


def run_pipeline(pipe, seed, height=64, width=64, steps=8, output_type="latent", **kwargs):
    return pipe(
        "a red apple", height=height, width=width, num_inference_steps=steps, true_cfg_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kwargs,
    ).images


def test_tiny_model_loads_with_diffusers(tiny_model_dir, tiny_pipeline):
    assert isinstance(tiny_pipeline, QwenImagePipeline)
    assert type(tiny_pipeline.transformer).__name__ == "QwenImageTransformer2DModel"
    assert type(tiny_pipeline.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    with open(f"{tiny_model_dir}/rayflow_tiny.json") as f:
        assert json.load(f)["seed"] == 0


def test_same_seed_same_weights_other_seed_different(tiny_pipeline, tmp_path):
    again = QwenImagePipeline.from_pretrained(save_tiny_model(str(tmp_path / "seed0"), seed=0))
    other = QwenImagePipeline.from_pretrained(save_tiny_model(str(tmp_path / "seed1"), seed=1))
    for name in ("transformer", "vae", "text_encoder"):
        ref, same = getattr(tiny_pipeline, name).state_dict(), getattr(again, name).state_dict()
        assert ref.keys() == same.keys() and all(torch.equal(ref[k], same[k]) for k in ref), name
    assert tiny_pipeline.tokenizer.get_vocab() == again.tokenizer.get_vocab()
    ref, diff = tiny_pipeline.transformer.state_dict(), other.transformer.state_dict()
    for key in ("img_in.weight", "transformer_blocks.0.attn.to_q.weight", "proj_out.weight"):
        assert not torch.equal(ref[key], diff[key]), key


def test_tokenizer_knows_chat_tokens_and_template(tiny_pipeline):
    tok = tiny_pipeline.tokenizer
    for token in CHAT_TOKENS:
        (token_id,) = tok(token, add_special_tokens=False)["input_ids"]
        assert tok.convert_ids_to_tokens(token_id) == token
    ids = tok("<|im_start|>user\na red apple<|im_end|>")["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    # The pipeline drops the first `prompt_template_encode_start_idx` tokens: exactly the template prefix.
    template, drop = tiny_pipeline.prompt_template_encode, tiny_pipeline.prompt_template_encode_start_idx
    prefix_ids = tok(template.split("{}")[0])["input_ids"]
    full_ids = tok(template.format("a red apple"))["input_ids"]
    assert len(prefix_ids) == drop and full_ids[:drop] == prefix_ids
    embeds, _ = tiny_pipeline.encode_prompt("a red apple", device="cpu")
    assert embeds.shape[1] == len(full_ids) - drop


def test_registry_lists_every_family_in_a_fresh_process():
    code = "from rayflow.models import registered_pipeline_classes as r; print(r())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['FluxPipeline', 'QwenImagePipeline', 'StableDiffusion3Pipeline']"


def test_registry_resolves_and_rejects(tiny_model_dir, tmp_path):
    assert pipeline_class_of(tiny_model_dir) == "QwenImagePipeline"
    assert model_class("QwenImagePipeline") is QwenImageModel
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no model_index.json"):
        load_model(str(tmp_path / "empty"))
    (tmp_path / "sdxl").mkdir()
    (tmp_path / "sdxl" / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    supported = r"\['FluxPipeline', 'QwenImagePipeline', 'StableDiffusion3Pipeline'\]"
    with pytest.raises(ValueError, match=rf"'StableDiffusionXLPipeline' is not registered.*{supported}"):
        load_model(str(tmp_path / "sdxl"))
    assert "QwenImagePipeline" in registered_pipeline_classes()
    # A model_index.json that is not an object, or whose class name is not a string, is named with the file (a
    # TypeError naming nothing escaped before).
    for name, text in (("list", "[]"), ("pair", '{"_class_name": ["diffusers", "X"]}'), ("none", "{}")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(text)
        with pytest.raises(ValueError, match=rf"model\.path: .*{name}/model_index\.json is not a valid model_index\.json"):
            load_model(str(tmp_path / name))


def test_a_model_directory_without_model_index_is_named_before_the_run(tmp_path, monkeypatch):
    from rayflow.config import load_config
    from rayflow.runs import preflight

    # load_config lets it through (the directory may exist only on a cluster's workers); a local run's preflight not.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    empty = str(tmp_path / "not_a_pipeline")
    os.makedirs(empty)
    cfg = load_config(os.path.join(REPO, "recipes", "flowgrpo_tiny.yaml"), [f"model.path={empty}"])
    with pytest.raises(ValueError, match=re.escape(f"model.path: {empty!r} has no model_index.json")):
        preflight(cfg)


@pytest.mark.parametrize("height, width", [(64, 64), (128, 64)])
def test_prepare_latents_match_pipeline_and_generators_continue(tiny_model, tiny_pipeline, height, width):
    seeds = [3, 0, 11]
    latents, generators = tiny_model.prepare_latents(seeds, height, width)
    channels = tiny_pipeline.transformer.config.in_channels // 4
    for i, seed in enumerate(seeds):
        expected = tiny_pipeline.prepare_latents(
            1, channels, height, width, torch.float32, "cpu", torch.Generator("cpu").manual_seed(seed)
        )
        assert torch.equal(latents[i : i + 1], expected)
        # The generator continues the seed's stream after the initial draw.
        fresh = torch.Generator("cpu").manual_seed(seed)
        torch.randn((1, 1, channels, 2 * (height // 16), 2 * (width // 16)), generator=fresh)
        next_draw = torch.randn(latents[i].shape, generator=generators[i])
        assert torch.equal(next_draw, torch.randn(latents[i].shape, generator=fresh))
        assert not torch.equal(next_draw, latents[i])


@pytest.mark.parametrize("steps, height, width", [(8, 64, 64), (4, 128, 64), (3, 128, 128)])
def test_schedule_matches_pipeline(tiny_model, tiny_pipeline, steps, height, width):
    seen = []

    def record(pipe, i, t, kwargs):
        seen.append(t.clone())
        return {}

    run_pipeline(tiny_pipeline, 0, height, width, steps, callback_on_step_end=record)
    schedule = tiny_model.schedule(steps, height, width)
    assert torch.equal(schedule.timesteps, torch.stack(seen))
    assert torch.equal(schedule.sigmas, tiny_pipeline.scheduler.sigmas)
    assert schedule.sigmas.dtype == torch.float32 and schedule.sigmas[0] == 1 and schedule.sigmas[-1] == 0


def test_schedule_static_shift(tiny_model, tiny_pipeline):
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        tiny_pipeline.scheduler.config, use_dynamic_shifting=False, shift=3.0
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 6, 6))
    schedule = tiny_model.schedule(6, 64, 64, shift=3.0)
    torch.testing.assert_close(schedule.sigmas, scheduler.sigmas, rtol=0, atol=1e-6)
    torch.testing.assert_close(schedule.timesteps, scheduler.timesteps, rtol=0, atol=1e-3)


def test_a_schedule_that_does_not_fall_from_1_to_0_is_refused_naming_the_keys(tiny_model, tiny_twin):
    """One step under Qwen-Image's shift_terminal stretch divides by 0 (sigmas [nan, 0]); it sampled NaN trajectories
    and trained NaN steps. A static shift whose first sigma rounds to 1 ± 6e-7 in float32 (SD3, shift 0.2) is set to
    exactly 1, where the SDE's sigma-tilde rule and DPM-Solver need it (1.0000006 was the square root of a negative
    number; 0.99999982 a noise 1800 times too large)."""
    from rayflow.models import load_model
    from rayflow.sampling.flow_sde import sde_std_dev

    with pytest.raises(ValueError, match=r"^sampling\.num_steps / sampling\.shift .*the sigmas \[nan, 0\.0\] for 1 "
                                         r"steps; allowed: .*fall from 1 to 0"):
        tiny_model.schedule(1, 64, 64)
    sd3 = load_model(tiny_twin("sd3"))
    for shift in (0.2, 0.35):
        sigmas = sd3.schedule(4, 64, 64, shift=shift).sigmas
        assert sigmas[0] == 1 and torch.isfinite(sde_std_dev(sigmas[:-1], 0.7, sigmas[1])).all()
        s = float(sde_std_dev(sigmas[:1], 0.7, sigmas[1]))
        assert s == pytest.approx(0.7 * (1 / (1 - float(sigmas[1]))) ** 0.5)  # README: a·sqrt(σ / (1 − σ_max))


@pytest.mark.parametrize("height, width, bad", [(60, 64, "height"), (64, 72, "width"), (0, 64, "height")])
def test_check_size(tiny_model, height, width, bad):
    tiny_model.check_size(64, 128)
    value = height if bad == "height" else width
    with pytest.raises(ValueError, match=rf"sampling.{bad}: got {value}; allowed: a positive multiple of 16"):
        tiny_model.check_size(height, width)


def test_decode_matches_pipeline_image(tiny_model, tiny_pipeline):
    def both(output_type):
        return tiny_pipeline(
            ["a red apple"] * 2, height=64, width=64, num_inference_steps=4, true_cfg_scale=1.0,
            generator=[torch.Generator("cpu").manual_seed(s) for s in (0, 1)], output_type=output_type,
        ).images

    images = tiny_model.decode(both("latent"), 64, 64)
    expected = torch.from_numpy((both("np") * 255).round().astype(np.uint8))
    assert images.dtype == torch.uint8 and images.shape == (2, 64, 64, 3)
    assert torch.equal(images, expected)


@pytest.fixture(scope="module")
def bf16_model(tiny_model_dir):
    return load_model(tiny_model_dir, dtype=torch.bfloat16)


def test_bf16_velocity_depends_on_latents_only_in_model_dtype(bf16_model):
    # A rollout holds bf16 latents after ODE steps and float32 after SDE steps; the learner replays
    # from float32 captures. The velocity must be the same function of the latents either way.
    latents, _ = bf16_model.prepare_latents([0], 64, 64)
    cond = bf16_model.encode_prompt(["a red apple"])
    for t in bf16_model.schedule(8, 64, 64).timesteps:
        v_bf16 = bf16_model.predict_velocity(latents, t, cond, 64, 64)
        v_fp32 = bf16_model.predict_velocity(latents.float(), t, cond, 64, 64)
        assert torch.equal(v_bf16, v_fp32), float(t)


def test_bf16_generation_matches_pipeline(bf16_model, tiny_model_dir):
    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(
        "a red apple", negative_prompt=" ", true_cfg_scale=4.0, height=64, width=64, num_inference_steps=8,
        generator=torch.Generator("cpu").manual_seed(0), output_type="latent",
    ).images
    request = RolloutRequest("r", ["a red apple"], [0], [0], [0], SamplingParams(sde_type="ode"))
    (traj,) = generate(bf16_model, request, TrueCFG())
    assert torch.equal(traj.latent(8), expected[0].float())
