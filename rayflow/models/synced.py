"""SyncedModelSpec: the model every rollout rank holds and the shape of the weights the learners sync into it.

Weight sync (rayflow.sync) needs this much of a rollout rank and no more: the folding actor of sync.mode=merged
builds the same model with the same LoRA slot. rayflow.rollout.RolloutRankSpec extends it with how a rank samples.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflow.config import ModelConfig
from rayflow.config.sections import TRAIN_MODES
from rayflow.models.base import DiffusionModel
from rayflow.models.lora import add_lora


@dataclass(frozen=True)
class SyncedModelSpec:
    model: ModelConfig
    """The base model (path, dtype, tiny twin) every rollout rank loads."""
    lora_rank: int = 8
    """Rank of the LoRA slot the learners' adapter is synced into (learner.lora_rank)."""
    lora_alpha: float = 8.0
    """LoRA scaling numerator (learner.lora_alpha)."""
    lora_targets: tuple[str, ...] | None = None
    """Adapted modules; None: the model's attention projections (as the learner's default)."""
    lora_init: str = "gaussian"
    """Initialisation of the slot's A matrices (learner.lora_init)."""
    train_mode: str = "lora"
    """The learners' learner.train_mode: "full" trains, and so syncs, every transformer weight."""

    def __post_init__(self) -> None:
        if self.train_mode not in TRAIN_MODES:
            raise ValueError(f"train_mode: got {self.train_mode!r}; allowed: {list(TRAIN_MODES)}")

    def add_lora_slot(self, model: DiffusionModel) -> None:
        """Give `model` the LoRA slot the learners' adapter is synced into, shaped as theirs ("default"; targets: the
        model's attention projections unless lora_targets names others)."""
        add_lora(model.transformer, rank=self.lora_rank, alpha=self.lora_alpha,
                 targets=self.lora_targets or model.lora_target_modules, init=self.lora_init)

    def synced_model(self) -> "SyncedModelSpec":
        """These fields alone (a subclass's extra fields dropped): what crosses to the weight-sync actor."""
        return SyncedModelSpec(self.model, self.lora_rank, self.lora_alpha, self.lora_targets, self.lora_init,
                               self.train_mode)
