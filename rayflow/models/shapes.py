"""The shapes base: a small Qwen-Image (the real diffusers classes) pretrained on the shapes world
(rayflow.worlds.shapes) by tools/pretrain_shapes.py and shipped in the repository.

    models/shapes-qwen-image/   a diffusers directory (QwenImagePipeline.from_pretrained loads it)
        rayflow_shapes.json     how it was made: spec, seed, steps, and the sha256 of every weight file

`check_shapes_base` (run by the preflight) checks the shipped copy against its manifest and names the
command that rebuilds it when it is missing or corrupt.
"""

from __future__ import annotations

import json
import os

from rayflow.checkpoint_integrity import sha256_file
from rayflow.models.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from rayflow.paths import REPO_ROOT
from rayflow.worlds.shapes import COLOURS, NUMBERS, POSITIONS, RELATIONS, SHAPES

SHAPES_MODEL_DIR = os.path.join(REPO_ROOT, "models", "shapes-qwen-image")
MANIFEST = "rayflow_shapes.json"
REBUILD_COMMAND = "python tools/pretrain_shapes.py --out models/shapes-qwen-image"

SHAPES_SPEC = TinyQwenImageSpec(
    transformer_layers=4, transformer_heads=4, transformer_head_dim=32, vae_base_dim=8, vae_z_dim=4, vae_downsamples=2
)
"""64x64 images are 16x16x4 latents (64 transformer tokens). A VAE that downsamples 8x stays at
predicting the background for hundreds of steps on CPU; this one learns crisp shapes within minutes."""


def vocabulary_corpus() -> tuple[str, ...]:
    """Lines with every word of the shapes grammar, for the tokenizer (whole-word tokens)."""
    words = [*COLOURS, *SHAPES, *(s + "s" for s in SHAPES), *NUMBERS, *POSITIONS, *RELATIONS, "and"]
    return tuple(" ".join(words) for _ in range(20))


def build_shapes_pipeline(seed: int):
    """The untrained shapes pipeline (random weights from `seed`), before tools/pretrain_shapes.py trains it."""
    return build_tiny_qwen_image(SHAPES_SPEC, seed, extra_corpus=vocabulary_corpus())


def check_shapes_base(path: str) -> None:
    """If `path` is where the shipped base lives, or holds its manifest, check every weight file against the
    manifest: FileNotFoundError or ValueError naming the command that rebuilds it. Other paths pass."""
    manifest = os.path.join(path, MANIFEST)
    if os.path.abspath(path) != SHAPES_MODEL_DIR and not os.path.isfile(manifest):
        return
    if not os.path.isfile(manifest):
        raise FileNotFoundError(f"shapes base: {manifest} is missing; rebuild it with `{REBUILD_COMMAND}`")
    with open(manifest) as f:
        files = json.load(f)["files"]
    for name, digest in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"shapes base: {file} is missing; rebuild it with `{REBUILD_COMMAND}`")
        if sha256_file(file) != digest:
            raise ValueError(f"shapes base: {file} is corrupt (its sha256 differs from {MANIFEST}); "
                             f"rebuild it with `{REBUILD_COMMAND}`")
