"""Pooled + sequence text conditioning (SD3, FLUX.1) carried in one PromptEmbeds.

The sampler, the trajectories and the learner's replay carry one [L, D] tensor per sample and
conditioning. Pipelines with a CLIP pooled embedding [P] as well store it as an extra first row,
zero-padded to D (P <= D in every such pipeline: SD3 2048 <= 4096, FLUX.1 768 <= 4096), so
nothing outside the model adapter needs to know about it.
"""

from __future__ import annotations

import inspect

import torch

from rayflow.models.base import DiffusionModel, PromptEmbeds


def check_fits(pooled_dim: int, seq_dim: int, pipeline_class: str) -> None:
    if pooled_dim > seq_dim:
        raise ValueError(
            f"model: {pipeline_class} has a pooled text embedding of width {pooled_dim} wider than its sequence "
            f"embedding ({seq_dim}); rayflow carries the pooled one as an extra sequence row, so it must be <= {seq_dim}"
        )


def pack(embeds: torch.Tensor, pooled: torch.Tensor) -> PromptEmbeds:
    """[B, L, D] sequence and [B, P] pooled -> PromptEmbeds [B, 1 + L, D] (no mask: the pipelines pad to a fixed length)."""
    row = torch.nn.functional.pad(pooled, (0, embeds.shape[-1] - pooled.shape[-1]))
    return PromptEmbeds(torch.cat([row[:, None], embeds], dim=1), None)


def t5_tokens(pipe) -> int:
    """T5 positions every prompt is padded to: the pipeline's encode_prompt default (rayflow passes none)."""
    return inspect.signature(pipe.encode_prompt).parameters["max_sequence_length"].default


def unpack(cond: PromptEmbeds, pooled_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `pack`: (sequence [B, L, D], pooled [B, P])."""
    return cond.embeds[:, 1:], cond.embeds[:, 0, :pooled_dim]


class PooledTextModel(DiffusionModel):
    """A family whose transformer takes a pooled text embedding besides the sequence (SD3, FLUX.1)."""

    def __init__(self, pipe, device: torch.device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        config = self.transformer.config
        self._pooled_dim = config.pooled_projection_dim
        check_fits(self._pooled_dim, config.joint_attention_dim, self.pipeline_class)

    def padded_text_tokens(self) -> int:
        """Sequence tokens of every prompt: the pipelines pad to a fixed length, whatever the prompt."""
        raise NotImplementedError

    def planning_conditioning(self, batch: int, tokens: int) -> PromptEmbeds:
        # `tokens` is a guess at a prompt's length; these pipelines pad every prompt to padded_text_tokens().
        dim = self.transformer.config.joint_attention_dim
        shape = (batch, 1 + self.padded_text_tokens(), dim)  # + the pooled row (pack)
        return PromptEmbeds(torch.empty(shape, device=self.device, dtype=self.dtype), None)

    @classmethod
    def size_multiple(cls) -> int:
        # The VAE downsamples 8x and the transformer takes 2x2 patches of latents (SD3 patches, FLUX packs).
        return 16
