"""The policy's weight sets, whichever learner.train_mode built it: "default" (trained), "old" (DiffusionNFT's
EMA), "ema" (trainer.ema_decay's EMA) and the KL reference. LoRA keeps them as peft adapters
(rayflow.models.lora), full fine-tuning as whole-weight copies (rayflow.models.weight_copies); the objective, the
optimizer's EMAs, checkpoints and weight sync ask here and work the same for both.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rayflow.models import lora
from rayflow.models import weight_copies


def weight_names(transformer: nn.Module) -> list[str]:
    """The weight sets a checkpoint holds ("default", and "old" / "ema" where the run keeps them)."""
    return weight_copies.weight_names(transformer) if weight_copies.is_full(transformer) else lora.adapter_names(transformer)


def named_weights(transformer: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """{canonical name: tensor} of weight set `name`: the adapter's LoRA parameters, or every transformer weight."""
    return weight_copies.named_weights(transformer, name) if weight_copies.is_full(transformer) else lora.adapter_parameters(transformer, name)


def using_weights(transformer: nn.Module, name: str) -> contextlib.AbstractContextManager:
    """Forward under weight set `name`, then back to "default" (the trainable split unchanged)."""
    return weight_copies.using_copy(transformer, name) if weight_copies.is_full(transformer) else lora.using_adapter(transformer, name)


def using_reference(transformer: nn.Module) -> contextlib.AbstractContextManager:
    """Forward under the KL reference, the base model: adapters disabled, or the frozen copy of the base weights."""
    return weight_copies.using_copy(transformer, weight_copies.BASE) if weight_copies.is_full(transformer) else lora.base_model(transformer)
