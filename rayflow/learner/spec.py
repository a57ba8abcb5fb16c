"""LearnerSpec: what a learner rank reads of a run's config, built from the root config in one place."""

from __future__ import annotations

from dataclasses import dataclass

from rayflow.cfg.policy import CFGPolicy, guidance_policy
from rayflow.checkpoint import checkpoint_root
from rayflow.config import AlgorithmConfig, LearnerConfig, ModelConfig, RayflowConfig


LEARNER_COLLECTIVE_TIMEOUT_S = 300.0
"""The learner group's collective timeout (its default process group, rayflow.learner.worker.LearnerWorker.setup)."""


@dataclass(frozen=True)
class LearnerSpec:
    """The policy model, how it trains and what it replays; the same for every learner rank (and the reference
    trainer's model and steps, which run the same code)."""

    model: ModelConfig
    learner: LearnerConfig
    algorithm: AlgorithmConfig
    policy: CFGPolicy
    """The guidance the rollouts sample under, which FlowGRPO's learner replays (the run's `cfg:` section)."""
    seed: int
    """trainer.seed: the LoRA init, the mini-batch plans and DiffusionNFT's noise draws."""
    ema_decay: float
    """trainer.ema_decay: the evaluation EMA "ema" of the trained weights (0: none)."""
    ema_every: int
    """trainer.ema_every: update "ema" after every this many optimizer steps."""
    ema_blends: int
    """trainer.ema_blends: blends per update of "ema" (flow_grpo's: one per micro-batch)."""
    checkpoint_dir: str
    """The run's checkpoints directory, under which learner.train_mode=full ranks stage their shards."""
    max_staleness: int
    """async.max_staleness: how many versions a prefetched rollout request may wait for its train step."""
    push_timeout_s: float = 150.0
    """How long learner rank 0 waits for the weight-sync actor to take its previous push before it reports the actor
    stalled (LearnerWorker.push_weights): the sync's timeout (rollout.collective_timeout_s), at most half the learner
    group's collective timeout (from_config)."""

    @classmethod
    def from_config(cls, config: RayflowConfig) -> "LearnerSpec":
        return cls(
            model=config.model,
            learner=config.learner,
            algorithm=config.algorithm,
            policy=guidance_policy(config.cfg),
            seed=config.trainer.seed,
            ema_decay=config.trainer.ema_decay,
            ema_every=config.trainer.ema_every,
            ema_blends=config.trainer.ema_blends,
            checkpoint_dir=checkpoint_root(config.trainer.run_dir),
            max_staleness=config.async_.max_staleness,
            # Rank 0 waits at the end of its train step while its peers go on into a step queued behind it
            # (asynchronous mode), whose first collective then waits for rank 0: waiting as long as their collective
            # timeout, or longer, failed them (the learners were blamed for the weight-sync actor's stall).
            push_timeout_s=min(config.rollout.collective_timeout_s, LEARNER_COLLECTIVE_TIMEOUT_S / 2),
        )
