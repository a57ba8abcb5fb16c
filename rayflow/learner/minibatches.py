"""Inner epochs and mini-batches: how one trained batch becomes several optimizer steps.

flow_grpo's `train.num_inner_epochs` passes over each epoch's samples, each pass shuffled and cut
into mini-batches, one optimizer step per mini-batch; later mini-batches train off-policy, which is
where the PPO clip acts. The plan is a pure function of (run seed, version, batch size), so the
reference trainer and every learner rank cut the same mini-batches, and a resumed run cuts them again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from rayflow.algorithms.diffusion_nft import ema_step
from rayflow.cfg.policy import CFGPolicy
from rayflow.learner.spec import LearnerSpec
from rayflow.learner.objective import backward
from rayflow.learner.optim import SkipRuns, optimizer_step, update_eval_ema, update_rollout_ema
from rayflow.distributed.parallelize import reshard
from rayflow.models import DiffusionModel
from rayflow.rng import keyed_generator
from rayflow.types import Trajectory


def minibatch_plan(batch_size: int, run_seed: int, version: int, num_inner_epochs: int, num_minibatches: int
                   ) -> list[list[int]]:
    """Indices into the batch of each optimizer step, in order: for each inner epoch, a permutation of
    range(batch_size) drawn from (run seed, version, "minibatch", epoch), cut into num_minibatches equal slices.

    One inner epoch and one mini-batch keep the batch in its order (no draw): the single-step
    behaviour, unchanged."""
    if batch_size % num_minibatches:
        raise ValueError(f"a batch of {batch_size} does not split into {num_minibatches} equal mini-batches")
    size = batch_size // num_minibatches
    if num_inner_epochs == 1 and num_minibatches == 1:
        return [list(range(batch_size))]
    plan = []
    for epoch in range(num_inner_epochs):
        g = keyed_generator(run_seed, version, "minibatch", epoch)  # not (.., epoch): a sample of seed `epoch` draws its NFT noise there
        order = torch.randperm(batch_size, generator=g).tolist()
        plan += [order[i : i + size] for i in range(0, batch_size, size)]
    return plan


def trained_subset(advantages: list[float], unit: int, run_seed: int, version: int) -> list[int]:
    """FlowGRPO's learner batch: the indices of samples with a non-zero advantage (a zero one adds no policy
    gradient, only dilutes the mean), plus as few zero-advantage samples as make the count a positive
    multiple of `unit` (num_minibatches x learner ranks), drawn from (run seed, version) — flow_grpo's
    train_sd3.py filter, which tops the kept count up to a multiple of its mini-batches the same way."""
    keep = [i for i, a in enumerate(advantages) if a != 0]
    zeros = [i for i, a in enumerate(advantages) if a == 0]
    short = (-len(keep)) % unit if keep else unit
    g = keyed_generator(run_seed, version, "zero-advantage")
    added = [zeros[i] for i in torch.randperm(len(zeros), generator=g)[:short].tolist()] if short else []
    return sorted(keep + added)


def learner_batch(batch: list, spec: LearnerSpec, version: int) -> tuple[list, int]:
    """The part of a scored batch (advantages assigned) the learners train on, and how many samples were
    left out: FlowGRPO drops zero-advantage samples (`trained_subset`); DiffusionNFT keeps them all (A = 0
    still pulls toward r = ½, as in DiffusionNFT, which does not filter).

    Runs on the driver (the trainer's loop and the reference trainer)."""
    if spec.algorithm.name != "flow_grpo":
        return batch, 0
    unit = spec.algorithm.num_minibatches * spec.learner.world_size
    kept = trained_subset([t.advantage for t in batch], unit, spec.seed, version)
    return [batch[i] for i in kept], len(batch) - len(kept)


def pass_index(version: int, epoch: int, num_inner_epochs: int) -> int:
    """The index of one pass over the data (version·num_inner_epochs + epoch): what per-pass draws
    (DiffusionNFT's noise and timesteps) are keyed by, so each inner epoch draws afresh; with one
    inner epoch it is the version."""
    return version * num_inner_epochs + epoch


@dataclass
class BatchResult:
    grad_norm: float
    """Mean over the batch's optimizer steps of the global gradient norm (before clipping)."""
    skipped_steps: int
    """Steps of the batch skipped because the norm was not finite."""
    skip_runs: SkipRuns
    """Where in the batch they lie (trainer.max_skipped_steps counts optimizer steps in a row, across batches)."""
    ema_decay: float
    """η of the batch's "old" EMA update (DiffusionNFT; 0 otherwise)."""


def train_batch(spec: LearnerSpec, model: DiffusionModel, optimizer: torch.optim.Optimizer, policy: CFGPolicy,
                steps: list[list[Trajectory]], version: int, passes: list[int] | None = None
                ) -> tuple[dict[str, float], BatchResult]:
    """Train one batch (version `version`): per entry of `steps` (this process's trajectories of one
    planned mini-batch, in plan order) accumulate its gradients, then one optimizer step (and, with
    trainer.ema_decay, an update of "ema"); then, for DiffusionNFT, one EMA update of "old".
    `passes`: per entry, the forward/backward passes to run (FSDP2 ranks: the most any rank needs; None: its own).

    Returns the metrics averaged over the steps, and the batch's result. Old log-probs stay the rollout's:
    every mini-batch's ratio is taken against the policy that sampled it, as in flow_grpo."""
    algo = spec.algorithm
    metrics: dict[str, float] = defaultdict(float)
    results = []
    for i, shard in enumerate(steps):
        step_metrics = backward(spec, model, policy, shard, pass_index(version, i // algo.num_minibatches, algo.num_inner_epochs),
                                None if passes is None else passes[i])
        reshard(model.transformer)
        results.append(optimizer_step(model.transformer, optimizer, spec.learner))
        if spec.ema_decay > 0:
            update_eval_ema(model.transformer, spec.ema_decay, spec.ema_every, version * len(steps) + i + 1,
                            spec.ema_blends)
        for name, value in step_metrics.items():
            metrics[name] += value / len(steps)
    eta = 0.0
    if algo.needs_ema_rollout:
        eta = update_rollout_ema(model.transformer, algo, ema_step(version, len(steps)))
    return dict(metrics), BatchResult(
        grad_norm=sum(r.grad_norm for r in results) / len(results),
        skipped_steps=sum(r.skipped for r in results),
        skip_runs=SkipRuns.of([r.skipped for r in results]),
        ema_decay=eta,
    )
