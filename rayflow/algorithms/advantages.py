"""GRPO advantages: rewards normalised within each prompt's group (by prompt text across the batch,
by rollout group, or over the whole batch)."""

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


STAT_TRACKING = ("prompt", "group", "batch")


def stat_groups(trajectories: list, stat_tracking: str) -> torch.Tensor:
    """[B] integer group of each trajectory for the advantage statistics:
    "prompt": by prompt text, so two groups of one prompt in a batch share a mean and std (flow_grpo's and
    DiffusionNFT's PerPromptStatTracker, which groups the decoded prompts of the whole batch);
    "group": by rollout group (G samples of one draw of a prompt); "batch": the whole batch as one group
    (flow_grpo without per_prompt_stat_tracking)."""
    if stat_tracking == "prompt":
        index: dict[str, int] = {}
        return torch.tensor([index.setdefault(t.prompt, len(index)) for t in trajectories])
    if stat_tracking == "group":
        return torch.tensor([t.group_id for t in trajectories])
    if stat_tracking == "batch":
        return torch.zeros(len(trajectories), dtype=torch.int64)
    raise ValueError(f"stat_tracking: got {stat_tracking!r}; allowed: {list(STAT_TRACKING)}")


def assign_advantages(trajectories: list, *, global_std: bool, clip_max: float, stat_tracking: str = "group",
                      rewards: torch.Tensor | None = None) -> Advantages:
    """Compute GRPO advantages of scored trajectories (grouped as `stat_tracking` says) and store them on each.
    `rewards`: [B] the rewards to use (e.g. per-component normalised totals); default each t.reward."""
    if rewards is None:
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    adv = grpo_advantages(rewards, stat_groups(trajectories, stat_tracking), global_std=global_std, clip_max=clip_max)
    for t, a in zip(trajectories, adv.values.tolist()):
        t.advantage = a
    return adv
