"""The run's total reward: a weighted sum of named reward functions, each component kept."""

from __future__ import annotations

import inspect

import torch

from rayflow.config import RewardFnConfig
from rayflow.rewards.normalize import component_names
from rayflow.rewards.registry import RESERVED_NAMES, RewardOutput, make_reward, reward_factory
from rayflow.types import Trajectory


def reward_inputs(trajectories: list[Trajectory]) -> tuple[torch.Tensor, list[str], list[dict]]:
    """What a reward sees of trajectories: images [B, H, W, 3] uint8, prompts, metadata."""
    images = torch.stack([t.image for t in trajectories])
    metadata = [{"prompt_id": t.prompt_id, "group_id": t.group_id, "seed": t.seed} for t in trajectories]
    return images, [t.prompt for t in trajectories], metadata


class WeightedReward:
    """reward = Σ weight_i · reward_i(images, prompts, metadata). Components are named by their reward
    name (with #k appended when a reward appears more than once)."""

    def __init__(self, functions: list[RewardFnConfig], max_outage_s: float = 0.0):
        """max_outage_s: reward.max_outage_s, given to the rewards that take it (those calling a server)
        unless their kwargs set it."""
        self.components: list[tuple[str, float, object]] = [
            (name, fn.weight, make_reward(fn.name, **with_outage_budget(fn, max_outage_s)))
            for name, fn in zip(component_names(functions), functions)
        ]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """images [B, H, W, 3] uint8 -> (total [B], {component or metric: [B]}). The metrics a reward reports
        (RewardOutput) are in the dict beside the components, and not in the total."""
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[-1] != 3 or len(images) != len(prompts):
            raise ValueError(f"reward images: got {images.dtype} of shape {tuple(images.shape)} for {len(prompts)} "
                             f"prompts; allowed: uint8 [B, H, W, 3], one image per prompt (a model's decode returns "
                             f"them so)")
        parts, metrics, reported_by = {}, {}, {}
        for name, _, fn in self.components:
            out = fn(images, prompts, metadata)
            if isinstance(out, RewardOutput):
                for metric, values in out.metrics.items():
                    values = _checked(f"{name}'s metric {metric}", values, prompts)
                    # The same metric twice is fine (shapes listed with two scores: one accuracy); two different not.
                    if metric in metrics and not torch.equal(metrics[metric], values):
                        raise ValueError(f"reward metric {metric!r} is reported by {reported_by[metric]!r} and by "
                                         f"{name!r} with other values: one would be logged over the other; rename one")
                    metrics[metric], reported_by[metric] = values, name
                out = out.scores
            parts[name] = _checked(name, out, prompts)
        # Each is logged as reward/<name>, beside reward/mean, reward/std and reward/<component>/normalized.
        clash = sorted(m for m in metrics if m in parts or m in RESERVED_NAMES or m.endswith("/normalized"))
        if clash:
            raise ValueError(f"reward metrics {clash} would be logged over the reward's own scalars (a component's name, "
                             f"one of {list(RESERVED_NAMES)}, or a name ending in '/normalized'); rename the metrics")
        total = torch.zeros(len(prompts), dtype=torch.float32)
        for name, weight, _ in self.components:
            total += weight * parts[name]
        return total, {**parts, **metrics}

    def score(self, trajectories: list[Trajectory]) -> None:
        """Fill in .reward and .rewards of each trajectory from its image and prompt."""
        assign_rewards(trajectories, *self(*reward_inputs(trajectories)))


def _checked(name: str, values, prompts: list[str]) -> torch.Tensor:
    """`values` as [B] float32, or a ValueError naming the reward when its shape or values are wrong."""
    values = torch.as_tensor(values, dtype=torch.float32)
    if values.shape != (len(prompts),):
        raise ValueError(f"reward {name!r} returned shape {tuple(values.shape)} for {len(prompts)} images")
    if not torch.isfinite(values).all():
        raise ValueError(f"reward {name!r} returned non-finite values {values.tolist()} for prompts "
                         f"{sorted(set(prompts))[:3]}; a reward must be a finite number for every image")
    return values


def with_outage_budget(fn: RewardFnConfig, max_outage_s: float) -> dict:
    """The reward's kwargs, with max_outage_s added where its factory takes it and the kwargs do not set it."""
    if "max_outage_s" in fn.kwargs or "max_outage_s" not in inspect.signature(reward_factory(fn.name)).parameters:
        return fn.kwargs
    return {**fn.kwargs, "max_outage_s": max_outage_s}


def assign_rewards(trajectories: list[Trajectory], total: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
    for i, t in enumerate(trajectories):
        t.reward = float(total[i])
        t.rewards = {name: float(values[i]) for name, values in parts.items()}
