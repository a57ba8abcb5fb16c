"""Folding a pushed adapter into the base weights, for sync.mode=merged (rollout engines without LoRA)."""

from __future__ import annotations

import torch

from rayflow.distributed.placement import uses_cuda
from rayflow.models import load_configured
from rayflow.models.lora import TRAINED_ADAPTER, adapter_parameters, merged_weights
from rayflow.models.synced import SyncedModelSpec
from rayflow.sync.receiver import load_weights


class AdapterFolder:
    """The base transformer with one LoRA slot shaped like the rollout adapter. Each call loads the
    pushed adapter into the slot and returns W + ΔW for every adapted linear (peft's merge), named as
    in the plain transformer."""

    def __init__(self, spec: SyncedModelSpec):
        device = torch.device("cuda" if uses_cuda() else "cpu")
        self.model = load_configured(spec.model, device, transformer_only=True)
        spec.add_lora_slot(self.model)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        load_weights(adapter_parameters(self.model.transformer, TRAINED_ADAPTER), tensors)
        return merged_weights(self.model.transformer, TRAINED_ADAPTER)
