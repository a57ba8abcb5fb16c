"""Qwen-Image as a DiffusionModel: the diffusers QwenImagePipeline's own pieces, called separately.

Every piece delegates to the pipeline object (its encode_prompt, latent packing, shift
computation, VAE normalisation), so rayflow's sampler reproduces `QwenImagePipeline.__call__`
by construction, for the tiny offline model and for the real one alike.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

from rayflow.models.base import JOINT_ATTENTION_TARGETS, DiffusionModel, PromptEmbeds, Schedule, load_pipeline, register_model


def _vae_scale_of(path: str, default: int) -> int:
    """2 ** (spatial halvings) of the VAE whose config is under `path`/vae, as the pipeline computes it."""
    config = os.path.join(path, "vae", "config.json")
    if not os.path.isfile(config):
        return default
    with open(config) as f:
        return 2 ** len(json.load(f).get("temperal_downsample", [False, True, True]))


@register_model
class QwenImageModel(DiffusionModel):
    pipeline_class = "QwenImagePipeline"
    default_cfg_policy = "true_cfg"
    lora_target_modules = JOINT_ATTENTION_TARGETS
    masks_prompts = True

    @classmethod
    def load(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             transformer_only: bool = False) -> "QwenImageModel":
        import transformers
        from diffusers.utils import logging as diffusers_logging

        # Loading bars from every rank of every actor would bury the run's own progress bar.
        diffusers_logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
        skipped = ("text_encoder", "vae", "tokenizer") if transformer_only else ()
        device = torch.device(device)
        pipe = load_pipeline(path, device, dtype, skip=skipped)
        pipe.set_progress_bar_config(disable=True)
        if pipe.vae is None:
            # Without a VAE the pipeline assumes Qwen-Image's 8x; a smaller VAE (the shapes base's 4x) would
            # give learners another latent grid than the rollouts.
            pipe.vae_scale_factor = _vae_scale_of(path, default=pipe.vae_scale_factor)
        for module in (pipe.transformer, pipe.vae, pipe.text_encoder):
            if module is not None:
                module.requires_grad_(False).eval()
        return cls(pipe, device, dtype)

    @classmethod
    def size_multiple(cls) -> int:
        # VAE downsamples 8x, the transformer packs 2x2 latent patches.
        return 16

    @property
    def _vae_scale(self) -> int:
        return self.pipe.vae_scale_factor

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> PromptEmbeds:
        embeds, mask = self.pipe.encode_prompt(prompt=prompts, device=self.device)
        return PromptEmbeds(embeds, mask)

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        # The pipeline's own rounding: latent grid of the VAE, even for 2x2 packing.
        return 2 * (height // (self._vae_scale * 2)), 2 * (width // (self._vae_scale * 2))

    def prepare_latents(self, seeds: list[int], height: int, width: int) -> tuple[torch.Tensor, list[torch.Generator]]:
        h, w = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        # Drawn per sample on the CPU, as the pipeline's randn_tensor does with one generator per image.
        noise = [torch.randn((1, 1, channels, h, w), generator=g, dtype=self.dtype) for g in generators]
        latents = torch.cat(noise).to(self.device)
        return self.pipe._pack_latents(latents, len(seeds), channels, h, w), generators

    def schedule(self, num_steps: int, height: int, width: int, shift: float | None = None) -> Schedule:
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        h, w = self._latent_hw(height, width)
        image_seq_len = (h // 2) * (w // 2)
        config = self.pipe.scheduler.config
        if shift is None:
            mu = calculate_shift(
                image_seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.15),
            )
        elif config.get("use_dynamic_shifting") and config.get("time_shift_type", "exponential") == "exponential":
            # An exponential time shift with mu = ln(s) is the static shift s.
            mu = math.log(shift)
        else:
            raise ValueError(f"sampling.shift: got {shift}; allowed: null for this scheduler config ({dict(config)})")
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        timesteps, _ = retrieve_timesteps(self.pipe.scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return Schedule(sigmas=self.pipe.scheduler.sigmas.to(torch.float32).clone(), timesteps=timesteps.clone())

    def predict_velocity(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: PromptEmbeds, height: int, width: int
    ) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        batch = latents.shape[0]
        # In the model dtype, as the pipeline (whose latents are in it) does; rounding the timestep by
        # the latents' dtype would make a replay from float32 captures differ from a bf16 rollout.
        timestep = torch.as_tensor(timestep, device=latents.device).expand(batch).to(self.dtype)
        return self.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=cond.mask,
            encoder_hidden_states=cond.embeds,
            img_shapes=[[(1, h // 2, w // 2)]] * batch,
            attention_kwargs={},
            return_dict=False,
        )[0]

    def planning_conditioning(self, batch: int, tokens: int) -> PromptEmbeds:
        dim = self.transformer.config.joint_attention_dim
        return PromptEmbeds(torch.empty(batch, tokens, dim, device=self.device, dtype=self.dtype), None)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae = self.pipe.vae
        latents = self.pipe._unpack_latents(latents, height, width, self._vae_scale).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        latents = latents / inv_std + mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        image = self.pipe.image_processor.postprocess(image, output_type="pt")  # [B, 3, H, W] in [0, 1]
        return (image.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8).cpu()
