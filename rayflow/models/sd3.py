"""Stable Diffusion 3 / 3.5 as a DiffusionModel: StableDiffusion3Pipeline's own pieces, called separately.

Text: two CLIPs (pooled, concatenated) and T5 (sequence), by the pipeline's encode_prompt; the
pooled embedding rides in the conditioning's first row (models/pooled.py). Latents [B, C, h, w]
are carried as tokens [B, h·w, C]. Guidance is standard two-branch CFG (SD3's own), so
CFG parallelism with two ranks applies.
"""

from __future__ import annotations

import inspect

import torch

from rayflow.models import pooled
from rayflow.models.base import PromptEmbeds, Schedule, load_pipeline, pipeline_class_of, register_model

# The text modules a learner (transformer_only) never loads.
_TEXT_AND_VAE = ("text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3", "vae")


def load_frozen(path: str, device: torch.device | str, dtype: torch.dtype, transformer_only: bool):
    """The pipeline at `path` (weights on disk or built at load) on `device`, frozen, quiet; text encoders and VAE
    skipped if asked."""
    import diffusers
    import transformers
    from diffusers.utils import logging as diffusers_logging

    # Loading bars from every rank of every actor would bury the run's own progress bar.
    diffusers_logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    pipeline_cls = getattr(diffusers, pipeline_class_of(path))
    components = inspect.signature(pipeline_cls.__init__).parameters
    skipped = tuple(name for name in _TEXT_AND_VAE if name in components) if transformer_only else ()
    pipe = load_pipeline(path, torch.device(device), dtype, skip=skipped)
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", *_TEXT_AND_VAE):
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module):
            module.requires_grad_(False).eval()
    return pipe


def scheduler_for(pipe, shift: float | None):
    """The pipeline's scheduler, or a copy with static shift `shift` (not for dynamically shifting configs)."""
    config = pipe.scheduler.config
    if shift is None:
        return pipe.scheduler
    if config.get("use_dynamic_shifting"):
        raise ValueError(f"sampling.shift: got {shift}; allowed: null for this scheduler config (dynamic shifting)")
    return type(pipe.scheduler).from_config(config, shift=shift)


def decode_vae(vae, image_processor, latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] latents -> [B, H, W, 3] uint8, with the VAE's own shift and scale (SD3 and FLUX alike)."""
    latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    image = image_processor.postprocess(vae.decode(latents, return_dict=False)[0], output_type="pt")
    return (image.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8).cpu()


@register_model
class SD3Model(pooled.PooledTextModel):
    pipeline_class = "StableDiffusion3Pipeline"
    # flow_grpo's SD3 LoRA targets (scripts/train_sd3.py): joint attention q/k/v/out and the context projections.
    default_cfg_policy = "standard"
    lora_target_modules = (
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    )

    @classmethod
    def load(cls, path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             transformer_only: bool = False) -> "SD3Model":
        return cls(load_frozen(path, device, dtype, transformer_only), torch.device(device), dtype)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> PromptEmbeds:
        embeds, _, pooled_embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, do_classifier_free_guidance=False
        )
        return pooled.pack(embeds, pooled_embeds)

    def padded_text_tokens(self) -> int:
        return self.pipe.tokenizer_max_length + pooled.t5_tokens(self.pipe)  # CLIP's 77 positions, then T5's

    def planning_text_tokens(self, tokens: int) -> dict[str, int]:
        clip = self.pipe.tokenizer_max_length
        return {"text_encoder": clip, "text_encoder_2": clip, "text_encoder_3": pooled.t5_tokens(self.pipe)}

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        return height // self.pipe.vae_scale_factor, width // self.pipe.vae_scale_factor

    def prepare_latents(self, seeds: list[int], height: int, width: int) -> tuple[torch.Tensor, list[torch.Generator]]:
        h, w = self._latent_hw(height, width)
        channels = self.transformer.config.in_channels
        generators = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        # Drawn per sample on the CPU, as the pipeline's randn_tensor does with one generator per image.
        noise = torch.cat([torch.randn((1, channels, h, w), generator=g, dtype=self.dtype) for g in generators])
        return noise.flatten(2).transpose(1, 2).to(self.device), generators

    def schedule(self, num_steps: int, height: int, width: int, shift: float | None = None) -> Schedule:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

        scheduler = scheduler_for(self.pipe, shift)
        config = scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting"):
            # The pipeline's mu: from the number of image tokens (latent grid / patch size).
            h, w = self._latent_hw(height, width)
            patch = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, self.device, **kwargs)
        return Schedule(sigmas=scheduler.sigmas.to(torch.float32).clone(), timesteps=timesteps.clone())

    def predict_velocity(
        self, latents: torch.Tensor, timestep: torch.Tensor, cond: PromptEmbeds, height: int, width: int
    ) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        batch, _, channels = latents.shape
        embeds, pooled_embeds = pooled.unpack(cond, self._pooled_dim)
        # SD3 takes the timestep in scheduler units (0..1000), as the pipeline passes it.
        timestep = torch.as_tensor(timestep, device=latents.device).expand(batch)
        out = self.transformer(
            hidden_states=latents.transpose(1, 2).reshape(batch, channels, h, w).to(self.dtype),
            timestep=timestep,
            encoder_hidden_states=embeds.to(self.dtype),
            pooled_projections=pooled_embeds.to(self.dtype),
            return_dict=False,
        )[0]
        return out.flatten(2).transpose(1, 2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        h, w = self._latent_hw(height, width)
        grid = latents.transpose(1, 2).reshape(latents.shape[0], -1, h, w)
        return decode_vae(self.pipe.vae, self.pipe.image_processor, grid)
