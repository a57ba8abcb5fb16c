"""Adapter and optimizer state as full tensors by canonical name, whether parameters are plain
tensors (reference trainer) or FSDP2 DTensor shards (learner ranks). The weight sets come from
rayflow.models.weight_sets, so full fine-tuning's read the same way (its checkpoints are sharded instead:
rayflow.learner.sharded).

Reading gathers shards (a collective: every rank of the mesh must call it, in the same order);
writing takes full tensors and keeps each rank's own shard, with no communication, so every
rank can be handed the same state. Keys are canonical names ("transformer_blocks.0.attn.to_q.lora_A.weight"),
so the state does not depend on the world size, parameter order or adapter name.
"""

from __future__ import annotations

import torch
from torch import nn

from rayflow.models.lora import TRAINED_ADAPTER
from rayflow.models.weight_sets import named_weights, weight_names
from rayflow.named_tensors import check_layout, layout


def gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: all-gathered when `t` is a DTensor shard, else `t` itself (no copy)."""
    from torch.distributed.tensor import DTensor  # here: the driver never needs it (parallelize.py's docstring)

    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy of the whole tensor (all-gathered when `t` is a DTensor shard)."""
    return gathered(t).cpu().clone()


def like(full: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`full` in the layout of `ref`: this rank's shard of it if `ref` is a DTensor (local split, no
    communication), else `full` itself, on ref's device and dtype."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # as in `gathered`

    full = full.to(ref.device, ref.dtype)
    if isinstance(ref, DTensor):
        return distribute_tensor(full, ref.device_mesh, ref.placements, src_data_rank=None)
    return full


def adapter_state(transformer: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """{canonical name: full tensor} of one adapter."""
    return {name: full_tensor(p) for name, p in sorted(named_weights(transformer, adapter).items())}


@torch.no_grad()
def load_adapter_state(transformer: nn.Module, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite an adapter from full tensors; names and shapes must match exactly."""
    params = named_weights(transformer, adapter)
    check_layout(layout(params), layout(tensors), f"adapter {adapter!r}")
    for name, p in params.items():
        p.copy_(like(tensors[name], p))


def optimizer_state(transformer: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state with full tensors, keyed by the canonical names of the trained adapter:
    {"state": {name: {"step", "exp_avg", ...}}, "param_groups": [{hyperparameters, "params": [names]}]}."""
    names = param_names(transformer, optimizer)
    state = {
        names[p]: {k: full_tensor(v) if torch.is_tensor(v) else v for k, v in s.items()}
        for p, s in optimizer.state.items()
    }
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[p] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optimizer_state(transformer: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Restore `optimizer_state` output into an optimizer over the same trained parameters. The per-parameter
    state (moments, step counts) comes from `saved`; hyperparameters (lr, betas, ...) stay this run's config."""
    names = param_names(transformer, optimizer)
    params = {name: p for p, name in names.items()}
    check_names("optimizer", [n for g in saved["param_groups"] for n in g["params"]], list(params))
    # In torch's own format (parameters by position), so load_state_dict casts and validates as usual;
    # scalar entries ("step") stay plain tensors, as AdamW keeps them.
    index = {names[p]: i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {
        index[name]: {k: like(v, params[name]) if torch.is_tensor(v) and v.ndim > 0 else v for k, v in s.items()}
        for name, s in saved["state"].items()
    }
    groups = [{**g, "params": [index[names[p]] for p in g["params"]]} for g in optimizer.param_groups]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def capture(transformer: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"adapters": {adapter: {name: full tensor}}, "optimizer": optimizer_state}: the trained state
    a checkpoint holds. A collective under FSDP2."""
    return {
        "adapters": {name: adapter_state(transformer, name) for name in weight_names(transformer)},
        "optimizer": optimizer_state(transformer, optimizer),
    }


def restore(transformer: nn.Module, optimizer: torch.optim.Optimizer, adapters: dict, optimizer_saved: dict) -> None:
    """Load `capture` output; the saved adapters must be exactly the model's."""
    check_names("adapters", list(adapters), weight_names(transformer))
    for name, tensors in adapters.items():
        load_adapter_state(transformer, name, tensors)
    load_optimizer_state(transformer, optimizer, optimizer_saved)


def param_names(transformer: nn.Module, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, str]:
    """The canonical name of every parameter the optimizer holds (all of them trained weights)."""
    by_id = {id(p): name for name, p in named_weights(transformer, TRAINED_ADAPTER).items()}
    names = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise ValueError(
                    "the optimizer holds a parameter that is not one of the trained adapter's current parameters "
                    "(build the optimizer after sharding, and reshard before reading state)"
                )
            names[p] = by_id[id(p)]
    return names


def check_names(what: str, given: list[str], expected: list[str]) -> None:
    missing, unexpected = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{what}: the saved names do not match this model's: missing {missing[:5]}{' ...' * (len(missing) > 5)}, "
            f"unexpected {unexpected[:5]}{' ...' * (len(unexpected) > 5)}"
        )
