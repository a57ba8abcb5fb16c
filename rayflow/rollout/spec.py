"""RolloutRankSpec: what a rollout rank reads of a run's config, built from the root config in one place.

Apart from rank.py (the model code: diffusers, transformers, peft) so that the driver, which only builds and hands
on the spec, does not import the model code (2 s of CPU at start-up on 2 cores, beside the actors' own imports).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflow.cfg.policy import CFGPolicy, TrueCFG, guidance_policy
from rayflow.config import RayflowConfig
from rayflow.models.synced import SyncedModelSpec

APPLY_AT = ("step", "request")


@dataclass(frozen=True)
class RolloutRankSpec(SyncedModelSpec):
    """Everything a rollout rank needs to build itself; the same for every rank of every replica. The model and the
    shape of its synced weights are SyncedModelSpec's fields (what weight sync needs to know of a rank)."""

    policy: CFGPolicy = field(default_factory=TrueCFG)
    """The CFG policy requests sample under unless they name their own."""
    seed: int = 0
    """The run seed, set right before the LoRA slot is added so it starts equal to the learner's adapter."""
    threads: int = 1
    """torch intra-op threads of the rank."""
    collective_timeout_s: float = 300.0
    batch_branches: bool = False
    """A rank with several branches runs them in one batched forward (faster, not bit-exact)."""
    apply_at: str = "step"
    """Apply newly staged weights at the next denoising "step" boundary, or only between "request"s
    (from_config: async.partial_rollout true or false)."""
    sync_mode: str = "lora"
    """"lora": the rank holds a LoRA slot and receives adapters; "merged": no LoRA, it receives the
    weights of the adapted linears with the adapter folded in (train_mode "full": every transformer weight)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # The config has no apply_at (async.partial_rollout sets it): a spec written by hand is checked here.
        if self.apply_at not in APPLY_AT:
            raise ValueError(f"apply_at: got {self.apply_at!r}; allowed: {list(APPLY_AT)}")

    @classmethod
    def from_config(cls, config: RayflowConfig) -> "RolloutRankSpec":
        learner, rollout = config.learner, config.rollout
        return cls(
            model=config.model,
            policy=guidance_policy(config.cfg),
            lora_rank=learner.lora_rank,
            lora_alpha=learner.lora_alpha,
            lora_targets=tuple(learner.lora_targets) if learner.lora_targets else None,
            lora_init=learner.lora_init,
            seed=config.trainer.seed,
            threads=rollout.threads_per_rank,
            collective_timeout_s=rollout.collective_timeout_s,
            batch_branches=rollout.batch_branches,
            apply_at="step" if config.async_.partial_rollout else "request",
            sync_mode=config.sync.mode,
            train_mode=learner.train_mode,
        )
