"""GRPO advantages: rewards normalised within each prompt's group."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    values: torch.Tensor
    """[B] float32 advantages, clipped to +-clip_max."""
    num_groups: int
    zero_signal_groups: int
    """Groups whose rewards are all equal: their advantages are exactly 0 and teach nothing."""


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    global_std: bool = False,
    clip_max: float = 5.0,
    eps: float = 1e-4,
) -> Advantages:
    """A = (r − mean of r over the sample's group) / (std + eps), clipped to ±clip_max.

    Args:
        rewards: [B] rewards.
        group_ids: [B] integer group of each sample (the G samples of one prompt share one).
        global_std: divide by the (population) std over the whole batch instead of the group's.
    """
    rewards = rewards.to(torch.float32)
    groups, index = torch.unique(group_ids, return_inverse=True)  # index: [B] in 0..num_groups-1
    n = len(groups)
    count = torch.zeros(n).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(n).index_add_(0, index, rewards) / count
    centered = rewards - mean[index]
    group_var = torch.zeros(n).index_add_(0, index, centered**2) / count
    std = rewards.std(unbiased=False).expand(n) if global_std else group_var.sqrt()
    advantages = (centered / (std[index] + eps)).clamp(-clip_max, clip_max)
    # Equal rewards give exactly zero signal; make that exact despite rounding in the mean.
    group_max = torch.full((n,), -torch.inf).scatter_reduce(0, index, rewards, "amax")
    group_min = torch.full((n,), torch.inf).scatter_reduce(0, index, rewards, "amin")
    flat = group_max == group_min
    advantages = torch.where(flat[index], torch.zeros_like(advantages), advantages)
    return Advantages(values=advantages, num_groups=n, zero_signal_groups=int(flat.sum()))


def assign_advantages(trajectories: list, *, global_std: bool, clip_max: float) -> Advantages:
    """Compute GRPO advantages of scored trajectories (grouped by group_id) and store them on each."""
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    groups = torch.tensor([t.group_id for t in trajectories])
    adv = grpo_advantages(rewards, groups, global_std=global_std, clip_max=clip_max)
    for t, a in zip(trajectories, adv.values.tolist()):
        t.advantage = a
    return adv
