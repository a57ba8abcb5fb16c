"""Folding a pushed adapter into the base weights, for sync.mode=merged (rollout engines without LoRA)."""

from __future__ import annotations

import torch

from rayflow.models.lora import TRAINED_ADAPTER, adapter_parameters, add_lora, merged_weights
from rayflow.models import load_model
from rayflow.models.synced import SyncedModelSpec
from rayflow.models.tiny import resolve_model_path
from rayflow.sync.receiver import load_weights


class AdapterFolder:
    """The base transformer with one LoRA slot shaped like the rollout adapter. Each call loads the
    pushed adapter into the slot and returns W + ΔW for every adapted linear (peft's merge), named as
    in the plain transformer."""

    def __init__(self, spec: SyncedModelSpec):
        m = spec.model
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        path = resolve_model_path(m.path, m.cache_dir, m.tiny_size, m.tiny_seed, m.tiny_arch)
        self.model = load_model(path, device=device, dtype=getattr(torch, m.dtype), transformer_only=True)
        add_lora(
            self.model.transformer,
            rank=spec.lora_rank,
            alpha=spec.lora_alpha,
            targets=spec.lora_targets or self.model.lora_target_modules,
            init=spec.lora_init,
        )

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        load_weights(adapter_parameters(self.model.transformer, TRAINED_ADAPTER), tensors)
        return merged_weights(self.model.transformer, TRAINED_ADAPTER)
