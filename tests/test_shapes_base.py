"""The shipped shapes base: tools/pretrain_shapes.py reproduces its first steps, the shipped copy loads with
diffusers, and a missing or corrupt one is named with the command that rebuilds it."""

import os
import shutil
import sys

import pytest

from rayflow.models.shapes import MANIFEST, REBUILD_COMMAND, SHAPES_MODEL_DIR, build_shapes_pipeline, check_shapes_base

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from pretrain_shapes import PretrainConfig, encode_pool, train_transformer, train_vae  # noqa: E402

# The losses of the first two steps of each stage with the default PretrainConfig (seed 0). The VAE's are
# those of the shipped run (its log printed step 0 as 1.29740); the transformer's are on a pool of the
# first 64 scenes of its categories (the shipped run normalises latents over 8192). Float32 sums over ~10^5 terms in a
# different thread order move the fifth digit at most: rel 1e-4.
VAE_LOSSES = [1.2973955869674683, 0.555517315864563]
TRANSFORMER_LOSSES = [2.1959452629089355, 2.191871404647827]


def test_first_steps_of_the_pretraining_reproduce():
    cfg = PretrainConfig()
    pipe = build_shapes_pipeline(cfg.seed)
    assert train_vae(pipe.vae, cfg, steps=2) == pytest.approx(VAE_LOSSES, rel=1e-4)
    latents, prompts = encode_pool(pipe, 2 * cfg.batch, cfg.pool_categories)
    assert train_transformer(pipe, latents, prompts, cfg, steps=2) == pytest.approx(TRANSFORMER_LOSSES, rel=1e-4)


def test_the_shipped_base_passes_its_manifest_and_loads_with_diffusers():
    from diffusers import QwenImagePipeline

    check_shapes_base(SHAPES_MODEL_DIR)
    pipe = QwenImagePipeline.from_pretrained(SHAPES_MODEL_DIR)
    assert pipe.vae_scale_factor == 4 and pipe.transformer.config.num_layers == 4


def test_a_missing_or_corrupt_base_names_the_rebuild_command(tmp_path, monkeypatch):
    copy = tmp_path / "shapes"
    shutil.copytree(SHAPES_MODEL_DIR, copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x00" * 8)
    with pytest.raises(ValueError, match=f"{weights} is corrupt.*rebuild it with `{REBUILD_COMMAND}`"):
        check_shapes_base(str(copy))
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=f"{weights} is missing; rebuild it with `{REBUILD_COMMAND}`"):
        check_shapes_base(str(copy))
    (copy / MANIFEST).unlink()
    check_shapes_base(str(copy))  # another model without a manifest: nothing to check
    # The shipped location itself, gone (a checkout without the weights):
    monkeypatch.setattr("rayflow.models.shapes.SHAPES_MODEL_DIR", str(copy))
    with pytest.raises(FileNotFoundError, match=f"{MANIFEST} is missing; rebuild it with `{REBUILD_COMMAND}`"):
        check_shapes_base(str(copy))
