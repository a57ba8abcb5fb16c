"""A tiny, randomly initialised StableDiffusion3Pipeline (two CLIPs + T5), built offline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rayflow.models.tiny_text import build_clip, build_clip_tokenizer, build_t5, build_t5_tokenizer, seeded


@dataclass(frozen=True)
class TinySD3Spec:
    """Sizes of a tiny SD3 pipeline. The two CLIP widths sum to at most the T5 width, as in SD3 (the
    pipeline zero-pads the CLIP sequence to T5's width), and the pooled width is their projections' sum."""

    clip_hidden: int = 16
    clip_projection: int = 16
    t5_hidden: int = 32
    text_layers: int = 1
    transformer_layers: int = 2
    """Two, because SD3's last joint block has no context output projection (to_add_out is a LoRA target)."""
    transformer_heads: int = 2
    transformer_head_dim: int = 16
    vae_channels: int = 8
    latent_channels: int = 4


SD3_SPECS = {
    "tiny": TinySD3Spec(),
    # For benchmarks that need the transformer forward to dominate the step time (as Qwen-Image's "small").
    "small": TinySD3Spec(transformer_layers=4, transformer_heads=8, transformer_head_dim=64),
}


def tiny_vae(spec, shift_factor: float, scaling_factor: float):
    """An AutoencoderKL with SD3's / FLUX's 8x downsampling (four blocks) and no quant convs."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=spec.latent_channels,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[spec.vae_channels] * 4, layers_per_block=1, norm_num_groups=4,
        shift_factor=shift_factor, scaling_factor=scaling_factor, use_quant_conv=False, use_post_quant_conv=False,
    )
    # A random decoder's images sit close to gray; a 4x output layer spreads them over the colour
    # range so a colour reward has something to learn from (as the tiny Qwen-Image does).
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(4.0)
    return vae.eval()


def build_tiny_sd3(spec: TinySD3Spec, seed: int):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_tok, t5_tok = build_clip_tokenizer(), build_t5_tokenizer()
    text_encoder = seeded(seed, build_clip, clip_tok, spec.clip_hidden, spec.text_layers, spec.clip_projection)
    text_encoder_2 = seeded(seed + 1, build_clip, clip_tok, spec.clip_hidden, spec.text_layers, spec.clip_projection)
    text_encoder_3 = seeded(seed + 2, build_t5, t5_tok, spec.t5_hidden, spec.text_layers)
    transformer = seeded(
        seed + 3, SD3Transformer2DModel, sample_size=4, patch_size=2, in_channels=spec.latent_channels,
        out_channels=spec.latent_channels, num_layers=spec.transformer_layers,
        attention_head_dim=spec.transformer_head_dim, num_attention_heads=spec.transformer_heads,
        joint_attention_dim=spec.t5_hidden, caption_projection_dim=spec.transformer_heads * spec.transformer_head_dim,
        pooled_projection_dim=2 * spec.clip_projection, pos_embed_max_size=16,
    )
    # SD3.5's own VAE normalisation and scheduler (static shift 3).
    vae = seeded(seed + 4, tiny_vae, spec, shift_factor=0.0609, scaling_factor=1.5305)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=clip_tok, text_encoder_2=text_encoder_2, tokenizer_2=clip_tok,
        text_encoder_3=text_encoder_3, tokenizer_3=t5_tok,
    )
