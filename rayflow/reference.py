"""The single-process reference trainer: FlowGRPO or DiffusionNFT on one DiffusionModel, LoRA or full fine-tuning.

No Ray, no process groups: the oracle the distributed system is checked against (same config
and seeds → same rewards, losses and LoRA). It is the whole run, so it keeps the whole RayflowConfig; its model
and steps take the learners' LearnerSpec, built from it. One step reads top to bottom:

    groups → rollout (under the rollout adapter) → rewards → advantages → loss/backward → optimizer step → checkpoint

It checkpoints every trainer.save_every steps (and at the end) under <trainer.output_dir>/<trainer.run_name>/checkpoints
and, with trainer.resume=auto and the same run_name, continues from the newest one, bit-identically to a run never stopped.

    python -m rayflow.reference --config recipes/flowgrpo_tiny.yaml trainer.total_steps=20
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass, field

import torch

from rayflow.algorithms.advantages import Advantages, assign_advantages
from rayflow.checkpoint import (
    Checkpoint, base_model_record, checkpoint_root, is_save_step, load_checkpoint, resolve_resume, save_checkpoint,
    sharded_staging_dir,
)
from rayflow.config import RayflowConfig, load_config
from rayflow.errors import ConfigError
from rayflow.runs import USER_ERRORS, RunComplete, preflight, write_run_config
from rayflow.data.prompts import GroupSampler, load_prompts
from rayflow.models.lora import rollout_adapter_name
from rayflow.learner.model import add_full_weight_copies, load_policy_model, policy_identity
from rayflow.learner.minibatches import BatchResult, learner_batch, minibatch_plan, train_batch
from rayflow.learner.optim import SkippedSteps, build_optimizer
from rayflow.learner.spec import LearnerSpec
from rayflow.learner.sharded import capture_trained, restore_trained
from rayflow.models.weight_sets import using_weights
from rayflow.models import DiffusionModel
from rayflow.rewards.normalize import training_rewards
from rayflow.rewards.weighted import WeightedReward
from rayflow.rng import get_rng_state, set_rng_state
from rayflow.sampling.denoise import generate
from rayflow.sampling.window import window_params
from rayflow.types import RolloutRequest, Trajectory


@dataclass
class StepLog:
    step: int
    reward_mean: float
    reward_std: float
    loss: float
    grad_norm: float
    skipped: bool
    zero_signal_groups: int
    seconds: float
    rollout_seconds: float
    """Of `seconds`, sampling, scoring and the advantages; the rest is learning."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Run:
    """The reference trainer's state: model, optimizer and everything the loop draws from."""

    cfg: RayflowConfig
    spec: LearnerSpec
    """What the model and its training read of cfg (as a learner rank's)."""
    model: DiffusionModel
    optimizer: torch.optim.Optimizer
    reward: WeightedReward
    sampler: GroupSampler
    identity: dict
    """policy_identity: what checkpoints of this run record and require."""
    skips: SkippedSteps
    """Skipped optimizer steps; stops the run at trainer.max_skipped_steps in a row."""
    step: int = 0
    """Batches trained (= the policy version; algorithm.steps_per_batch optimizer steps each)."""
    checkpointed_step: int = 0
    """The step of the checkpoint this run saved last or resumed from (0: none): the checkpoints after it that are not
    its own are of a timeline it left (save_checkpoint's previous_step)."""
    pending: list[int] = field(default_factory=list)
    """Prompt groups drawn before a checkpoint but not trained on (a distributed run's checkpoint lists them): the
    next batches take them first, as that run would have."""


def build_run(cfg: RayflowConfig) -> Run:
    spec = LearnerSpec.from_config(cfg)
    model = load_policy_model(spec)
    add_full_weight_copies(spec, model.transformer)
    return Run(
        cfg=cfg,
        spec=spec,
        model=model,
        # Before any training: the fingerprint reads the base weights.
        identity=policy_identity(spec, model),
        optimizer=build_optimizer(model.transformer, cfg.learner),
        reward=WeightedReward(cfg.reward.functions, cfg.reward.max_outage_s),
        sampler=GroupSampler(load_prompts(cfg.data.prompts, cfg.data.max_prompt_chars), cfg.algorithm.group_size, cfg.trainer.seed, cfg.data.shuffle),
        skips=SkippedSteps(cfg.trainer.max_skipped_steps),
    )


def next_requests(run: Run) -> list[RolloutRequest]:
    """The rollout requests of the next batch's prompt groups."""
    cfg = run.cfg
    taken, run.pending = run.pending[: cfg.algorithm.prompts_per_step], run.pending[cfg.algorithm.prompts_per_step :]
    groups = [run.sampler.group(gid) for gid in taken]
    groups += [run.sampler.next_group() for _ in range(cfg.algorithm.prompts_per_step - len(groups))]
    sampling = window_params(cfg.sampling, cfg.trainer.seed, run.step)
    return [r for g in groups for r in g.requests(sampling, cfg.rollout.micro_batch_size)]


def sample(run: Run, request: RolloutRequest) -> list[Trajectory]:
    """One request sampled under the rollout adapter (DiffusionNFT: the EMA "old" one)."""
    with using_weights(run.model.transformer, rollout_adapter_name(run.cfg.algorithm.needs_ema_rollout)):
        return generate(run.model, request, run.spec.policy, version=run.step)


def assign(run: Run, trajectories: list[Trajectory]) -> Advantages:
    """Advantages of scored trajectories, from their normalised reward components."""
    algo = run.cfg.algorithm
    totals, _ = training_rewards(trajectories, run.cfg.reward.functions)
    return assign_advantages(trajectories, global_std=algo.global_std, clip_max=algo.adv_clip_max,
                             stat_tracking=algo.stat_tracking, rewards=totals)


def rollout(run: Run) -> tuple[list[Trajectory], Advantages]:
    """The next groups, sampled under the rollout adapter, scored, with advantages assigned."""
    trajectories = [t for r in next_requests(run) for t in sample(run, r)]
    run.reward.score(trajectories)
    return trajectories, assign(run, trajectories)


def learn(run: Run, trajectories: list[Trajectory]) -> tuple[dict[str, float], BatchResult]:
    """The batch's optimizer steps (algorithm.num_inner_epochs x num_minibatches), then version + 1."""
    if run.cfg.learner.mixed_precision != "none":
        # The learner's fp32 masters and bf16 compute are FSDP2's and autocast's (rayflow.learner.backend); trained
        # here in model.dtype instead, a run would differ from the learner's while claiming to be its reference.
        raise ConfigError("learner.mixed_precision", run.cfg.learner.mixed_precision,
                          "'none' for the single-process reference trainer, which trains in model.dtype")
    algo = run.cfg.algorithm
    trajectories, filtered = learner_batch(trajectories, run.spec, run.step)
    plan = minibatch_plan(len(trajectories), run.cfg.trainer.seed, run.step, algo.num_inner_epochs, algo.num_minibatches)
    steps = [[trajectories[i] for i in indices] for indices in plan]
    metrics, result = train_batch(run.spec, run.model, run.optimizer, run.spec.policy, steps, version=run.step)
    run.step += 1
    return {**metrics, "train/filtered_samples": float(filtered)}, result


def save(run: Run) -> str:
    root = checkpoint_root(run.cfg.trainer.run_dir)
    shards = sharded_staging_dir(root, run.step) if run.cfg.learner.train_mode == "full" else None
    ckpt = Checkpoint(
        step=run.step, version=run.step, identity=run.identity,
        **capture_trained(run.model.transformer, run.optimizer, shards),
        rng={"driver": get_rng_state()}, data=run.sampler.state_dict(), counters=run.skips.counters(),
        base_model=base_model_record(run.cfg.model),
    )
    path = save_checkpoint(root, ckpt, run.cfg.trainer.keep_checkpoints, previous_step=run.checkpointed_step)
    run.checkpointed_step = run.step
    return path


def resume(run: Run, path: str) -> None:
    """Continue from a checkpoint; refused if it was written for another model, LoRA, train mode or algorithm."""
    ckpt = load_checkpoint(path, run.identity)
    restore_trained(run.model.transformer, run.optimizer, vars(ckpt))
    run.sampler.load_state_dict(ckpt.data)
    run.pending = list(ckpt.data.get("pending_groups", []))
    set_rng_state(ckpt.rng["driver"])
    run.skips.load(ckpt.counters)
    run.step = run.checkpointed_step = ckpt.step


def train(cfg: RayflowConfig, log=print) -> tuple[DiffusionModel, list[StepLog]]:
    """Run (or continue) the configured training; returns the model and the log of the steps run here."""
    run = build_run(cfg)
    resume_from = resolve_resume(cfg.trainer.resume, checkpoint_root(cfg.trainer.run_dir))
    if resume_from is not None:
        resume(run, resume_from)
        log(f"resumed from {resume_from} (step {run.step})")
    history = []
    while run.step < cfg.trainer.total_steps:
        start = time.perf_counter()
        trajectories, adv = rollout(run)
        rolled_out = time.perf_counter()
        metrics, result = learn(run, trajectories)
        rewards = torch.tensor([t.reward for t in trajectories])
        entry = StepLog(
            step=run.step - 1,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std(unbiased=False)),
            loss=metrics["loss/policy"] + cfg.algorithm.kl_beta * metrics["loss/kl"],
            grad_norm=result.grad_norm,
            skipped=result.skipped_steps > 0,
            zero_signal_groups=adv.zero_signal_groups,
            seconds=time.perf_counter() - start,
            rollout_seconds=rolled_out - start,
            metrics=metrics,
        )
        history.append(entry)
        log(
            f"step {entry.step:4d}  reward {entry.reward_mean:.4f} ± {entry.reward_std:.4f}  loss {entry.loss:+.5f}  "
            f"grad_norm {entry.grad_norm:.4f}{'  (skipped)' if entry.skipped else ''}  {entry.seconds:.2f}s"
        )
        run.skips.observe(result.skipped_steps, entry.step, cfg.algorithm.steps_per_batch, result.skip_runs)
        if is_save_step(run.step, cfg.trainer.save_every, cfg.trainer.total_steps):
            log(f"saved {save(run)}")
    return run.model, history


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a recipe YAML")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. trainer.total_steps=3")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        _, plan = preflight(cfg)
        write_run_config(cfg, plan.inputs)
    except RunComplete as e:
        print(e)
        return
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    torch.set_num_threads(max(1, cfg.learner.threads_per_rank))
    try:
        train(cfg)
    except USER_ERRORS as e:  # a setting only the model can check (learner.lora_targets naming no module): one line
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
