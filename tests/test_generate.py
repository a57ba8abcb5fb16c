"""tools/generate.py against diffusers' QwenImagePipeline on the tiny model."""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, NEGATIVE = "a red apple on a blue table", "blurry"


def load_generate_tool():
    spec = importlib.util.spec_from_file_location("generate_tool", os.path.join(REPO, "tools", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pipeline_outputs(pipe, seed, guidance, **kwargs):
    def run(output_type):
        return pipe(
            PROMPT, true_cfg_scale=guidance, height=64, width=64, num_inference_steps=8,
            generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kwargs,
        ).images

    image = torch.from_numpy((run("np")[0] * 255).round().astype(np.uint8))
    return run("latent"), image


def test_cli_matches_pipeline_with_true_cfg(tiny_model_dir, tiny_pipeline, tmp_path):
    png, pt = tmp_path / "x.png", tmp_path / "x.pt"
    subprocess.run(
        [
            sys.executable, "tools/generate.py", "--model", tiny_model_dir, "--prompt", PROMPT,
            "--negative-prompt", NEGATIVE, "--seed", "5", "--steps", "8", "--guidance", "4.0",
            "--height", "64", "--width", "64", "--out", str(png), "--save-latents", str(pt),
        ],
        cwd=REPO, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    latents, image = pipeline_outputs(tiny_pipeline, 5, 4.0, negative_prompt=NEGATIVE)
    saved = torch.load(pt)
    assert saved.shape == latents.shape == (1, 16, 16)
    torch.testing.assert_close(saved, latents, rtol=0, atol=1e-5)
    assert torch.equal(torch.from_numpy(np.array(Image.open(png))), image)


def test_main_without_cfg_matches_pipeline(tiny_model_dir, tiny_pipeline, tmp_path):
    png, pt = tmp_path / "y.png", tmp_path / "y.pt"
    load_generate_tool().main(
        ["--model", tiny_model_dir, "--prompt", PROMPT, "--seed", "2", "--steps", "8", "--guidance", "1.0",
         "--height", "64", "--width", "64", "--out", str(png), "--save-latents", str(pt)]
    )
    latents, image = pipeline_outputs(tiny_pipeline, 2, 1.0)
    assert torch.equal(torch.load(pt), latents)  # same process, same thread count: bit for bit
    assert torch.equal(torch.from_numpy(np.array(Image.open(png))), image)
    # CFG changes the result, so the first test's comparison has something to detect.
    assert not torch.equal(latents, pipeline_outputs(tiny_pipeline, 2, 4.0, negative_prompt=NEGATIVE)[0])


def test_inputs_that_failed_after_sampling_are_refused_first_naming_the_flag(tiny_model_dir, tmp_path, capsys):
    """An infinite --guidance sampled the whole image and ended in a FloatingPointError traceback; a seed torch cannot
    take failed as "Overflow when unpacking long long" and an extension PIL cannot write as "unknown file extension",
    neither naming its flag; --adapter beside a diffusers LoRA (one adapter) was silently ignored."""
    tool = load_generate_tool()
    base = ["--model", tiny_model_dir, "--prompt", PROMPT, "--out", str(tmp_path / "x.png")]
    with pytest.raises(SystemExit, match=r"--guidance: got inf; allowed: a finite float >= 1\.0"):
        tool.main(base + ["--guidance", "inf"])
    for flag, value, message in (("--seed", str(2**64), r"--seed: got 18446744073709551616; allowed: an integer in"),
                                 ("--out", str(tmp_path / "x.pt"), r"--out: .*x\.pt' has extension '\.pt', which PIL")):
        with pytest.raises(SystemExit):
            tool.parse_args(base + [flag, value])
        assert re.search(message, capsys.readouterr().err)
    tool.parse_args(base + ["--seed", "-1"])  # torch takes it (modulo 2**64), as the pipeline's generator does
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / tool.DIFFUSERS_LORA_FILE).write_bytes(b"")
    with pytest.raises(SystemExit, match=r"--adapter old: .* is a diffusers LoRA"):
        tool.diffusers_lora_dir(str(lora), "old", str(tmp_path), model=None)  # before its tensors are read
