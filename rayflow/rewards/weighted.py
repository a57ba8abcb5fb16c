"""The run's total reward: a weighted sum of named reward functions, each component kept."""

from __future__ import annotations

import torch

from rayflow.config import RewardFnConfig
from rayflow.rewards.registry import make_reward
from rayflow.types import Trajectory


class WeightedReward:
    """reward = Σ weight_i · reward_i(images, prompts). Components are named by their reward name
    (with #k appended when a reward appears more than once)."""

    def __init__(self, functions: list[RewardFnConfig]):
        self.components: list[tuple[str, float, object]] = []
        for i, fn in enumerate(functions):
            name = fn.name if sum(f.name == fn.name for f in functions) == 1 else f"{fn.name}#{i}"
            self.components.append((name, fn.weight, make_reward(fn.name, **fn.kwargs)))

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """images [B, H, W, 3] uint8 -> (total [B], {component: [B]})."""
        parts = {name: fn(images, prompts).to(torch.float32) for name, _, fn in self.components}
        total = torch.zeros(len(prompts), dtype=torch.float32)
        for name, weight, _ in self.components:
            total += weight * parts[name]
        return total, parts

    def score(self, trajectories: list[Trajectory]) -> None:
        """Fill in .reward and .rewards of each trajectory from its image and prompt."""
        images = torch.stack([t.image for t in trajectories])
        total, parts = self(images, [t.prompt for t in trajectories])
        for i, t in enumerate(trajectories):
            t.reward = float(total[i])
            t.rewards = {name: float(values[i]) for name, values in parts.items()}
