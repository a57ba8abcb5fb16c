"""The published architectures rayflow can build with random weights, one entry per model family.

Compute and memory do not depend on the weights, so a published configuration with random weights
costs exactly what the released model costs: it is what benchmarks, GPU tests and the memory
planner run without downloading anything. A family adds its entry to `PUBLISHED` (configs copied
from its released `*/config.json`, with the source named) and nothing else.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Component:
    """One module of a pipeline: the class that builds it and its published config."""

    library: str
    """"diffusers" or "transformers" (where `class_name` lives)."""
    class_name: str
    config: dict[str, Any]
    """Constructor arguments (diffusers) or config fields (transformers), as published."""
    depth_keys: tuple[str, ...] = ()
    """Dotted config keys that count layers: a depth override sets them (tests, quick looks)."""
    config_class: str | None = None
    """transformers only: the config class `config` fills."""


@dataclass(frozen=True)
class PublishedPipeline:
    pipeline_class: str
    """The diffusers pipeline class (the registry key of rayflow.models)."""
    source: str
    """Where the configs below come from."""
    components: dict[str, Component]
    """Pipeline argument name -> component (the scheduler included; tokenizers are not: see below)."""
    tokenizers: Callable[[], dict[str, Any]] = field(default=dict)
    """Pipeline argument name -> tokenizer. The offline tokenizers of rayflow.models.tiny: no vocabulary
    can be downloaded, and a tokenizer's size does not change the compute of the models."""

    def config(self, name: str, depth: int | None = None) -> dict[str, Any]:
        """The config of component `name`, with every layer count set to `depth` when given."""
        component = self.components[name]
        config = copy.deepcopy(component.config)
        if depth is not None:
            for dotted in component.depth_keys:
                *parents, leaf = dotted.split(".")
                node = config
                for key in parents:
                    node = node[key]
                node[leaf] = depth
        return config


def _qwen_tokenizers() -> dict[str, Any]:
    from rayflow.models.tiny import build_tokenizer

    return {"tokenizer": build_tokenizer(1024)}


# Qwen/Qwen-Image on the Hugging Face hub: transformer/config.json, vae/config.json,
# scheduler/scheduler_config.json and text_encoder/config.json (the text encoder is
# Qwen2.5-VL-7B-Instruct, whose config.json the text_encoder one reproduces).
QWEN_IMAGE = PublishedPipeline(
    pipeline_class="QwenImagePipeline",
    source="huggingface.co/Qwen/Qwen-Image (transformer, vae, scheduler, text_encoder config.json); "
    "text encoder = Qwen/Qwen2.5-VL-7B-Instruct",
    components={
        "transformer": Component(
            "diffusers",
            "QwenImageTransformer2DModel",
            dict(
                patch_size=2,
                in_channels=64,
                out_channels=16,
                num_layers=60,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=3584,
                guidance_embeds=False,
                axes_dims_rope=(16, 56, 56),
            ),
            depth_keys=("num_layers",),
        ),
        "vae": Component(
            "diffusers",
            "AutoencoderKLQwenImage",
            dict(
                base_dim=96,
                z_dim=16,
                dim_mult=[1, 2, 4, 4],
                num_res_blocks=2,
                attn_scales=[],
                temperal_downsample=[False, True, True],
                dropout=0.0,
                latents_mean=[-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
                latents_std=[2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
            ),
        ),
        "text_encoder": Component(
            "transformers",
            "Qwen2_5_VLForConditionalGeneration",
            dict(
                text_config=dict(
                    vocab_size=152064,
                    hidden_size=3584,
                    intermediate_size=18944,
                    num_hidden_layers=28,
                    num_attention_heads=28,
                    num_key_value_heads=4,
                    hidden_act="silu",
                    max_position_embeddings=128000,
                    rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
                    bos_token_id=151643,
                    eos_token_id=151645,
                    pad_token_id=151643,
                ),
                vision_config=dict(
                    depth=32,
                    hidden_size=1280,
                    intermediate_size=3420,
                    num_heads=16,
                    in_channels=3,
                    out_hidden_size=3584,
                    patch_size=14,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                    window_size=112,
                    fullatt_block_indexes=[7, 15, 23, 31],
                    tokens_per_second=2,
                ),
                image_token_id=151655,
                video_token_id=151656,
                vision_start_token_id=151652,
                vision_end_token_id=151653,
            ),
            depth_keys=("text_config.num_hidden_layers", "vision_config.depth"),
            config_class="Qwen2_5_VLConfig",
        ),
        "scheduler": Component(
            "diffusers",
            "FlowMatchEulerDiscreteScheduler",
            dict(
                num_train_timesteps=1000,
                shift=1.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=0.9,
                base_image_seq_len=256,
                max_image_seq_len=8192,
                shift_terminal=0.02,
                time_shift_type="exponential",
            ),
        ),
    },
    tokenizers=_qwen_tokenizers,
)


def _clip_t5_tokenizers(clip_names: tuple[str, ...], t5_name: str) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        from rayflow.models.tiny_text import build_clip_tokenizer, build_t5_tokenizer

        clip = build_clip_tokenizer()
        return {**{name: clip for name in clip_names}, t5_name: build_t5_tokenizer()}

    return build


# The text encoders SD3.5 and FLUX.1 share: CLIP ViT-L/14's text tower (openai/clip-vit-large-patch14),
# OpenCLIP ViT-bigG/14's (laion/CLIP-ViT-bigG-14-laion2B-39B-b160k) and T5 v1.1 XXL's encoder
# (google/t5-v1_1-xxl), as the pipelines' text_encoder*/config.json carry them.
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=768, layer_norm_eps=1e-5,
              bos_token_id=0, eos_token_id=2, pad_token_id=1)
CLIP_BIGG = dict(CLIP_L, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
                 hidden_act="gelu", projection_dim=1280)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
              layer_norm_epsilon=1e-6, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
              decoder_start_token_id=0)


def _sd_vae(scaling_factor: float, shift_factor: float) -> Component:
    """The 16-channel AutoencoderKL of SD3 and FLUX.1 (the same layout, each with its own latent normalisation)."""
    return Component("diffusers", "AutoencoderKL", dict(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
        latent_channels=16, norm_num_groups=32, act_fn="silu", sample_size=1024, force_upcast=True,
        scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False))


# stabilityai/stable-diffusion-3.5-medium on the Hugging Face hub: transformer/, vae/, text_encoder{,_2,_3}/config.json
# and scheduler/scheduler_config.json (MMDiT-X: dual attention in the first 13 blocks, QK RMSNorm, positional
# embeddings up to 384 latent patches a side, as its model card describes).
SD3_5_MEDIUM = PublishedPipeline(
    pipeline_class="StableDiffusion3Pipeline",
    source="huggingface.co/stabilityai/stable-diffusion-3.5-medium (transformer, vae, text_encoder, text_encoder_2, "
    "text_encoder_3 config.json; scheduler_config.json)",
    components={
        "transformer": Component(
            "diffusers",
            "SD3Transformer2DModel",
            dict(
                sample_size=128,
                patch_size=2,
                in_channels=16,
                out_channels=16,
                num_layers=24,
                attention_head_dim=64,
                num_attention_heads=24,
                joint_attention_dim=4096,
                caption_projection_dim=1536,
                pooled_projection_dim=2048,
                pos_embed_max_size=384,
                dual_attention_layers=list(range(13)),
                qk_norm="rms_norm",
            ),
            depth_keys=("num_layers",),
        ),
        "vae": _sd_vae(scaling_factor=1.5305, shift_factor=0.0609),
        "text_encoder": Component("transformers", "CLIPTextModelWithProjection", CLIP_L,
                                  depth_keys=("num_hidden_layers",), config_class="CLIPTextConfig"),
        "text_encoder_2": Component("transformers", "CLIPTextModelWithProjection", CLIP_BIGG,
                                    depth_keys=("num_hidden_layers",), config_class="CLIPTextConfig"),
        "text_encoder_3": Component("transformers", "T5EncoderModel", T5_XXL, depth_keys=("num_layers",),
                                    config_class="T5Config"),
        "scheduler": Component("diffusers", "FlowMatchEulerDiscreteScheduler",
                               dict(num_train_timesteps=1000, shift=3.0)),
    },
    tokenizers=_clip_t5_tokenizers(("tokenizer", "tokenizer_2"), "tokenizer_3"),
)

# black-forest-labs/FLUX.1-dev on the Hugging Face hub: transformer/, vae/, text_encoder{,_2}/config.json and
# scheduler/scheduler_config.json (19 double-stream and 38 single-stream blocks, guidance-distilled).
FLUX_1_DEV = PublishedPipeline(
    pipeline_class="FluxPipeline",
    source="huggingface.co/black-forest-labs/FLUX.1-dev (transformer, vae, text_encoder, text_encoder_2 config.json; "
    "scheduler_config.json)",
    components={
        "transformer": Component(
            "diffusers",
            "FluxTransformer2DModel",
            dict(
                patch_size=1,
                in_channels=64,
                num_layers=19,
                num_single_layers=38,
                attention_head_dim=128,
                num_attention_heads=24,
                joint_attention_dim=4096,
                pooled_projection_dim=768,
                guidance_embeds=True,
                axes_dims_rope=(16, 56, 56),
            ),
            depth_keys=("num_layers", "num_single_layers"),
        ),
        "vae": _sd_vae(scaling_factor=0.3611, shift_factor=0.1159),
        "text_encoder": Component("transformers", "CLIPTextModel", CLIP_L, depth_keys=("num_hidden_layers",),
                                  config_class="CLIPTextConfig"),
        "text_encoder_2": Component("transformers", "T5EncoderModel", T5_XXL, depth_keys=("num_layers",),
                                    config_class="T5Config"),
        "scheduler": Component(
            "diffusers",
            "FlowMatchEulerDiscreteScheduler",
            dict(
                num_train_timesteps=1000,
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
        ),
    },
    tokenizers=_clip_t5_tokenizers(("tokenizer",), "tokenizer_2"),
)

PUBLISHED: dict[str, PublishedPipeline] = {"qwen_image": QWEN_IMAGE, "sd3": SD3_5_MEDIUM, "flux": FLUX_1_DEV}
"""Architecture name (tools/make_tiny_model.py --arch) -> its published pipeline."""


def published(arch: str) -> PublishedPipeline:
    if arch not in PUBLISHED:
        raise ValueError(f"--arch: {arch!r} has no published configuration in rayflow; allowed: {sorted(PUBLISHED)}")
    return PUBLISHED[arch]
