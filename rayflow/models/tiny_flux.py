"""A tiny, randomly initialised FluxPipeline (CLIP + T5, guidance embedding as FLUX.1-dev), built offline."""

from __future__ import annotations

from dataclasses import dataclass

from rayflow.models.tiny_sd3 import tiny_vae
from rayflow.models.tiny_text import build_clip, build_clip_tokenizer, build_t5, build_t5_tokenizer, seeded


@dataclass(frozen=True)
class TinyFluxSpec:
    """Sizes of a tiny FLUX.1-dev pipeline: one double- and one single-stream block."""

    clip_hidden: int = 16
    t5_hidden: int = 32
    text_layers: int = 1
    transformer_layers: int = 1
    transformer_single_layers: int = 1
    transformer_heads: int = 2
    transformer_head_dim: int = 16
    vae_channels: int = 8
    latent_channels: int = 4


def build_tiny_flux(spec: TinyFluxSpec, seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    text_encoder = seeded(seed, build_clip, clip_tok, spec.clip_hidden, spec.text_layers, None)
    text_encoder_2 = seeded(seed + 1, build_t5, t5_tok, spec.t5_hidden, spec.text_layers)
    # Rope axes (index, height, width) as FLUX.1's 16/56/56 of 128, scaled to the head dim.
    rope_hw = spec.transformer_head_dim * 7 // 16 // 2 * 2
    transformer = seeded(
        seed + 2, FluxTransformer2DModel, patch_size=1, in_channels=4 * spec.latent_channels,
        out_channels=4 * spec.latent_channels, num_layers=spec.transformer_layers,
        num_single_layers=spec.transformer_single_layers, attention_head_dim=spec.transformer_head_dim,
        num_attention_heads=spec.transformer_heads, joint_attention_dim=spec.t5_hidden,
        pooled_projection_dim=spec.clip_hidden, guidance_embeds=True,
        axes_dims_rope=(spec.transformer_head_dim - 2 * rope_hw, rope_hw, rope_hw),
    )
    vae = seeded(seed + 3, tiny_vae, spec, shift_factor=0.1159, scaling_factor=0.3611)
    # FLUX.1-dev's scheduler config: shift dynamically, mu from the image sequence length.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tok,
        text_encoder_2=text_encoder_2, tokenizer_2=t5_tok,
    )
