"""What the memory planner knows about a model: parameter counts from its classes built with meta
parameters (no weights read) and transformer activations measured on the meta device
(rayflow.planning.activations), at the configured LoRA, resolution and dtype."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn

from rayflow.config import RayflowConfig

PLANNED_TEXT_TOKENS = 256
"""Prompt tokens the plan assumes (the conditioning length after the chat template is dropped)."""


@dataclass
class ModelSizes:
    """What the planner needs to know about the model, measured from its classes."""

    parameters: dict[str, int]
    """Component name -> parameter count (transformer, text_encoder, vae)."""
    lora_parameters: int
    """Parameters of one LoRA adapter with the configured rank and targets."""
    adapted_parameters: int
    """Parameters of the linears the adapter targets (what "merged" weight sync sends)."""
    block_parameters: int
    """Parameters of the largest transformer block (what FSDP2 gathers at once)."""
    layers: int
    forward: dict[tuple[int, bool], "ForwardCost"]
    """(batch, checkpointing) -> activation bytes of one transformer forward with gradients (FlowGRPO
    replays every CFG branch with gradients: a training step keeps one per branch)."""
    text: dict[str, "TextEncoderSize"]
    """Text encoder component name -> its sizes (SD3 has three, FLUX.1 two, Qwen-Image one)."""
    vae_full_res_channels: int
    latent_elements: int
    """Elements of one sample's latents at the configured resolution."""


@dataclass(frozen=True)
class TextEncoderSize:
    hidden: int
    layers: int
    intermediate: int
    vocab: int
    """Logits' width: the vocabulary where the encoder has an LM head (Qwen2.5-VL), else 0 (CLIP, T5)."""
    tokens: int
    """Positions it runs on per prompt (DiffusionModel.planning_text_tokens)."""


@dataclass(frozen=True)
class ForwardCost:
    saved: int
    """Kept for backward over the whole forward."""
    block: int
    """Kept for backward by one block: the working set a block needs, with gradients or without."""


class NoPublishedConfigs(ValueError):
    """model.path is not on this machine, and rayflow holds no published configs of the family to plan instead."""


def model_directory(cfg: RayflowConfig, arch: str | None, workdir: str) -> tuple[str, str]:
    """(a pipeline directory to read configs from, where it came from). model.path when it is on this
    machine; the tiny model when path is null; else the published configs of `arch` (None: model.tiny_arch, the
    recipe's family), or NoPublishedConfigs when rayflow has none of that family."""
    from rayflow.models.published import PUBLISHED
    from rayflow.models.random_init import write_random_init_dir
    from rayflow.models.tiny import resolve_model_path

    path = cfg.model.path
    if path is None:
        return resolve_model_path(None, cfg.model.cache_dir, cfg.model.tiny_size, cfg.model.tiny_seed, cfg.model.tiny_arch), "tiny offline model"
    if os.path.isfile(os.path.join(path, "model_index.json")):
        return path, path
    if os.path.exists(path):
        raise ValueError(f"model.path: got {path!r}; allowed: a diffusers pipeline directory (it has no "
                         f"model_index.json)")
    arch = arch or cfg.model.tiny_arch
    if arch not in PUBLISHED:
        raise NoPublishedConfigs(
            f"model.path {path} is not on this machine, and rayflow has no published configs of {arch!r} to "
            f"plan instead (it has {sorted(PUBLISHED)}; the family is model.tiny_arch): plan where the model is")
    out = write_random_init_dir(arch, os.path.join(workdir, arch), seed=0)
    return out, f"published {arch} configs ({path} is not on this machine)"


def measure_model(cfg: RayflowConfig, path: str, batches: set[tuple[int, bool]], math_attention: bool = False,
                  text_tokens: int = PLANNED_TEXT_TOKENS) -> ModelSizes:
    """ModelSizes of the pipeline at `path` for the config's LoRA, resolution and dtype."""
    from rayflow.distributed.parallelize import transformer_blocks
    from rayflow.learner.model import lora_targets
    from rayflow.models.random_init import parameter_count, shape_only_components

    full = shape_only_components(path)
    parameters = {name: parameter_count(m) for name, m in full.items()}
    transformer = full["transformer"]
    blocks = transformer_blocks(transformer)  # FSDP2's groups: the gathered-block term takes the largest
    meta_model = _meta_model(path, transformer, cfg)
    targets = lora_targets(cfg.learner, meta_model)
    adapted_linears = [m for name, m in transformer.named_modules()
                       if isinstance(m, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)]
    adapted = sum(m.weight.numel() for m in adapted_linears)
    # LoRA's A (in -> r) and B (r -> out) of each adapted projection, as peft adds them (counted, not built: peft's
    # initialisation of meta tensors took half of a plan of the 20B transformer, 4.6 of 9.6 s)
    lora = sum(cfg.learner.lora_rank * (m.in_features + m.out_features) for m in adapted_linears)
    depths = stack_depths(transformer.config)
    forward = _forward_costs(cfg, path, batches, depths, math_attention, text_tokens) if batches else {}
    latents, _ = meta_model.prepare_latents([0], cfg.sampling.height, cfg.sampling.width)
    text = {name: _text_encoder_size(full[name], tokens)
            for name, tokens in meta_model.planning_text_tokens(text_tokens).items() if name in full}
    vae = full.get("vae")
    return ModelSizes(
        parameters=parameters,
        lora_parameters=lora,
        adapted_parameters=adapted,
        block_parameters=max(parameter_count(b) for b in blocks) if blocks else 0,
        layers=len(blocks),
        forward=forward,
        text=text,
        vae_full_res_channels=0 if vae is None else _vae_full_res_channels(vae.config),
        latent_elements=latents.numel(),
    )


def _text_encoder_size(encoder: nn.Module, tokens: int) -> TextEncoderSize:
    config = encoder.config.get_text_config()
    lm_head = encoder.get_output_embeddings() is not None
    return TextEncoderSize(
        hidden=config.hidden_size, layers=config.num_hidden_layers,
        intermediate=getattr(config, "intermediate_size", None) or config.d_ff,  # T5 names it d_ff
        vocab=config.vocab_size if lm_head else 0, tokens=tokens)


def _vae_full_res_channels(config) -> int:
    """Channels of the decoder's widest full-resolution map: twice the first stage's width (the map
    being upsampled into it), for Wan-style (base_dim) and SD-style (block_out_channels) VAEs."""
    if "base_dim" in config:
        return 2 * config["base_dim"] * config["dim_mult"][0]
    return 2 * config["block_out_channels"][0]


def _meta_model(path: str, transformer: nn.Module, cfg: RayflowConfig):
    """The registered DiffusionModel around a meta transformer (text encoder and VAE left out)."""
    import diffusers

    from rayflow.models.base import model_class, pipeline_class_of

    pipeline_class = pipeline_class_of(path)
    cls = getattr(diffusers, pipeline_class)
    parts = {name: None for name in inspect.signature(cls.__init__).parameters if name != "self"}
    pipe = cls(**{**parts, "transformer": transformer})
    return model_class(pipeline_class)(pipe, torch.device("meta"), getattr(torch, cfg.model.dtype))


BASE_DEPTH = 2
"""Blocks per stack in the smallest measured transformer: SD3's last block differs from the others (it has no context
output), so an increment measured from 2 to 3 is a middle block's."""
STACK_DEPTH_KEYS = ("num_layers", "num_single_layers")
"""Transformer config keys that count a stack of repeated blocks (diffusers' names: every family's `num_layers`,
FLUX.1's single-stream `num_single_layers` beside it)."""


DUAL_ATTENTION = "dual_attention_layers"
"""SD3.5's MMDiT-X blocks (its config lists their indices: the first 13 of SD3.5 Medium's 24) carry a second image
attention: a stack of their own, planned apart from the plain blocks (each measured block was one before, +12% on
SD3.5 Medium's activations)."""


def stack_depths(config) -> dict[str, int]:
    """Each stack of like blocks -> its depth in the model: STACK_DEPTH_KEYS, with SD3.5's dual-attention blocks
    taken out of `num_layers` into DUAL_ATTENTION."""
    depths = {key: config[key] for key in STACK_DEPTH_KEYS if config.get(key)}
    dual = [i for i in config.get(DUAL_ATTENTION) or () if i < depths.get("num_layers", 0)]
    if dual:
        depths["num_layers"] -= len(dual)
        depths[DUAL_ATTENTION] = len(dual)
    return depths


def _forward_costs(cfg: RayflowConfig, path: str, keys: set[tuple[int, bool]], depths: dict[str, int],
                   math_attention: bool, text_tokens: int) -> dict[tuple[int, bool], ForwardCost]:
    """(batch, checkpointing) -> one forward with gradients at that batch: measured with every stack BASE_DEPTH blocks
    deep, then with each stack in turn one block deeper; each stack's increment scaled to its depth in the model,
    `depths` (STACK_DEPTH_KEYS -> blocks; FLUX.1: 19 double-stream, 38 single-stream). Each depth is built once."""
    from rayflow.models.lora import add_lora
    from rayflow.learner.model import lora_targets
    from rayflow.models.random_init import parameters_on_meta, shape_only_components
    from rayflow.planning.activations import measure_forward

    # Blocks of each stack in the smallest model: a dual-attention block is a plain one with a second attention, so
    # the smallest has none (`dual_attention_layers` empty) and the deeper one's middle block has it (a first block
    # saves little for a LoRA backward: nothing before it needs a gradient).
    base_depth = {key: 0 if key == DUAL_ATTENTION else BASE_DEPTH for key in depths}

    def build(deeper: str | None):
        stacks = {key: BASE_DEPTH + (key == deeper) for key in depths if key != DUAL_ATTENTION}
        if DUAL_ATTENTION in depths:
            stacks[DUAL_ATTENTION] = [1] if deeper == DUAL_ATTENTION else []
            stacks["num_layers"] = BASE_DEPTH + (deeper in ("num_layers", DUAL_ATTENTION))
        transformer = shape_only_components(path, skip=("text_encoder", "vae"), transformer_config=stacks)["transformer"]
        # meta: no copy (diffusers' own .to warns about fp32 modules)
        nn.Module.to(transformer, "meta", getattr(torch, cfg.model.dtype))
        model = _meta_model(path, transformer, cfg)
        with parameters_on_meta():
            add_lora(transformer, rank=cfg.learner.lora_rank, alpha=cfg.learner.lora_alpha,
                     targets=lora_targets(cfg.learner, model))
        return model

    def measure(model, batch: int):
        latents, _ = model.prepare_latents(list(range(batch)), cfg.sampling.height, cfg.sampling.width)
        cond = model.planning_conditioning(batch, text_tokens)
        timestep = torch.full((batch,), 500.0, device="meta")
        return measure_forward(model.transformer, lambda: model.predict_velocity(
            latents, timestep, cond, cfg.sampling.height, cfg.sampling.width), math_attention=math_attention)

    base = build(None)
    deeper_models = {key: build(key) for key in depths}
    costs = {}
    for batch in sorted({batch for batch, _ in keys}):
        one = measure(base, batch)
        deeper = {key: measure(model, batch) for key, model in deeper_models.items()}
        per_block = {key: m.saved - one.saved for key, m in deeper.items()}
        outside = one.saved - sum(base_depth[key] * per_block[key] for key in depths)
        largest = max(per_block.values())
        # With checkpointing each block keeps its inputs; the block being recomputed in backward keeps its full set.
        per_input = {key: m.block_inputs - one.block_inputs for key, m in deeper.items()}
        costs[(batch, True)] = ForwardCost(
            saved=outside + sum(depths[key] * per_input[key] for key in depths) + largest, block=largest)
        costs[(batch, False)] = ForwardCost(
            saved=outside + sum(depths[key] * per_block[key] for key in depths), block=largest)
    return {key: costs[key] for key in keys}
