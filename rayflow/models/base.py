"""DiffusionModel: what rayflow needs from a flow-matching text-to-image pipeline, and the registry.

A model is found by the pipeline class name in its `model_index.json`, so a directory written
by diffusers' `save_pretrained` (or downloaded from a hub) loads without further configuration.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from rayflow.errors import ConfigError
from rayflow.models.tiny import resolve_model_path

if TYPE_CHECKING:
    from rayflow.config import ModelConfig

_REGISTRY: dict[str, type["DiffusionModel"]] = {}


def register_model(cls: type["DiffusionModel"]) -> type["DiffusionModel"]:
    """Class decorator: register a DiffusionModel under its `pipeline_class` name."""
    _REGISTRY[cls.pipeline_class] = cls
    return cls


def registered_pipeline_classes() -> list[str]:
    _import_builtin_models()
    return sorted(_REGISTRY)


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch: embeds [B, L, D]; mask [B, L] (1 = token) or None when all valid."""

    embeds: torch.Tensor
    mask: torch.Tensor | None

    def unpadded(self) -> list[torch.Tensor]:
        """One [L_i, D] tensor per sample, padding removed."""
        if self.mask is None:
            return list(self.embeds.unbind(0))
        return [e[m.bool()] for e, m in zip(self.embeds, self.mask)]

    @staticmethod
    def pad(embeds: list[torch.Tensor]) -> "PromptEmbeds":
        """Stack [L_i, D] tensors right-padded with zeros; the mask is None when no sample needs padding,
        as the diffusers pipelines pass it."""
        longest = max(e.shape[0] for e in embeds)
        stacked = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])]) for e in embeds])
        if all(e.shape[0] == longest for e in embeds):
            return PromptEmbeds(stacked, None)
        mask = torch.stack(
            [torch.arange(longest, device=stacked.device) < e.shape[0] for e in embeds]
        ).long()
        return PromptEmbeds(stacked, mask)


SIGMA_ROUNDING = 1e-5
"""A first sigma this close to 1 is 1 rounded in float32 (a static shift s maps 1 to s / (1 + (s - 1)), which rounds to
1 ± 6e-7 for some s): it is set to 1, where the SDE's sigma-tilde rule and DPM-Solver's log-SNR need it exactly."""


@dataclass
class Schedule:
    """The sigma schedule of one generation: sigmas [T+1] float32 falling from 1 to 0, timesteps [T]. Checked on
    construction: a scheduler config and step count that give anything else (NaN sigmas for one step under a
    shift_terminal stretch; repeated sigmas, a zero-length step, under an extreme shift) are refused, naming the keys,
    not sampled into NaN trajectories."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    def __post_init__(self) -> None:
        sigmas = self.sigmas
        if len(sigmas) > 1 and sigmas[0] != 1 and abs(float(sigmas[0]) - 1) < SIGMA_ROUNDING:
            self.sigmas = sigmas = torch.cat([sigmas.new_ones(1), sigmas[1:]])
        steps = len(sigmas) - 1
        falling = steps >= 1 and bool((sigmas[1:] < sigmas[:-1]).all())
        if not (torch.isfinite(sigmas).all() and torch.isfinite(self.timesteps).all() and falling
                and sigmas[0] == 1 and sigmas[-1] == 0):
            raise ValueError(f"sampling.num_steps / sampling.shift (or trainer.eval_num_steps): the scheduler gives the "
                             f"sigmas {[round(float(x), 6) for x in sigmas]} for {steps} steps; allowed: settings whose "
                             f"sigmas are finite and fall from 1 to 0 step by step (a scheduler with shift_terminal "
                             f"needs 2 steps or more; an extreme shift repeats sigmas)")


JOINT_ATTENTION_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
"""LoRA targets of diffusers' joint (MMDiT) attention: the image stream's q/k/v/out and the text stream's
projections, by their module names in QwenImageTransformer2DModel and FluxTransformer2DModel."""


class DiffusionModel(ABC):
    """A flow-matching pipeline split into the pieces an RL loop calls separately.

    Latents are the transformer's token layout [B, N, C]. The transformer is the only module that
    is trained (through LoRA); `transformer` exposes it.
    """

    pipeline_class: ClassVar[str]
    """The diffusers pipeline class name this model loads (the registry key)."""
    lora_target_modules: ClassVar[tuple[str, ...]]
    """Default LoRA targets: the attention projections of every transformer block."""
    default_cfg_policy: ClassVar[str]
    """The CFG policy (cfg/policy.py) that reproduces the family's own pipeline."""
    masks_prompts: ClassVar[bool] = False
    """Whether the transformer's attention takes a mask over prompt tokens: it gets one wherever prompts of different
    token counts share a forward (a learner micro-batch of several prompts, rollout.batch_branches). SD3 and FLUX.1 pad
    every prompt to a fixed length and take none."""

    transformer: nn.Module
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def check_cfg_policy(cls, policy: str, key: str = "cfg.policy") -> None:
        """Refuse (ConfigError naming `key`) 'embedded' guidance for a family whose transformer takes no guidance
        scale as an input: only a guidance-distilled one does (FLUX.1-dev)."""
        if policy == "embedded" and cls.default_cfg_policy != "embedded":
            raise ConfigError(key, policy, f"a policy other than 'embedded' for {cls.pipeline_class} (its transformer "
                                           f"has no guidance input; 'embedded' is FLUX.1-dev's)")

    @classmethod
    def check_attention_backend(cls, backend: str, key: str = "model.attention_backend") -> None:
        """Refuse (ConfigError naming `key`) 'flash' for a family whose prompts are masked: torch's flash kernel takes
        no mask (diffusers raises at the first masked forward, the learner's first train step of prompts of different
        token counts), on CPU and CUDA alike."""
        if backend == "flash" and cls.masks_prompts:
            raise ConfigError(key, backend, f"'auto', 'efficient', 'cudnn' or 'math' for {cls.pipeline_class}: its attention "
                                            f"masks the padding of prompts of different token counts in one forward (a "
                                            f"learner micro-batch), and the flash kernel takes no mask")

    @classmethod
    def check_shift(cls, shift: float | None, key: str = "sampling.shift") -> None:
        """Refuse (ConfigError naming `key`) a static shift the family's scheduler never takes, before anything starts.
        Whether a scheduler config takes one is decided by `schedule`; this refuses only what no config of the family
        takes."""

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        """`pipe`: the family's diffusers pipeline (text encoders and VAE None when loaded transformer-only)."""
        self.pipe = pipe
        self.transformer = pipe.transformer
        self.device = device
        self.dtype = dtype

    @classmethod
    @abstractmethod
    def load(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             transformer_only: bool = False) -> "DiffusionModel":
        """Load the pipeline at `path` through `from_pretrained`. `transformer_only` skips the text encoder
        and the VAE (learners replay stored conditionings and never decode): predict_velocity works,
        encode_prompt and decode do not."""

    @classmethod
    @abstractmethod
    def size_multiple(cls) -> int:
        """Image height and width must be multiples of this (VAE scale x patch size)."""

    @abstractmethod
    def encode_prompt(self, prompts: list[str]) -> PromptEmbeds:
        """Text conditioning for each prompt, exactly as the pipeline computes it."""

    @abstractmethod
    def prepare_latents(self, seeds: list[int], height: int, width: int) -> tuple[torch.Tensor, list[torch.Generator]]:
        """Initial noise [B, N, C] and one generator per sample.

        Sample i equals the pipeline's latents for one image with
        `generator=torch.Generator("cpu").manual_seed(seeds[i])`; generator i is that generator after
        the draw, so the sample's SDE noise continues its own stream (never a copy of its initial noise).
        """

    @abstractmethod
    def schedule(self, num_steps: int, height: int, width: int, shift: float | None = None) -> Schedule:
        """The pipeline's sigma/timestep schedule for this size (shift None = the scheduler's own)."""

    @abstractmethod
    def predict_velocity(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: PromptEmbeds, height: int, width: int
    ) -> torch.Tensor:
        """The transformer's velocity [B, N, C] at `timestep` (scalar or [B], in scheduler units)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Final latents [B, N, C] -> images [B, H, W, 3] uint8."""

    def load_lora(self, path: str) -> None:
        """Load a diffusers-format LoRA directory into the transformer (the pipeline's load_lora_weights), from its
        DIFFUSERS_LORA_FILE: asked for no file by name, diffusers loads the first of the directory's files whose name
        ends so, in the order the directory lists them (an earlier export kept beside it could be the one loaded)."""
        from rayflow.models.lora import DIFFUSERS_LORA_FILE

        self.pipe.load_lora_weights(path, weight_name=DIFFUSERS_LORA_FILE)

    def planning_conditioning(self, batch: int, tokens: int) -> PromptEmbeds:
        """Conditioning of `tokens` text tokens per sample on the model's device (meta for the memory
        planner, rayflow.planning), shaped as encode_prompt returns it."""
        raise NotImplementedError(f"{type(self).__name__} does not give the memory planner its conditioning shape")

    def planning_text_tokens(self, tokens: int) -> dict[str, int]:
        """Pipeline component name -> the tokens each of its text encoders runs on per prompt, when a prompt has
        `tokens` tokens (the memory planner's encode phase). One encoder on the prompt as it is, unless a family
        says otherwise."""
        return {"text_encoder": tokens}

    def check_size(self, height: int, width: int) -> None:
        m = self.size_multiple()
        for key, value in (("height", height), ("width", width)):
            if value <= 0 or value % m:
                raise ValueError(f"sampling.{key}: got {value}; allowed: a positive multiple of {m} for {self.pipeline_class}")


def pipeline_class_of(path: str) -> str:
    """The `_class_name` in `path/model_index.json`, with a clear error if this is not a pipeline."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.path: {path!r} is not a directory (expected a diffusers pipeline directory)")
    index = os.path.join(path, "model_index.json")
    if not os.path.isfile(index):
        raise ValueError(
            f"model.path: {path!r} has no model_index.json, so it is not a diffusers pipeline directory "
            f"(write one with pipeline.save_pretrained)"
        )
    try:
        with open(index) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"model.path: {index} is not a valid model_index.json ({e})") from None
    name = data.get("_class_name") if isinstance(data, dict) else None
    if not isinstance(name, str):
        # A list or a number here escaped as a TypeError (unhashable, or not subscriptable by a key) naming no file.
        got = f"_class_name {name!r}" if isinstance(data, dict) else f"a JSON {type(data).__name__}, not an object"
        raise ValueError(f"model.path: {index} is not a valid model_index.json (got {got}; allowed: an object whose "
                         f"_class_name is a pipeline class name, e.g. 'QwenImagePipeline')")
    return name


def model_class(pipeline_class: str) -> type[DiffusionModel]:
    """The registered DiffusionModel for a pipeline class name."""
    _import_builtin_models()
    if pipeline_class not in _REGISTRY:
        raise ValueError(
            f"pipeline class {pipeline_class!r} is not registered with rayflow; "
            f"registered: {registered_pipeline_classes()}"
        )
    return _REGISTRY[pipeline_class]


def load_model(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               transformer_only: bool = False) -> DiffusionModel:
    """Load the pipeline at `path` as the DiffusionModel registered for its class."""
    return model_class(pipeline_class_of(path)).load(path, device=device, dtype=dtype, transformer_only=transformer_only)


def load_configured(model: "ModelConfig", device: torch.device | str, transformer_only: bool = False) -> DiffusionModel:
    """The run's model section loaded, as learner ranks, rollout ranks and the weight-sync folder all load it: model.path
    (or, null, the tiny twin model.tiny_* names, built and cached on first use) in model.dtype on `device`."""
    path = resolve_model_path(model.path, model.cache_dir, model.tiny_size, model.tiny_seed, model.tiny_arch)
    return load_model(path, device=device, dtype=getattr(torch, model.dtype), transformer_only=transformer_only)


def load_pipeline(path: str, device: torch.device | str, dtype: torch.dtype, skip: tuple[str, ...] = ()):
    """The diffusers pipeline at `path` on `device` in `dtype`, components in `skip` left out (None).

    A random-init directory (tools/make_tiny_model.py --size full --random-init --weights-at-load)
    has no weights: they are built on `device` directly (rayflow.models.random_init)."""
    import diffusers

    from rayflow.models.random_init import load_random_init_pipeline, random_init_spec

    if random_init_spec(path) is not None:
        return load_random_init_pipeline(path, device, dtype, skip=skip)
    pipeline_cls = getattr(diffusers, pipeline_class_of(path))
    return pipeline_cls.from_pretrained(path, dtype=dtype, **{name: None for name in skip}).to(device)


def _import_builtin_models() -> None:
    from rayflow.models import flux, qwen_image, sd3  # noqa: F401  (each registers itself)
