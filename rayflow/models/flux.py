"""FLUX.1 as a DiffusionModel: FluxPipeline's own pieces, called separately.

Text: CLIP (pooled) and T5 (sequence) by the pipeline's encode_prompt; the pooled embedding rides
in the conditioning's first row (models/pooled.py). Latents are packed 2x2 into tokens and the
image/text position ids built exactly as FluxPipeline builds them. FLUX.1-dev is guidance-distilled:
the guidance scale is an input of the transformer (the one-branch "embedded" CFG policy passes it);
the pipeline's `true_cfg_scale` path is the standard two-branch policy, with the embedded guidance
at FluxPipeline's default.
"""

from __future__ import annotations

import numpy as np
import torch

from rayflow.errors import ConfigError
from rayflow.models import pooled
from rayflow.models.base import JOINT_ATTENTION_TARGETS, PromptEmbeds, Schedule, register_model
from rayflow.models.sd3 import decode_vae, load_frozen

# FluxPipeline.__call__'s default guidance_scale: the embedded guidance when no policy passes one.
DEFAULT_EMBEDDED_GUIDANCE = 3.5


@register_model
class FluxModel(pooled.PooledTextModel):
    pipeline_class = "FluxPipeline"
    default_cfg_policy = "embedded"
    # Attention q/k/v/out of the double-stream blocks (and q/k/v of the single-stream ones) and the
    # context projections: the attention set flow_grpo and DanceGRPO train on FLUX.1.
    lora_target_modules = JOINT_ATTENTION_TARGETS

    @classmethod
    def load(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             transformer_only: bool = False) -> "FluxModel":
        return cls(load_frozen(path, device, dtype, transformer_only), torch.device(device), dtype)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> PromptEmbeds:
        embeds, pooled_embeds, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device)
        return pooled.pack(embeds, pooled_embeds)

    def padded_text_tokens(self) -> int:
        return pooled.t5_tokens(self.pipe)  # CLIP gives only the pooled embedding

    def planning_text_tokens(self, tokens: int) -> dict[str, int]:
        return {"text_encoder": self.pipe.tokenizer_max_length, "text_encoder_2": pooled.t5_tokens(self.pipe)}

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        # The pipeline's own rounding: latent grid of the VAE, even for 2x2 packing.
        scale = self.pipe.vae_scale_factor
        return 2 * (height // (scale * 2)), 2 * (width // (scale * 2))

    def prepare_latents(self, seeds: list[int], height: int, width: int) -> tuple[torch.Tensor, list[torch.Generator]]:
        h, w = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels // 4
        generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        # Drawn per sample on the CPU, as the pipeline's randn_tensor does with one generator per image.
        noise = torch.cat([torch.randn((1, channels, h, w), generator=g, dtype=self.dtype) for g in generators])
        return self.pipe._pack_latents(noise, len(seeds), channels, h, w).to(self.device), generators

    @classmethod
    def check_shift(cls, shift: float | None, key: str = "sampling.shift") -> None:
        if shift is not None:
            raise ConfigError(key, shift, f"null for {cls.pipeline_class} (mu comes from the image size)")

    def schedule(self, num_steps: int, height: int, width: int, shift: float | None = None) -> Schedule:
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        config = self.pipe.scheduler.config
        self.check_shift(shift)
        h, w = self._latent_hw(height, width)
        # FluxPipeline always computes mu from the packed image sequence length (used when the
        # scheduler shifts dynamically, as FLUX.1's does).
        mu = calculate_shift(
            (h // 2) * (w // 2),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        timesteps, _ = retrieve_timesteps(self.pipe.scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        return Schedule(sigmas=self.pipe.scheduler.sigmas.to(torch.float32).clone(), timesteps=timesteps.clone())

    def predict_velocity(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: PromptEmbeds, height: int, width: int,
        guidance: float | None = None,
    ) -> torch.Tensor:
        """`guidance`: the embedded guidance scale of a guidance-distilled transformer (ignored otherwise)."""
        h, w = self._latent_hw(height, width)
        batch = latents.shape[0]
        embeds, pooled_embeds = pooled.unpack(cond, self._pooled_dim)
        timestep = torch.as_tensor(timestep, device=latents.device).expand(batch).to(self.dtype)
        if self.transformer.config.guidance_embeds:
            value = DEFAULT_EMBEDDED_GUIDANCE if guidance is None else guidance
            guidance_t = torch.full([1], value, device=latents.device, dtype=torch.float32).expand(batch)
        else:
            guidance_t = None
        img_ids = self.pipe._prepare_latent_image_ids(batch, h // 2, w // 2, latents.device, self.dtype)
        txt_ids = torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=self.dtype)
        return self.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=timestep / 1000,
            guidance=guidance_t,
            pooled_projections=pooled_embeds.to(self.dtype),
            encoder_hidden_states=embeds.to(self.dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            joint_attention_kwargs={},
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        grid = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        return decode_vae(self.pipe.vae, self.pipe.image_processor, grid)
