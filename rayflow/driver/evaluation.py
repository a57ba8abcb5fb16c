"""Evaluation between training steps: deterministic (ODE) samples of fixed prompts and seeds under the
current rollout weights (or the EMA of trainer.ema_decay), their mean reward and the mean of each reward component
and metric (eval/<name>, e.g. eval/shapes_accuracy), and an image grid, logged as eval/*."""

from __future__ import annotations

import dataclasses
from typing import Callable

import ray
import torch

from rayflow.config import DataConfig
from rayflow.data.prompts import load_prompts
from rayflow.logging.monitor import Monitor, image_grid
from rayflow.rewards.worker import RewardPool
from rayflow.types import RolloutRequest, SamplingParams, Trajectory

EVAL_GROUP_ID = -1
"""Evaluation samples never enter the training queue; their group id says so."""


class Evaluator:
    def __init__(self, data: DataConfig, sampling: SamplingParams, train_prompts: list[str],
                 generate: Callable[[list[RolloutRequest], ray.ObjectRef | None], list[Trajectory]], rewards: RewardPool,
                 num_prompts: int = 4):
        """`data`: its eval_* keys; `sampling`: the run's, evaluated as ODE; `generate(requests, weights)`: their
        trajectories in request order (the trainer's, under its deadlines)."""
        prompts = load_prompts(data.eval_prompts, data.max_prompt_chars) if data.eval_prompts else train_prompts[:num_prompts]
        T = sampling.num_steps
        params = dataclasses.replace(sampling, sde_type="ode", sde_step_indices=None, return_step_indices=[T])
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
