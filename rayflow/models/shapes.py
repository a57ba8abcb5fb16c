"""The shapes bases: a small Qwen-Image (the real diffusers classes) trained on the shapes world
(rayflow.worlds.shapes) in two stages, both shipped in the repository.

    models/shapes-qwen-image-pretrained/   tools/pretrain_shapes.py: flow matching on rendered scenes
    models/shapes-qwen-image/              the default recipes' base: the pretrained one continued by
                                           tools/order_stage.py, which teaches a relation prompt's order alone
        rayflow_shapes.json                how each was made: its stage's config, the kernels, and the sha256 of
                                           every weight file

Each is a diffusers directory (QwenImagePipeline.from_pretrained loads it). `check_shapes_base` (run by the
preflight) checks a base against its manifest and names the command that rebuilds it when it is missing or corrupt.
"""

from __future__ import annotations

import json
import os

from rayflow.checkpoint_integrity import sha256_file
from rayflow.models.tiny import TinyQwenImageSpec, build_tiny_qwen_image
from rayflow.paths import REPO_ROOT
from rayflow.worlds.shapes import COLOURS, NUMBERS, POSITIONS, RELATIONS, SHAPES

SHAPES_MODEL_DIR = os.path.join(REPO_ROOT, "models", "shapes-qwen-image")
PRETRAINED_MODEL_DIR = os.path.join(REPO_ROOT, "models", "shapes-qwen-image-pretrained")
MANIFEST = "rayflow_shapes.json"
PRETRAIN_COMMAND = "python tools/pretrain_shapes.py --out models/shapes-qwen-image-pretrained"
REBUILD_COMMAND = ("python tools/order_stage.py --base models/shapes-qwen-image-pretrained "
                   "--out models/shapes-qwen-image --exclude recipes/prompts/shapes_eval.txt")
"""The shipped base from the pretrained one (which PRETRAIN_COMMAND rebuilds first, if it is gone too)."""


def rebuild_command(path: str) -> str:
    """The command that rebuilds the shipped base at `path` (the default recipes' unless it is the pretrained one)."""
    return PRETRAIN_COMMAND if os.path.abspath(path) == PRETRAINED_MODEL_DIR else REBUILD_COMMAND


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
    """If `path` is where a shipped base lives, or holds a manifest, check every weight file against the
    manifest: FileNotFoundError or ValueError naming the command that rebuilds it. Other paths pass."""
    manifest = os.path.join(path, MANIFEST)
    shipped = os.path.abspath(path) in (SHAPES_MODEL_DIR, PRETRAINED_MODEL_DIR)
    if not shipped and not os.path.isfile(manifest):
        return
    command = rebuild_command(path)
    if not os.path.isfile(manifest):
        raise FileNotFoundError(f"shapes base: {manifest} is missing; rebuild it with `{command}`")
    files = _manifest_files(manifest, command)
    for name, digest in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"shapes base: {file} is missing; rebuild it with `{command}`")
        if sha256_file(file) != digest:
            raise ValueError(f"shapes base: {file} is corrupt (its sha256 differs from {MANIFEST}); "
                             f"rebuild it with `{command}`")


def _manifest_files(manifest: str, command: str) -> dict[str, str]:
    """The manifest's {file: sha256}; a manifest that is not one (truncated, a merge conflict, another JSON) is a
    corrupt base, named with the command that rebuilds it as a corrupt weight file is."""
    try:
        with open(manifest, encoding="utf-8") as f:
            files = json.load(f).get("files")
    except (ValueError, AttributeError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        files, reason = None, f"{type(e).__name__}: {e}"
    else:
        reason = "no non-empty 'files' object of {name: sha256}"
    if not isinstance(files, dict) or not files or not all(isinstance(d, str) for d in files.values()):
        raise ValueError(f"shapes base: {manifest} is corrupt ({reason}); rebuild it with `{command}`")
    return files
