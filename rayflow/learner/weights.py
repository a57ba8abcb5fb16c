"""The policy's weight sets, whichever learner.train_mode built it: "default" (trained), "old" (DiffusionNFT's
EMA), "ema" (trainer.ema_decay's EMA) and the KL reference. LoRA keeps them as peft adapters
(rayflow.learner.lora), full fine-tuning as whole-weight copies (rayflow.learner.full); the objective, the
optimizer's EMAs, checkpoints and weight sync ask here and work the same for both.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rayflow.learner import full, lora


def weight_names(transformer: nn.Module) -> list[str]:
    """The weight sets a checkpoint holds ("default", and "old" / "ema" where the run keeps them)."""
    return full.weight_names(transformer) if full.is_full(transformer) else lora.adapter_names(transformer)


def named_weights(transformer: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """{canonical name: tensor} of weight set `name`: the adapter's LoRA parameters, or every transformer weight."""
    return full.named_weights(transformer, name) if full.is_full(transformer) else lora.adapter_parameters(transformer, name)


def using_weights(transformer: nn.Module, name: str) -> contextlib.AbstractContextManager:
    """Forward under weight set `name`, then back to "default" (the trainable split unchanged)."""
    return full.using_copy(transformer, name) if full.is_full(transformer) else lora.using_adapter(transformer, name)


def using_reference(transformer: nn.Module) -> contextlib.AbstractContextManager:
    """Forward under the KL reference, the base model: adapters disabled, or the frozen copy of the base weights."""
    return full.using_copy(transformer, full.BASE) if full.is_full(transformer) else lora.base_model(transformer)
