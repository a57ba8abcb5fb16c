"""The run's total reward: a weighted sum of named reward functions, each component kept."""

from __future__ import annotations

import torch

from rayflow.config import RewardFnConfig
from rayflow.rewards.registry import make_reward
from rayflow.types import Trajectory


def reward_inputs(trajectories: list[Trajectory]) -> tuple[torch.Tensor, list[str], list[dict]]:
    """What a reward sees of trajectories: images [B, H, W, 3] uint8, prompts, metadata."""
    images = torch.stack([t.image for t in trajectories])
    metadata = [{"prompt_id": t.prompt_id, "group_id": t.group_id, "seed": t.seed} for t in trajectories]
    return images, [t.prompt for t in trajectories], metadata


class WeightedReward:
    """reward = Σ weight_i · reward_i(images, prompts, metadata). Components are named by their reward
    name (with #k appended when a reward appears more than once)."""

    def __init__(self, functions: list[RewardFnConfig]):
        self.components: list[tuple[str, float, object]] = []
        for i, fn in enumerate(functions):
            name = fn.name if sum(f.name == fn.name for f in functions) == 1 else f"{fn.name}#{i}"
            self.components.append((name, fn.weight, make_reward(fn.name, **fn.kwargs)))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """images [B, H, W, 3] uint8 -> (total [B], {component: [B]})."""
        parts = {}
        for name, _, fn in self.components:
            values = torch.as_tensor(fn(images, prompts, metadata), dtype=torch.float32)
            if values.shape != (len(prompts),):
                raise ValueError(f"reward {name!r} returned shape {tuple(values.shape)} for {len(prompts)} images")
            parts[name] = values
        total = torch.zeros(len(prompts), dtype=torch.float32)
        for name, weight, _ in self.components:
            total += weight * parts[name]
        return total, parts

    def score(self, trajectories: list[Trajectory]) -> None:
        """Fill in .reward and .rewards of each trajectory from its image and prompt."""
        assign_rewards(trajectories, *self(*reward_inputs(trajectories)))


def assign_rewards(trajectories: list[Trajectory], total: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
    for i, t in enumerate(trajectories):
        t.reward = float(total[i])
        t.rewards = {name: float(values[i]) for name, values in parts.items()}
