"""Full fine-tuning's trained state as a torch.distributed.checkpoint (DCP) directory: each rank writes and
reads its own shards, so nothing is gathered to one process, and a directory written by N ranks loads into
M ranks (or into the single-process reference trainer, whose plain tensors take every shard).

Keys (DCP flattens the nesting): "weights.<set>.<parameter name>" for every weight set (rayflow.models.weight_sets:
"default", "old", "ema"), and "optimizer.<parameter name>.<step|exp_avg|exp_avg_sq>" for AdamW's state of every
parameter. A parameter AdamW has not stepped yet (no gradient so far) is saved with the state AdamW would
create for it (step 0, zero moments), so every checkpoint holds the same keys and loading resumes exactly.

`capture_trained` and `restore_trained` are where a checkpoint's trained state is taken and put back in either
learner.train_mode (LoRA: full tensors, rayflow.learner.state).

Collectives: `save` and `load` are collectives of the default process group when one exists (every learner
rank calls them, in the same order); without one (the reference trainer) they run in this process alone.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.tensor import DTensor

from rayflow.checkpoint import ShardedWeights
from rayflow.models import weight_copies
from rayflow.distributed.parallelize import reshard
from rayflow.learner.state import capture, check_names, param_names, restore
from rayflow.models.weight_sets import named_weights, weight_names


def _fresh_adam_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """What torch.optim.AdamW (amsgrad off, not capturable) creates for `p` at its first step."""
    return {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def _state(transformer: nn.Module, optimizer: torch.optim.Optimizer, weights: list[str]) -> tuple[dict, dict]:
    """The DCP state dict of the weight sets `weights` and AdamW's state (tensors in their own layout), and the
    per-parameter state entries by parameter, to hand to the optimizer after a load."""
    names = param_names(transformer, optimizer)
    adam = {p: optimizer.state.get(p) or _fresh_adam_state(p) for p in names}
    state = {
        "weights": {name: named_weights(transformer, name) for name in weights},
        "optimizer": {names[p]: s for p, s in adam.items()},
    }
    return state, adam


def capture_trained(transformer: nn.Module, optimizer: torch.optim.Optimizer, directory: str | None) -> dict:
    """The trained state a Checkpoint holds, as its fields: LoRA gathers "adapters" and "optimizer" to full tensors
    (rayflow.learner.state.capture); full fine-tuning writes its shards under `directory` and gives "sharded"."""
    if not weight_copies.is_full(transformer):
        return {**capture(transformer, optimizer), "sharded": None}
    return {"adapters": {}, "optimizer": {}, "sharded": save(transformer, optimizer, directory)}


def restore_trained(transformer: nn.Module, optimizer: torch.optim.Optimizer, trained: dict) -> None:
    """Load `capture_trained` output (a Checkpoint's "adapters", "optimizer" and "sharded", of any world size)."""
    if trained["sharded"] is None:
        restore(transformer, optimizer, trained["adapters"], trained["optimizer"])
    else:
        load(transformer, optimizer, trained["sharded"])


def save(transformer: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> ShardedWeights:
    """Write every weight set and AdamW's state under `directory`, this rank's shards only. Its `finite`
    says whether this rank's tensors are all finite (the checkpoint's health, rayflow.checkpoint)."""
    reshard(transformer)
    names = weight_names(transformer)
    state, _ = _state(transformer, optimizer, names)
    _run(dcp.save, state, directory)
    finite = all(bool(torch.isfinite(_local(t)).all()) for t in _tensors(state) if t.is_floating_point())
    return ShardedWeights(directory, names, finite)


def load(transformer: nn.Module, optimizer: torch.optim.Optimizer, saved: ShardedWeights) -> None:
    """Load `save` output written by any number of ranks: each rank reads the parts of its shards. The saved
    weight sets must be exactly this model's."""
    check_names("weights", saved.names, weight_names(transformer))
    reshard(transformer)
    state, adam = _state(transformer, optimizer, saved.names)
    _run(dcp.load, state, saved.directory)
    for p, s in adam.items():
        optimizer.state[p] = s


def missing_files(directory: str) -> list[str]:
    """The files a `save` directory's metadata names that this process does not see there: none when every rank
    wrote to storage this process shares (ranks on other nodes write to their own disks otherwise)."""
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        return [".metadata"]
    storage = FileSystemReader(directory).read_metadata().storage_data
    return sorted({info.relative_path for info in storage.values()} - set(os.listdir(directory)))


def read_weights(directory: str, name: str) -> dict[str, torch.Tensor]:
    """Weight set `name` of a `save` directory as whole tensors by parameter name, in this process (export, tests)."""
    prefix = f"weights.{name}."
    stored = FileSystemReader(directory).read_metadata().state_dict_metadata
    tensors = {key[len(prefix):]: torch.empty(m.size, dtype=m.properties.dtype)
               for key, m in stored.items() if key.startswith(prefix)}
    if not tensors:
        raise KeyError(f"{directory} holds no weights {name!r}")
    _run(dcp.load, {"weights": {name: tensors}}, directory, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
    return tensors


def _run(call: Callable, state: dict, directory: str, no_dist: bool | None = None, **kwargs) -> None:
    """dcp.save / dcp.load over the default process group, or in this process alone when there is none (`no_dist`)."""
    with warnings.catch_warnings():
        # Without a process group (the reference trainer, export) one process is the intent, not a mistake.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        call(state, checkpoint_id=directory, no_dist=not dist.is_initialized() if no_dist is None else no_dist, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(tree: dict | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return [tree.detach()]
