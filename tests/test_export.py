"""tools/export_lora.py: a trained adapter in diffusers' LoRA format, loaded by diffusers' own
QwenImagePipeline.load_lora_weights and by tools/generate.py --lora."""

import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from safetensors.torch import load_file

from rayflow import reference
from rayflow.checkpoint import latest_checkpoint, load_adapter
from rayflow.cfg.policy import make_policy
from rayflow.models.tiny import save_tiny_model
from rayflow.models.weight_sets import using_weights
from rayflow.sampling.denoise import generate
from rayflow.types import RolloutRequest, SamplingParams
from tiny_run import GRPO, NFT, small_cfg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, SEED, STEPS, SIZE = "a red apple", 7, 4, 32


def load_generate_tool():
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(REPO, "tools", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export_main(argv):
    spec = importlib.util.spec_from_file_location("export_lora_tool", os.path.join(REPO, "tools", "export_lora.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)


def train_briefly(recipe, model_dir, out, *overrides):
    """Two steps at a high lr with alpha = 2 x rank (so a loader that ignored alpha would differ), and a
    fast EMA so DiffusionNFT's "old" differs from "default"."""
    fast_ema = ("algorithm.ema_uprate=0.5",) if recipe == NFT else ()
    cfg = small_cfg(recipe, model_dir, out, "trainer.total_steps=2", "learner.lr=0.05", "learner.lora_alpha=16",
                    *fast_ema, *overrides)
    model, _ = reference.train(cfg, log=lambda msg: None)
    return model, latest_checkpoint(os.path.join(out, "checkpoints"))


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """train_briefly(recipe, *overrides), run once per module for each recipe and overrides (deterministic runs,
    whose model and checkpoint the tests only read)."""
    runs = {}

    def get(recipe, *overrides):
        if (recipe, overrides) not in runs:
            runs[recipe, overrides] = train_briefly(recipe, tiny_model_dir, str(tmp_path_factory.mktemp("run")), *overrides)
        return runs[recipe, overrides]

    return get


def rayflow_latents(model, adapter):
    params = SamplingParams(height=SIZE, width=SIZE, num_steps=STEPS, guidance_scale=4.0, negative_prompt=" ",
                            sde_type="ode", return_step_indices=[STEPS])
    with using_weights(model.transformer, adapter):
        (t,) = generate(model, RolloutRequest("x", [PROMPT], [0], [0], [SEED], params), make_policy("true_cfg"))
    return t.latent(STEPS).unsqueeze(0), t.image


def pipeline_latents(pipe):
    def run(output_type):
        return pipe(PROMPT, negative_prompt=" ", true_cfg_scale=4.0, height=SIZE, width=SIZE, num_inference_steps=STEPS,
                    generator=torch.Generator("cpu").manual_seed(SEED), output_type=output_type).images
    return run("latent"), torch.from_numpy((run("np")[0] * 255).round().astype(np.uint8))


@pytest.mark.parametrize("recipe, adapter", [(GRPO, "default"), (NFT, "old"), (GRPO, "ema")])
def test_exported_lora_loads_in_diffusers_and_samples_as_rayflow_does(tiny_model_dir, tiny_pipeline, trained, tmp_path, recipe,
                                                                      adapter):
    model, ckpt = trained(recipe, *["trainer.ema_decay=0.9"] * (adapter == "ema"))
    out = str(tmp_path / "lora")
    export_main([ckpt, "--out", out, "--adapter", adapter])

    saved = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    expected = load_adapter(ckpt, adapter)
    assert saved.keys() == {f"transformer.{k}" for k in expected}
    assert all(torch.equal(saved[f"transformer.{k}"], v) for k, v in expected.items())
    if adapter != "default":  # an EMA of the trained adapter, not a copy of it
        assert any(not torch.equal(v, load_adapter(ckpt, "default")[k]) for k, v in expected.items())

    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(out)
    lora_latents, lora_image = pipeline_latents(pipe)
    base_latents, base_image = pipeline_latents(tiny_pipeline)
    ours_latents, ours_image = rayflow_latents(model, adapter)
    torch.testing.assert_close(lora_latents, ours_latents, rtol=0, atol=1e-5)
    assert (lora_latents - base_latents).abs().max() > 1e-2 and not torch.equal(lora_image, base_image)
    assert (ours_image.int() - lora_image.int()).abs().max() <= 1


def test_exported_full_transformer_loads_in_diffusers_and_samples_as_rayflow_does(tiny_model_dir, tiny_pipeline, tmp_path):
    """learner.train_mode=full: DiffusionNFT's "old" weights (an EMA, not the trained weights) exported as a transformer
    directory that diffusers' from_pretrained loads and QwenImagePipeline samples with, as rayflow samples under them."""
    from diffusers import QwenImageTransformer2DModel

    from rayflow.learner.sharded import read_weights

    cfg = small_cfg(NFT, tiny_model_dir, tmp_path / "run", "trainer.total_steps=2", "learner.lr=0.003",
                    "algorithm.ema_uprate=0.5", "learner.train_mode=full", "sync.mode=merged")
    model, _ = reference.train(cfg, log=lambda msg: None)
    ckpt, out = latest_checkpoint(str(tmp_path / "run" / "checkpoints")), str(tmp_path / "transformer")
    export_main([ckpt, "--out", out, "--adapter", "old"])

    transformer = QwenImageTransformer2DModel.from_pretrained(out)
    saved, trained = (read_weights(os.path.join(ckpt, "weights"), name) for name in ("old", "default"))
    exported = transformer.state_dict()
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], v) for k, v in saved.items())
    assert any(not torch.equal(v, trained[k]) for k, v in saved.items())  # the EMA, not a copy of the trained weights
    pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    full_latents, full_image = pipeline_latents(pipe)
    base_latents, base_image = pipeline_latents(tiny_pipeline)
    ours_latents, ours_image = rayflow_latents(model, "old")
    torch.testing.assert_close(full_latents, ours_latents, rtol=0, atol=1e-5)
    assert (full_latents - base_latents).abs().max() > 1e-2 and not torch.equal(full_image, base_image)
    assert (ours_image.int() - full_image.int()).abs().max() <= 1
    with pytest.raises(SystemExit, match="is a full fine-tuning checkpoint .*it has no LoRA"):  # not a LoRA to sample under
        load_generate_tool().main(["--model", tiny_model_dir, "--prompt", PROMPT, "--out", str(tmp_path / "x.png"), "--lora", ckpt])


@pytest.mark.parametrize("recipe, overrides, expected", [
    (GRPO, (), "default"), (NFT, (), "default"), (GRPO, ("trainer.ema_decay=0.9",), "ema"),
], ids=["flow_grpo", "nft-without-ema", "flow_grpo-ema"])
def test_export_without_adapter_writes_what_the_reference_projects_save(trained, tmp_path, recipe, overrides, expected):
    """flow_grpo's and DiffusionNFT's save_ckpt write their train.ema weights when they keep them, else the trained
    ones (never DiffusionNFT's "old"): so does an export that names no adapter."""
    _, ckpt = trained(recipe, *overrides)
    out = str(tmp_path / "lora")
    export_main([ckpt, "--out", out])
    saved = load_file(os.path.join(out, "pytorch_lora_weights.safetensors"))
    assert all(torch.equal(saved[f"transformer.{k}"], v) for k, v in load_adapter(ckpt, expected).items())


def test_export_refuses_an_adapter_the_checkpoint_lacks(trained, tmp_path, capsys):
    _, ckpt = trained(GRPO)
    with pytest.raises(SystemExit):
        export_main([ckpt, "--out", str(tmp_path / "lora"), "--adapter", "old"])
    assert "has adapters ['default']" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(SystemExit):  # an --out that is a file: one line, not a NotADirectoryError traceback
        export_main([ckpt, "--out", str(a_file)])
    assert "a_file" in capsys.readouterr().err


def test_generate_with_lora_samples_under_the_exported_adapter(tiny_model_dir, trained, tmp_path, capsys):
    model, ckpt = trained(GRPO)
    out, png, pt = str(tmp_path / "lora"), tmp_path / "x.png", tmp_path / "x.pt"
    export_main([os.path.dirname(ckpt), "--out", out])  # a run's checkpoints directory: its newest
    subprocess.run(
        [sys.executable, "tools/generate.py", "--model", tiny_model_dir, "--prompt", PROMPT, "--negative-prompt", " ",
         "--seed", str(SEED), "--steps", str(STEPS), "--guidance", "4.0", "--height", str(SIZE), "--width", str(SIZE),
         "--lora", out, "--out", str(png), "--save-latents", str(pt)],
        cwd=REPO, check=True, capture_output=True,
    )
    expected, _ = rayflow_latents(model, "default")
    torch.testing.assert_close(torch.load(pt, weights_only=True), expected, rtol=0, atol=1e-5)

    # The checkpoint itself (exported on the fly) gives the same latents; a path that is neither is refused.
    generate_main = load_generate_tool().main
    direct = tmp_path / "direct.pt"
    generate_main(["--model", tiny_model_dir, "--prompt", PROMPT, "--negative-prompt", " ", "--seed", str(SEED),
                   "--steps", str(STEPS), "--guidance", "4.0", "--height", str(SIZE), "--width", str(SIZE),
                   "--lora", ckpt, "--out", str(png), "--save-latents", str(direct)])
    torch.testing.assert_close(torch.load(direct, weights_only=True), expected, rtol=0, atol=1e-5)
    for bad, message in ((tmp_path / "missing", "is not a directory"), (tmp_path, "holds neither a diffusers LoRA")):
        with pytest.raises(SystemExit) as info:
            generate_main(["--model", tiny_model_dir, "--prompt", PROMPT, "--out", str(png), "--lora", str(bad)])
        assert message in str(info.value.code) + capsys.readouterr().err


def test_generate_refuses_an_exported_lora_of_another_model_in_one_line(tiny_model_dir, tiny_model, tiny_twin, trained,
                                                                         tmp_path):
    """An exported LoRA (README: export_lora.py, then generate.py --lora my_lora) has no record of its base: onto
    another architecture it was a traceback of every mismatched tensor from peft; its tensors are checked instead."""
    _, ckpt = trained(GRPO)
    out, png = str(tmp_path / "lora"), str(tmp_path / "x.png")
    export_main([ckpt, "--out", out])
    tool = load_generate_tool()
    assert tool.diffusers_lora_dir(out, None, str(tmp_path), model=tiny_model) == out  # its own model's: used as it is
    generate_main = tool.main
    for family, transformer in (("sd3", "SD3Transformer2DModel"), ("flux", "FluxTransformer2DModel")):
        with pytest.raises(SystemExit) as info:
            generate_main(["--model", tiny_twin(family), "--prompt", PROMPT, "--out", png, "--lora", out])
        assert f"error: --lora: {out!r} was trained on another model than --model {transformer}: " in str(info.value.code)
        assert "(the layer is 32 -> 32)" in str(info.value.code)
    generate_main(["--model", tiny_model_dir, "--prompt", PROMPT, "--out", png, "--lora", out, "--steps", "2"])


def test_generate_refuses_a_checkpoint_of_another_model_and_names_bad_input(tiny_model_dir, tiny_twin, trained,
                                                                             tmp_path, capsys):
    """A checkpoint names the model it was trained on: another architecture is refused before anything is loaded
    into it (peft loaded the matching half of a 2-layer checkpoint's adapter into a 4-layer model, with only a
    warning), other weights of the same architecture warn; bad flags are one line, and before the work."""
    _, ckpt = trained(GRPO)
    generate_main, png = load_generate_tool().main, str(tmp_path / "x.png")
    with pytest.raises(SystemExit) as info:
        generate_main(["--model", tiny_twin("sd3"), "--prompt", PROMPT, "--out", png, "--lora", ckpt])
    assert "was trained on another model than --model: pipeline: checkpoint 'QwenImagePipeline', --model " \
           "'StableDiffusion3Pipeline'" in str(info.value.code)
    other = save_tiny_model(str(tmp_path / "other-seed"), size="tiny", seed=1)  # same architecture, other weights
    generate_main(["--model", other, "--prompt", PROMPT, "--out", png, "--lora", ckpt, "--steps", "2"])
    assert "was trained on other weights of this architecture" in capsys.readouterr().err
    for argv, message in (
        (["--steps", "0"], "--steps: got 0; allowed: an integer >= 1"),
        (["--height", "33"], "--height: got 33; allowed: a positive multiple of 16"),
        (["--cfg-policy", "embedded"], "--cfg-policy: got 'embedded'"),
        (["--lora", ckpt, "--adapter", "old"], "has no adapter 'old'"),
        (["--adapter", "ema"], "--adapter ema: needs --lora"),
        (["--out", str(tmp_path / "missing" / "x.png")], "is in no existing directory"),
    ):
        argv = ["--model", tiny_model_dir, "--prompt", PROMPT, "--out", png, *argv]
        with pytest.raises(SystemExit) as info:
            generate_main(argv)
        assert message in str(info.value.code) + capsys.readouterr().err, argv


def test_generate_reads_a_lora_as_diffusers_loads_it(tiny_model_dir, trained, tmp_path, monkeypatch):
    """generate.py --lora checks a LoRA as the pipeline's load_lora_weights reads it. ComfyUI's layout of the same
    tensors ("diffusion_model." keys, which QwenImagePipeline converts) was refused as another model's; peft's own
    (no "transformer." prefix), which diffusers loads into nothing with a warning, passed the check and gave the base
    model's image."""
    from safetensors.torch import save_file

    _, ckpt = trained(GRPO)
    exported = str(tmp_path / "lora")
    export_main([ckpt, "--out", exported])
    tensors = load_file(os.path.join(exported, "pytorch_lora_weights.safetensors"))
    generate_main = load_generate_tool().main

    def latents(lora):
        pt = tmp_path / "x.pt"
        generate_main(["--model", tiny_model_dir, "--prompt", PROMPT, "--seed", str(SEED), "--steps", "2", "--height",
                       str(SIZE), "--width", str(SIZE), "--out", str(tmp_path / "x.png"), "--save-latents", str(pt),
                       "--lora", lora])
        return torch.load(pt, weights_only=True)

    # ComfyUI's layout keeps each layer's alpha (16 here, train_briefly's) beside its factors, not in the metadata.
    alphas = {f"{k.removeprefix('transformer.').split('.lora_A.')[0]}.alpha": torch.tensor(16.0) for k in tensors if ".lora_A." in k}
    for layout, prefix, extra in (("comfy", "diffusion_model.", alphas), ("peft", "", {})):
        os.makedirs(tmp_path / layout)
        save_file({prefix + k.removeprefix("transformer."): v for k, v in {**tensors, **extra}.items()},
                  str(tmp_path / layout / "pytorch_lora_weights.safetensors"))
    torch.testing.assert_close(latents(str(tmp_path / "comfy")), latents(exported), rtol=0, atol=1e-5)
    # An earlier export kept beside it under another name: diffusers, asked for no file by name, loaded the first of
    # the files whose names end as its own that the directory listed (with a warning). The file it writes is read.
    two_files = tmp_path / "two_files"
    shutil.copytree(exported, two_files)
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, str(two_files / "a_pytorch_lora_weights.safetensors"))
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": sorted(listdir(path)))  # the directory lists the other first
    torch.testing.assert_close(latents(str(two_files)), latents(exported), rtol=0, atol=0)
    with pytest.raises(SystemExit) as info:
        latents(str(tmp_path / "peft"))
    assert f"of its {len(tensors)} tensors would load into nothing (QwenImagePipeline.load_lora_weights loads keys that " \
           f"start with one of ['transformer.'])" in str(info.value.code)


@pytest.mark.parametrize("family, pipeline_cls, policy, scale, pipe_kwargs", [
    ("sd3", "StableDiffusion3Pipeline", "standard", 4.5, dict(guidance_scale=4.5, negative_prompt="")),
    ("flux", "FluxPipeline", "embedded", 3.5, dict(guidance_scale=3.5)),
])
def test_exported_lora_of_each_family_loads_in_its_pipeline(tiny_twin, tmp_path, family, pipeline_cls, policy, scale,
                                                            pipe_kwargs):
    """SD3 and FLUX.1: the exported adapter, loaded by the family's own pipeline, samples what rayflow samples."""
    import diffusers

    from rayflow.paths import recipe as recipe_path

    model_dir, run = tiny_twin(family), str(tmp_path / "run")
    cfg = small_cfg(recipe_path(f"flowgrpo_{family}.yaml"), model_dir, run, "trainer.total_steps=1", "learner.lr=0.05",
                    "learner.lora_alpha=16", "trainer.eval_every=0")
    model, _ = reference.train(cfg, log=lambda msg: None)
    out = str(tmp_path / "lora")
    export_main([latest_checkpoint(os.path.join(run, "checkpoints")), "--out", out])

    pipe = getattr(diffusers, pipeline_cls).from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)

    def pipe_latents():
        return pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent",
                    generator=torch.Generator("cpu").manual_seed(SEED), **pipe_kwargs).images

    base = pipe_latents()
    pipe.load_lora_weights(out)
    lora = pipe_latents()
    params = SamplingParams(height=SIZE, width=SIZE, num_steps=STEPS, guidance_scale=scale, negative_prompt="",
                            sde_type="ode", return_step_indices=[STEPS])
    with using_weights(model.transformer, "default"):
        (t,) = generate(model, RolloutRequest("x", [PROMPT], [0], [0], [SEED], params), make_policy(policy))
    ours = t.latent(STEPS).unsqueeze(0)
    torch.testing.assert_close(as_tokens(lora), ours, rtol=0, atol=1e-5)
    assert (as_tokens(lora) - as_tokens(base)).abs().max() > 1e-3


def as_tokens(latents: torch.Tensor) -> torch.Tensor:
    """SD3's [B, C, h, w] pipeline latents in rayflow's token layout [B, h·w, C]; FLUX's are packed tokens already."""
    return latents.flatten(2).transpose(1, 2) if latents.dim() == 4 else latents


def test_exported_full_sd3_transformer_keeps_its_position_embedding_and_samples_as_rayflow_does(tiny_twin, tmp_path):
    """SD3's transformer has a persistent buffer (pos_embed.pos_embed) besides its parameters, which are all a full
    fine-tuning checkpoint holds: the export built it on the meta device, and failed with "Missing key(s) in
    state_dict"."""
    import diffusers

    from rayflow.paths import recipe as recipe_path

    model_dir, run = tiny_twin("sd3"), str(tmp_path / "run")
    cfg = small_cfg(recipe_path("flowgrpo_sd3.yaml"), model_dir, run, "trainer.total_steps=1", "learner.lr=0.003",
                    "learner.train_mode=full", "sync.mode=merged", "trainer.eval_every=0")
    model, _ = reference.train(cfg, log=lambda msg: None)
    out = str(tmp_path / "transformer")
    export_main([latest_checkpoint(os.path.join(run, "checkpoints")), "--out", out])

    base = diffusers.StableDiffusion3Pipeline.from_pretrained(model_dir)
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(
        model_dir, transformer=diffusers.SD3Transformer2DModel.from_pretrained(out))
    assert torch.equal(pipe.transformer.pos_embed.pos_embed, base.transformer.pos_embed.pos_embed)

    def pipe_latents(p):
        p.set_progress_bar_config(disable=True)
        return as_tokens(p(PROMPT, height=SIZE, width=SIZE, num_inference_steps=STEPS, output_type="latent",
                           guidance_scale=4.5, negative_prompt="", generator=torch.Generator("cpu").manual_seed(SEED)).images)

    params = SamplingParams(height=SIZE, width=SIZE, num_steps=STEPS, guidance_scale=4.5, negative_prompt="",
                            sde_type="ode", return_step_indices=[STEPS])
    (t,) = generate(model, RolloutRequest("x", [PROMPT], [0], [0], [SEED], params), make_policy("standard"))
    full = pipe_latents(pipe)
    torch.testing.assert_close(full, t.latent(STEPS).unsqueeze(0), rtol=0, atol=1e-5)
    assert (full - pipe_latents(base)).abs().max() > 1e-4
