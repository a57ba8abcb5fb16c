"""Per-component reward normalisation before the weighted sum (no Ray: the reference trainer and the
distributed driver both call `training_rewards` on the batch they compute advantages of).

With several rewards, GRPO's group normalisation acts on their sum, so the component with the larger
spread within a group decides the advantage and a harder reward with a small spread is drowned.
Normalising each component first gives each the weight the config says:

    none:   r_i                                    (the raw component)
    group:  (r_i − mean_g r_i) / (std_g r_i + eps)  over the G samples of the sample's group
    batch:  (r_i − mean r_i) / (std r_i + eps)      over the training batch

(population std, eps = 1e-4 as in the advantages), then total = Σ weight_i · normalised r_i. A group (or batch) whose
values are all equal normalises to exactly 0, as the advantages treat a flat group: float32's mean of equal values
can miss them by a rounding error, which dividing by eps would blow up to an offset of ~1e-3 that differs from one
value to the next, and the advantages would then rank flat groups by it.
"""

from __future__ import annotations

import torch

from rayflow.config import RewardFnConfig

NORMALIZE_MODES = ("none", "group", "batch")
_EPS = 1e-4


def component_names(functions: list[RewardFnConfig]) -> list[str]:
    """Each reward's component name: its reward name, with #index appended when a name repeats."""
    return [fn.name if sum(f.name == fn.name for f in functions) == 1 else f"{fn.name}#{i}"
            for i, fn in enumerate(functions)]


def normalize_component(values: torch.Tensor, group_ids: torch.Tensor, mode: str) -> torch.Tensor:
    """values [B] float32 of one component, normalised as `mode` says (see the module doc)."""
    if mode == "none":
        return values
    if mode == "batch":
        if values.max() == values.min():
            return torch.zeros_like(values)
        return (values - values.mean()) / (values.std(unbiased=False) + _EPS)
    if mode == "group":
        _, index = torch.unique(group_ids, return_inverse=True)
        n = int(index.max()) + 1
        count = torch.zeros(n).index_add_(0, index, torch.ones_like(values))
        centered = values - (torch.zeros(n).index_add_(0, index, values) / count)[index]
        flat = (torch.full((n,), -torch.inf).scatter_reduce(0, index, values, "amax")
                == torch.full((n,), torch.inf).scatter_reduce(0, index, values, "amin"))
        centered = torch.where(flat[index], 0.0, centered)
        std = (torch.zeros(n).index_add_(0, index, centered**2) / count).sqrt()
        return centered / (std[index] + _EPS)
    raise ValueError(f"reward normalize mode {mode!r}; allowed: {NORMALIZE_MODES}")


def training_rewards(trajectories: list, functions: list[RewardFnConfig]) -> tuple[torch.Tensor, dict[str, float]]:
    """(the [B] rewards advantages are computed from, {"reward/<component>/normalized": batch mean}).

    When no component is normalised these are the scored totals themselves (t.reward), so runs without
    normalisation are unchanged bit for bit."""
    names = component_names(functions)
    if all(fn.normalize == "none" for fn in functions):
        totals = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        return totals, {f"reward/{n}/normalized": float(torch.tensor([t.rewards[n] for t in trajectories]).mean())
                        for n in names}
    group_ids = torch.tensor([t.group_id for t in trajectories])
    totals = torch.zeros(len(trajectories), dtype=torch.float32)
    means = {}
    for name, fn in zip(names, functions):
        raw = torch.tensor([t.rewards[name] for t in trajectories], dtype=torch.float32)
        normalized = normalize_component(raw, group_ids, fn.normalize)
        totals += fn.weight * normalized
        means[f"reward/{name}/normalized"] = float(normalized.mean())
    return totals, means
