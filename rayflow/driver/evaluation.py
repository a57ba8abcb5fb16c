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
        solver=trainer.eval_solver or sampling.solver,
    )


class Evaluator:
    def __init__(self, data: DataConfig, params: SamplingParams, train_prompts: list[str],
                 generate: Callable[[list[RolloutRequest], ray.ObjectRef | None], list[Trajectory]], rewards: RewardPool,
                 num_prompts: int = 4):
        """`data`: its eval_* keys; `params`: how to sample (`evaluation_params`); `generate(requests, weights)`:
        their trajectories in request order (the trainer's, under its deadlines)."""
        prompts = load_prompts(data.eval_prompts, data.max_prompt_chars) if data.eval_prompts else train_prompts[:num_prompts]
        # One request per prompt, seeds i·n .. i·n + n − 1 for prompt i (n = data.eval_seeds): the same images
        # every evaluation but for the weights.
        n = data.eval_seeds
        self.requests = [
            RolloutRequest(f"eval-{i}", [p] * n, [i] * n, [EVAL_GROUP_ID] * n, list(range(i * n, (i + 1) * n)), params)
            for i, p in enumerate(prompts)
        ]
        self.generate, self.rewards, self.seeds = generate, rewards, n

    def run(self, step: int, monitor: Monitor, weights: ray.ObjectRef | None = None) -> dict[str, float]:
        """`weights`: synced-slot tensors to sample under instead of the rollout weights (the EMA adapter)."""
        trajectories = self.generate(self.requests, weights)
        self.rewards.score(trajectories)
        scalars = {
            "eval/reward_mean": float(torch.tensor([t.reward for t in trajectories]).mean()),
            **{f"eval/{name}": float(torch.tensor([t.rewards[name] for t in trajectories]).mean())
               for name in trajectories[0].rewards},
        }
        monitor.log(step, scalars, advance=False)
        # With several seeds, one row per prompt and one column per seed (plot_run.py --grids labels the rows).
        columns = self.seeds if self.seeds > 1 else 4
        monitor.log_images(step, "eval/images", image_grid([t.image for t in trajectories], columns=columns))
        return scalars
