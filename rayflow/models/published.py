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

PUBLISHED: dict[str, PublishedPipeline] = {"qwen_image": QWEN_IMAGE}
"""Architecture name (tools/make_tiny_model.py --arch) -> its published pipeline."""


def published(arch: str) -> PublishedPipeline:
    if arch not in PUBLISHED:
        raise ValueError(f"--arch: {arch!r} has no published configuration in rayflow; allowed: {sorted(PUBLISHED)}")
    return PUBLISHED[arch]
