"""Parallelism applied to a plain transformer, in a fixed order (torchtitan style):

    activation checkpointing → fully_shard per transformer block → fully_shard the root

Each step is a small function of the module and explicit arguments; nothing here knows about
LoRA, optimizers or Ray. The mesh is built once by the caller (`build_mesh`).

FSDP2 is imported where it is used: the driver imports this module's callers (the learner's and colocated
placement's actor classes) but never shards, and torch.distributed.fsdp with DTensor is 0.6 s of CPU on 2 cores
at a run's start (`tests/test_runs.py -k without_importing`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy


def build_mesh(device: torch.device, world_size: int) -> DeviceMesh:
    """The 1-D data-parallel mesh over the default process group ("cpu" without a GPU: gloo)."""
    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy | None:
    """learner.mixed_precision (checked by LearnerConfig.validate) → FSDP2 policy: "bf16" computes in bf16 and
    reduces gradients in fp32; "none" and "autocast" leave FSDP2's dtypes alone."""
    if mode == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def autocast(mode: str, device: torch.device) -> contextlib.AbstractContextManager:
    """learner.mixed_precision="autocast": matmuls of the forward in bf16 under torch.autocast, while the
    parameters keep their dtype (LoRA adapters and their AdamW state stay fp32: the master weights).
    Any other mode: no autocast."""
    if mode != "autocast":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """Every repeated block of a diffusers transformer, in module order: the `*transformer_blocks` ModuleLists
    (FLUX.1 has `single_transformer_blocks` beside `transformer_blocks`: 38 of its 57 blocks, half its weights)."""
    blocks = [block for name, child in transformer.named_children()
              if isinstance(child, nn.ModuleList) and name.endswith("transformer_blocks") for block in child]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no `transformer_blocks` ModuleList "
                         "(sharding and checkpointing are per block)")
    return blocks


@functools.cache
def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    """`cls` with its forward under non-reentrant checkpointing while gradients are recorded. Same name, so
    diffusers still finds the block class by name (`compile_repeated_blocks`); one subclass per class, so every
    block shares one forward and compiles once."""
    forward = cls.forward

    def checkpointed_forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(self, *args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, self, *args, use_reentrant=False, **kwargs)

    return type(cls.__name__, (cls,), {"forward": checkpointed_forward, "__module__": cls.__module__})


def apply_activation_checkpointing(transformer: nn.Module) -> None:
    """Recompute each repeated block's activations in backward (non-reentrant checkpointing of its forward).

    The checkpoint is set in each block's own forward (a subclass swapped in, as FSDP2 does) rather than at diffusers'
    call site (`enable_gradient_checkpointing`), for two reasons. model.compile compiles the block, so the checkpoint is
    then traced into the compiled graph and recomputed by its backward (torchtitan's order: checkpointing, then compile).
    At diffusers' call site, backward re-ran the compiled block, and a block recompiled between the forward and the
    backward (CFG's second branch, a new prompt length) re-ran another graph: on an H200 the learner's first step
    failed with CheckpointError. And no wrapper module is added, so parameter names (adapter names, checkpoints,
    weight sync) stay those of the plain model. FSDP2's hooks run around the block's forward, outside the checkpoint."""
    for block in transformer_blocks(transformer):
        block.__class__ = _checkpointed_class(type(block))


def apply_fsdp(
    transformer: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    master_dtype: torch.dtype | None = None,
) -> None:
    """FSDP2 in place: one parameter group per transformer block, then the root (the embeddings,
    norms and output projection). Per-block groups bound the memory of unsharded parameters to one
    block at a time; the root last so its group holds only what no block owns.

    `master_dtype`: each group's parameters cast to it right before it is sharded (full fine-tuning's fp32
    master weights over a bf16 model), so the whole model never exists in that dtype at once."""
    from torch.distributed.fsdp import fully_shard

    # diffusers transformers return their output as a view; rayflow only uses velocities out of place
    # (CFG combine, flow_step, the losses), so FSDP2's warning about in-place ops on it does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    blocks = transformer_blocks(transformer)
    for block in blocks:
        cast_parameters(block.parameters(), master_dtype)
        fully_shard(block, **kwargs)
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    cast_parameters((p for p in transformer.parameters() if id(p) not in in_blocks), master_dtype)
    fully_shard(transformer, **kwargs)


def cast_parameters(params: Iterable[nn.Parameter], dtype: torch.dtype | None) -> None:
    """Each parameter's data in `dtype` (None: unchanged), the Parameter objects kept."""
    if dtype is None:
        return
    for p in params:
        p.data = p.data.to(dtype)


def fsdp_modules(transformer: nn.Module) -> list[FSDPModule]:
    """The transformer's FSDP2 groups (its blocks and the root), in module order: the same on every rank."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in transformer.modules() if isinstance(m, FSDPModule)]


def reshard(transformer: nn.Module) -> None:
    """Put every FSDP group back to its sharded parameters (no-op for a plain module).

    With reshard_after_forward=False a no-grad forward leaves blocks unsharded; reading or
    writing parameters (EMA, checkpoints, weight sync) must see the sharded DTensors the
    optimizer owns."""
    for module in fsdp_modules(transformer):
        module.reshard()


def gather_for_sampling(transformer: nn.Module) -> None:
    """All-gather every FSDP group's parameters and keep them gathered through any number of forwards (colocated
    placement samples between train steps: no collective per forward, so ranks may run different requests) until
    `release_gathered`. Collective: every rank calls it at once. No-op for a plain module."""
    for module in fsdp_modules(transformer):
        module.set_reshard_after_forward(False, recurse=False)
        module.unshard()


def release_gathered(transformer: nn.Module, reshard_after_forward: bool) -> None:
    """Back to the sharded parameters the optimizer owns, and to learner.reshard_after_forward (`apply_fsdp` set it
    explicitly on every group, the root included). Local: frees this rank's gathered copies."""
    reshard(transformer)
    for module in fsdp_modules(transformer):
        module.set_reshard_after_forward(reshard_after_forward, recurse=False)
