"""LearnerBackend: one learner rank's training state — the policy model sharded with FSDP2, its
AdamW optimizer, the policy version — and the operations on it.

A plain class: the LearnerWorker actor holds one and forwards calls; tests drive it in-process.
It runs the same code as the reference trainer (`load_policy_model`, `minibatches.train_batch`), so with the same trajectories any world size reaches the reference's weights (LoRA, or with learner.train_mode=full the whole transformer).

Collectives: `train_step`, `rollout_wire`, `adapter_weights`, `state_dict` and the constructor communicate over
the mesh; every rank calls them in the same order with shards of the same size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rayflow.models.lora import adapters_to_fp32, rollout_adapter_name
from rayflow.learner.model import add_full_weight_copies, load_policy_model, policy_identity
from rayflow.learner.minibatches import minibatch_plan, train_batch
from rayflow.learner.objective import num_passes
from rayflow.learner.optim import build_optimizer
from rayflow.learner.spec import LearnerSpec
from rayflow.distributed.parallelize import (
    apply_activation_checkpointing,
    autocast,
    apply_fsdp,
    cast_parameters,
    mixed_precision_policy,
    reshard,
)
from rayflow.learner.sharded import capture_trained, restore_trained
from rayflow.learner.state import adapter_state, gathered
from rayflow.models.weight_sets import named_weights
from rayflow.models.speed import apply_speed_options
from rayflow.rng import get_rng_state, set_rng_state
from rayflow.sync.buckets import WirePush, to_wire
from rayflow.types import Trajectory


class LearnerBackend:
    """FSDP2 learner state of one rank (LoRA adapters, or with learner.train_mode=full every transformer weight).

    The reference trainer builds its model and trains with the same spec and functions.
    """

    def __init__(self, spec: LearnerSpec, mesh: DeviceMesh, device: torch.device, transformer_only: bool = True):
        """`transformer_only`: no text encoder or VAE, which training never runs (colocated placement samples too)."""
        self.spec = spec
        self.mesh = mesh
        self.model = load_policy_model(spec, device, transformer_only=transformer_only)
        # Before sharding: the fingerprint reads whole base weights.
        self.identity = policy_identity(spec, self.model)
        transformer, learner = self.model.transformer, spec.learner
        if learner.activation_checkpointing:
            apply_activation_checkpointing(transformer)
        # autocast: the trained weights (LoRA adapters, or every weight) and AdamW's state in fp32, the master weights.
        fp32_masters, full = learner.mixed_precision == "autocast", learner.train_mode == "full"
        if fp32_masters and not full:
            adapters_to_fp32(transformer)
        master_dtype = torch.float32 if fp32_masters and full else None
        apply_speed_options(self.model, spec.model.attention_backend, spec.model.compile)
        if learner.sharded:
            apply_fsdp(transformer, mesh, mixed_precision_policy(learner.mixed_precision), learner.reshard_after_forward,
                       master_dtype)
        else:
            cast_parameters(transformer.parameters(), master_dtype)
        # After sharding: full-weight copies are shards like the parameters, and the optimizer owns the DTensor shards.
        add_full_weight_copies(spec, transformer)
        self.optimizer = build_optimizer(transformer, learner)
        self.policy = spec.policy
        self.version = 0
        """Batches trained (algorithm.steps_per_batch optimizer steps each; skipped ones included: they
        still advance the EMA schedule)."""
        self.skipped_steps = 0

    @property
    def transformer(self) -> torch.nn.Module:
        return self.model.transformer

    @property
    def rollout_adapter_name(self) -> str:
        """The adapter rollouts sample under ("old" for an EMA rollout, else "default"): the one place
        evaluation swaps and weight sync ask."""
        return rollout_adapter_name(self.spec.algorithm.needs_ema_rollout)

    def rank_steps(self, batch_size: int) -> list[list[int]]:
        """Indices into the batch this rank trains on at each optimizer step of the current version:
        its contiguous slice of every planned mini-batch (rayflow.learner.minibatches.minibatch_plan)."""
        algo, ranks = self.spec.algorithm, self.mesh.size()
        plan = minibatch_plan(batch_size, self.spec.seed, self.version, algo.num_inner_epochs, algo.num_minibatches)
        n = batch_size // algo.num_minibatches // ranks
        rank = self.mesh.get_rank()
        return [indices[rank * n : (rank + 1) * n] for indices in plan]

    def train_step(self, batch: list[Trajectory | None]) -> dict[str, float]:
        """One trained batch (the whole batch, in order; entries this rank does not train on, see
        `rank_steps`, may be None): per planned mini-batch forward/backward over this rank's slice, then
        an optimizer step; version += 1.

        Returns the batch's metrics, equal on every rank: losses are means over all ranks' samples."""
        steps = [[batch[i] for i in indices] for indices in self.rank_steps(len(batch))]
        passes = self._most_passes(steps)
        with autocast(self.spec.learner.mixed_precision, self.model.device):
            metrics, result = train_batch(self.spec, self.model, self.optimizer, self.policy, steps, self.version, passes)
        self.version += 1
        self.skipped_steps += result.skipped_steps
        return {
            **self._mean_over_ranks(metrics),
            "train/grad_norm": result.grad_norm,
            "train/skipped": float(result.skipped_steps),
            "train/skipped_steps": float(self.skipped_steps),
            **result.skip_runs.metrics(),
            "train/ema_decay": result.ema_decay,
            "train/version": float(self.version),
        }

    def adapter_weights(self, adapter: str) -> dict[str, torch.Tensor] | None:
        """{canonical name: full tensor} of `adapter` on rank 0, None on the others (every rank gathers)."""
        reshard(self.transformer)
        if self.mesh.get_rank() == 0:
            return adapter_state(self.transformer, adapter)
        # One whole tensor at a time, kept by rank 0 only: with learner.train_mode=full every rank had built a whole
        # transformer in host memory (the "ema" evaluation's weights), only to drop it.
        for _, p in sorted(named_weights(self.transformer, adapter).items()):
            gathered(p)
        return None

    def rollout_wire(self) -> WirePush | None:
        """The rollout weights (an adapter, or every transformer weight) laid out for the weight-sync actor
        (rayflow.sync.buckets.to_wire): gathered and copied into one flat buffer in host memory; on rank 0 only
        (every rank takes part in the gathers)."""
        reshard(self.transformer)
        params = named_weights(self.transformer, self.rollout_adapter_name)
        rank0 = self.mesh.get_rank() == 0
        tensors = {}
        for name, p in sorted(params.items()):
            whole = gathered(p)  # on every rank: one tensor at a time, so a whole transformer never sits on the device
            if rank0:
                tensors[name] = whole.cpu()
        return to_wire(self.version, tensors) if rank0 else None

    def state_dict(self, directory: str | None = None) -> dict:
        """Everything to resume this rank: "version", "skipped_steps", this rank's "rng" states and the trained state
        (rayflow.learner.sharded.capture_trained): LoRA's full "adapters" and "optimizer" on rank 0 only; with
        learner.train_mode=full, every rank's shards written under `directory` ("sharded")."""
        reshard(self.transformer)
        trained = capture_trained(self.transformer, self.optimizer, directory)
        state = {"version": self.version, "skipped_steps": self.skipped_steps, "rng": get_rng_state()}
        if self.mesh.get_rank() == 0 or trained["sharded"] is not None:
            state.update(trained)
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore from a Checkpoint's fields ("adapters", "optimizer" full tensors, every rank keeping its shard;
        or "sharded", every rank reading its part); `state["rng"]` is this rank's, or None to keep them."""
        reshard(self.transformer)
        restore_trained(self.transformer, self.optimizer, state)
        self.version = state["version"]
        self.skipped_steps = state["skipped_steps"]
        if state["rng"] is not None:
            set_rng_state(state["rng"])

    def _most_passes(self, steps: list[list[Trajectory]]) -> list[int]:
        """Per optimizer step, the forward/backward passes of the rank whose shard needs most (objective.num_passes):
        every rank runs that many, so their FSDP2 collectives pair up. Shards are equal in size, but micro-batches are
        cut where the sampling parameters change (an asynchronous batch may mix SDE windows), so their counts may differ."""
        counts = torch.tensor([num_passes(self.spec, shard) for shard in steps], dtype=torch.int64, device=self.model.device)
        if self.mesh.size() > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
        return counts.cpu().tolist()

    def _mean_over_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        # Each rank's metrics are means over its shard; shards are equal, so the mean of means is global.
        names = sorted(metrics)
        values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=self.model.device)
        if self.mesh.size() > 1:
            dist.all_reduce(values, group=self.mesh.get_group())  # gloo has no AVG
            values /= self.mesh.size()
        return dict(zip(names, values.cpu().tolist()))
