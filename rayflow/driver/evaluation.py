"""Evaluation between training steps: deterministic (ODE) samples of fixed prompts and seeds (the rollouts'
sampling, or trainer.eval_num_steps / eval_guidance_scale / eval_solver) under the current rollout weights (or
the EMA of trainer.ema_decay), their mean reward and the mean of each reward component and metric
(eval/<name>, e.g. eval/shapes_accuracy), and an image grid, logged as eval/*."""

from __future__ import annotations

import dataclasses
from typing import Callable

import ray
import torch

from rayflow.config import DataConfig, TrainerConfig
from rayflow.data.prompts import load_prompts
from rayflow.logging.monitor import Monitor, image_grid
from rayflow.rewards.worker import RewardPool
from rayflow.types import RolloutRequest, SamplingParams, Trajectory

EVAL_GROUP_ID = -1
"""Evaluation samples never enter the training queue; their group id says so."""


def evaluation_params(sampling: SamplingParams, trainer: TrainerConfig) -> SamplingParams:
    """How evaluation samples: the run's sampling as a deterministic ODE that keeps only the final latent, with
    trainer.eval_num_steps, eval_guidance_scale and eval_solver where they are set (flow_grpo's and DiffusionNFT's
    sample.eval_* keys: their recipes roll out with 10 steps and evaluate with 40)."""
    T = trainer.eval_num_steps or sampling.num_steps
    return dataclasses.replace(
        sampling, sde_type="ode", sde_step_indices=None, sde_window_size=None, sde_window_range=None,
        num_steps=T, return_step_indices=[T],
        guidance_scale=sampling.guidance_scale if trainer.eval_guidance_scale is None else trainer.eval_guidance_scale,
        solver=trainer.eval_solver or sampling.solver, same_initial_noise=False,
    )


def evaluation_prompts(data: DataConfig, train_prompts: list[str], num_prompts: int = 4) -> list[str]:
    """data.eval_prompts' prompts, or the first `num_prompts` training prompts when it is null."""
    return load_prompts(data.eval_prompts, data.max_prompt_chars, key="data.eval_prompts") if data.eval_prompts else train_prompts[:num_prompts]


def evaluation_requests(prompts: list[str], seeds: int, params: SamplingParams, first_seed: int = 0
                        ) -> list[RolloutRequest]:
    """One request per prompt: prompt i gets seeds f + i·n .. f + i·n + n − 1 (n = `seeds`, f = `first_seed`), the same
    images every evaluation but for the weights. Re-evaluated with the run's n (and f = 0), they are the run's images;
    with another n, other seeds. A run's evaluation has f = 0, so with trainer.seed=0, whose training seeds count up
    from 0 (GroupSampler), its first steps start from the evaluation's initial noises (tools/evaluate.py --first-seed
    evaluates on noises no training step drew)."""
    return [RolloutRequest(f"eval-{i}", [p] * seeds, [i] * seeds, [EVAL_GROUP_ID] * seeds,
                           list(range(first_seed + i * seeds, first_seed + (i + 1) * seeds)), params)
            for i, p in enumerate(prompts)]


def evaluation_scalars(trajectories: list[Trajectory]) -> dict[str, float]:
    """eval/reward_mean and eval/<name> for every reward component and metric: means over the scored trajectories."""
    return {
        "eval/reward_mean": float(torch.tensor([t.reward for t in trajectories]).mean()),
        **{f"eval/{name}": float(torch.tensor([t.rewards[name] for t in trajectories]).mean())
           for name in trajectories[0].rewards},
    }


class Evaluator:
    def __init__(self, data: DataConfig, params: SamplingParams, train_prompts: list[str],
                 generate: Callable[[list[RolloutRequest], ray.ObjectRef | None], list[Trajectory]], rewards: RewardPool,
                 num_prompts: int = 4):
        """`data`: its eval_* keys; `params`: how to sample (`evaluation_params`); `generate(requests, weights)`:
        their trajectories in request order (the trainer's, under its deadlines)."""
        prompts = evaluation_prompts(data, train_prompts, num_prompts)
        n = data.eval_seeds
        self.requests = evaluation_requests(prompts, n, params)
        self.generate, self.rewards, self.seeds = generate, rewards, n

    def run(self, step: int, monitor: Monitor, weights: ray.ObjectRef | None = None) -> dict[str, float]:
        """`weights`: synced-slot tensors to sample under instead of the rollout weights (the EMA adapter). Otherwise
        every request waits for the rollout weights of version `step` (an asynchronous run's step ends before the
        broadcast of its weights has landed; the trainer waits for that broadcast first, within the sync's deadline)."""
        requests = self.requests if weights is not None else [dataclasses.replace(r, min_version=step) for r in self.requests]
        trajectories = self.generate(requests, weights)
        self.rewards.score(trajectories)
        scalars = evaluation_scalars(trajectories)
        monitor.log(step, scalars, advance=False)
        # With several seeds, one row per prompt and one column per seed (plot_run.py --grids labels the rows).
        columns = self.seeds if self.seeds > 1 else 4
        monitor.log_images(step, "eval/images", image_grid([t.image for t in trajectories], columns=columns))
        return scalars
