"""Tiny, randomly initialised pipelines built offline from the real diffusers / transformers classes.

The point is that every test and every CPU run goes through the same `from_pretrained`
loading code as the real Qwen-Image: only the sizes differ. Nothing is downloaded; the
tokenizer is a byte-level BPE trained here on a small corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, asdict

import torch

from rayflow.errors import ConfigError

# The Qwen chat special tokens the pipeline's prompt template uses, plus the vision tokens
# the Qwen2.5-VL config refers to by id.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black", "cyan", "magenta"]
OBJECTS = ["apple", "car", "house", "cat", "dog", "flower", "ball", "tree", "bird", "boat", "cup", "sky"]

# The system prefix of QwenImagePipeline.prompt_template_encode; the pipeline drops its first
# 34 tokens, so the tokenizer must make it exactly 34 tokens (as Qwen's own tokenizer does),
# else prompt tokens would be dropped or template tokens kept.
_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n"
)
_TEMPLATE_DROP_TOKENS = 34


@dataclass(frozen=True)
class TinyQwenImageSpec:
    """Sizes of a tiny Qwen-Image pipeline. The defaults give a 64x64, 8-step CFG generation in well
    under a second on one core, with the transformer the largest cost."""

    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    vocab_size: int = 1024
    transformer_layers: int = 2
    transformer_heads: int = 4
    transformer_head_dim: int = 32
    vae_base_dim: int = 8
    vae_z_dim: int = 4
    vae_downsamples: int = 3
    """Spatial halvings of the VAE (1 to 3): images are 2**vae_downsamples times the latents' size."""


SPECS = {
    "tiny": TinyQwenImageSpec(),
    # For benchmarks that need the transformer forward to dominate the step time.
    "small": TinyQwenImageSpec(transformer_layers=4, transformer_heads=8, transformer_head_dim=64),
}


def _corpus(extra: tuple[str, ...] = ()) -> list[str]:
    lines = list(extra) + [_TEMPLATE_PREFIX + "a photo<|im_end|>\n<|im_start|>assistant\n"] * 50
    for colour in COLOURS:
        for obj in OBJECTS:
            lines.append(f"a {colour} {obj}, a photo of a {obj} that is {colour}. a {colour} {obj} on a {colour} background")
    lines += [" ".join(str(i) for i in range(100))]
    return lines


def build_tokenizer(vocab_size: int, extra_corpus: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with the Qwen chat special tokens, wrapped as Qwen2Tokenizer; `extra_corpus`
    lines join its training corpus (a world's prompts, so that their words are whole tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(extra_corpus), trainer=trainer)
    wrapped = Qwen2Tokenizer(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    n_prefix = len(wrapped(_TEMPLATE_PREFIX)["input_ids"])
    if n_prefix != _TEMPLATE_DROP_TOKENS:
        raise RuntimeError(
            f"tiny tokenizer splits the prompt template prefix into {n_prefix} tokens; "
            f"QwenImagePipeline drops exactly {_TEMPLATE_DROP_TOKENS}"
        )
    return wrapped


def build_text_encoder(spec: TinyQwenImageSpec, tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    head_dim = spec.text_hidden // spec.text_heads
    quarter = head_dim // 4
    # mrope sections (temporal, height, width) must sum to half the head dim.
    mrope_section = [head_dim // 2 - 2 * quarter, quarter, quarter]
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=2 * spec.text_hidden,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads,
            max_position_embeddings=2048,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section},
            bos_token_id=ids["<|endoftext|>"],
            eos_token_id=ids["<|im_end|>"],
            pad_token_id=ids["<|endoftext|>"],
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=spec.text_hidden,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_qwen_image(spec: TinyQwenImageSpec, seed: int, extra_corpus: tuple[str, ...] = ()):
    """Build a QwenImagePipeline in memory; the same seed gives the same weights. `extra_corpus`: see
    build_tokenizer."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )

    from rayflow.models.published import QWEN_IMAGE  # published imports this module's tokenizer builder

    tokenizer = build_tokenizer(spec.vocab_size, extra_corpus)
    torch.manual_seed(seed)
    text_encoder = build_text_encoder(spec, tokenizer)
    torch.manual_seed(seed + 1)
    # (frame, height, width) rope axes: even sizes that sum to the head dim.
    rope_hw = spec.transformer_head_dim * 3 // 8 // 2 * 2
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=spec.vae_z_dim * 4,
        out_channels=spec.vae_z_dim,
        num_layers=spec.transformer_layers,
        attention_head_dim=spec.transformer_head_dim,
        num_attention_heads=spec.transformer_heads,
        joint_attention_dim=spec.text_hidden,
        axes_dims_rope=(spec.transformer_head_dim - 2 * rope_hw, rope_hw, rope_hw),
    )
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(
        base_dim=spec.vae_base_dim,
        z_dim=spec.vae_z_dim,
        dim_mult=[1, 2, 2, 2][: spec.vae_downsamples + 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True][: spec.vae_downsamples],
        latents_mean=[0.0] * spec.vae_z_dim,
        latents_std=[1.0] * spec.vae_z_dim,
    )
    # The decoder RMS-normalises its features, so at init its images sit within ±0.07 of gray whatever
    # the latents. A 4x output layer spreads them over the colour range, so a colour reward has
    # something to learn from.
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(4.0)
    # Qwen-Image's own scheduler config (dynamic exponential shift, terminal sigma 0.02).
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE.config("scheduler"))
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


TINY_PIPELINES = {"qwen_image": "QwenImagePipeline", "sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline"}
"""The families `save_tiny_model` builds (`--arch` of tools/make_tiny_model.py) and their pipeline classes."""
ARCHS = tuple(TINY_PIPELINES)


def tiny_sizes(arch: str) -> list[str]:
    """The sizes the tiny twin of `arch` comes in (flux: "tiny" only)."""
    from rayflow.models.tiny_sd3 import SD3_SPECS

    return {"qwen_image": sorted(SPECS), "sd3": sorted(SD3_SPECS)}.get(arch, ["tiny"])


def build_tiny_pipeline(arch: str, size: str, seed: int):
    """The tiny pipeline of one family and its spec (as a dict)."""
    if size not in tiny_sizes(arch):
        raise ValueError(f"size: got {size!r} for arch {arch!r}; allowed: one of {tiny_sizes(arch)}")
    if arch == "qwen_image":
        return build_tiny_qwen_image(SPECS[size], seed), asdict(SPECS[size])
    if arch == "sd3":
        from rayflow.models.tiny_sd3 import SD3_SPECS, build_tiny_sd3

        return build_tiny_sd3(SD3_SPECS[size], seed), asdict(SD3_SPECS[size])
    if arch == "flux":
        from rayflow.models.tiny_flux import TinyFluxSpec, build_tiny_flux

        return build_tiny_flux(TinyFluxSpec(), seed), asdict(TinyFluxSpec())
    raise ValueError(f"arch: got {arch!r}; allowed: one of {list(ARCHS)}")


def save_tiny_model(out: str, size: str = "tiny", seed: int = 0, arch: str = "qwen_image") -> str:
    """Build the tiny pipeline and save it to `out` atomically (a temporary directory, then rename).

    If `out` already holds a model (another process won the race), that one is kept: the same
    size and seed give the same weights.
    """
    if is_saved_model(out):
        return out
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny-", dir=parent)
    try:
        pipe, spec = build_tiny_pipeline(arch, size, seed)
        pipe.save_pretrained(tmp)
        with open(os.path.join(tmp, "rayflow_tiny.json"), "w") as f:
            json.dump({"arch": arch, "size": size, "seed": seed, "spec": spec}, f, indent=2)
        try:
            os.rename(tmp, out)
        except OSError:
            if not is_saved_model(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def cached_tiny_dir(cache_dir: str, size: str = "tiny", seed: int = 0, arch: str = "qwen_image") -> str:
    """Where the tiny offline twin of `arch` is cached (built there on first use by resolve_model_path)."""
    return os.path.join(os.path.expanduser(cache_dir), f"tiny-{arch.replace('_', '-')}-{size}-seed{seed}")


def is_saved_model(path: str) -> bool:
    """Whether `path` holds a saved pipeline (save_tiny_model writes it atomically: all of it or nothing)."""
    return os.path.isfile(os.path.join(path, "model_index.json"))


def resolve_model_path(path: str | None, cache_dir: str, size: str = "tiny", seed: int = 0, arch: str = "qwen_image") -> str:
    """`path` itself, or the cached tiny offline twin of `arch` (built on first use) when it is None."""
    if path is not None:
        return path
    out = cached_tiny_dir(cache_dir, size, seed, arch)
    try:
        return save_tiny_model(out, size=size, seed=seed, arch=arch)
    except OSError as e:  # a file in its place, no permission, a full disk
        raise ConfigError("model.cache_dir", cache_dir, f"a writable directory to build and cache the tiny model in "
                                                        f"(writing {out} failed: {e})") from e
