"""RolloutWorker: the Ray actor shell around one RolloutRank (one CFG rank of a replica).

Concurrency: requests run in the actor's default group, one at a time and in submission order
(Ray keeps a caller's tasks in order only while that group has one thread; `max_concurrency=2`
would make Ray run them out of order, and the ranks of a replica would then pair up collectives
of different requests). Staging weights has its own thread ("weights"), so new weights can
arrive while a request is sampling (staged directly, or received from the weight-sync broadcast);
progress and timings answer on a third ("monitor").

The model code (rank.py: diffusers, transformers, peft) is imported when a rank is built, not with this module:
Ray imports an actor's class module in every process that receives one of its handles, and the weight-sync actor
receives every rollout rank's (about 4 s of CPU for imports it never uses, on the run's start-up path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ray
import torch

from rayflow.distributed.process_group import CollectiveGroup, GroupHost, Rendezvous, node_ip
from rayflow.distributed.tensor_pickle import install as install_tensor_pickling
from rayflow.sync.buckets import Manifest
from rayflow.types import RolloutRequest, Trajectory

if TYPE_CHECKING:
    from rayflow.cfg.policy import CFGPolicy
    from rayflow.rollout.rank import RolloutRank, RolloutRankSpec


CONCURRENCY_GROUPS = {"weights": 1, "monitor": 1}
STEP_GATHER_SPIN_S = 0.02
"""How long a CPU rank polls its per-step all_gather before blocking in it (CollectiveGroup's `spin_s`): the peer
running the other CFG branch finishes within milliseconds. On a 2-core VM the W = 2 latency went from 1.47-1.53x to
1.68-1.72x of W = 1's, side by side (README, Rollout — CFG parallelism)."""


class RolloutRankHost(GroupHost):
    """The calls a rollout rank's actor serves, around its RolloutRank `self.rank` (set by the actor's constructor,
    or later by an actor that builds it from a model it owns: rayflow.distributed.colocated)."""

    rank: RolloutRank
    group: CollectiveGroup | None = None
    sync_group: CollectiveGroup | None = None

    def join(self, rendezvous: Rendezvous, group_name: str) -> dict[str, str]:
        """Join the replica's process group (blocks until every rank joined); return where this rank runs."""
        r = self.rank
        self.group = CollectiveGroup(group_name, rendezvous, r.rank, r.world_size, r.device,
                                     timeout_s=r.spec.collective_timeout_s, spin_s=STEP_GATHER_SPIN_S)
        r.join(self.group)
        return {"node_ip": node_ip(), "node_id": ray.get_runtime_context().get_node_id()}

    @ray.method(num_returns=2)
    def generate(self, request: RolloutRequest, policy: CFGPolicy | None = None,
                 weights: dict[str, torch.Tensor] | None = None) -> tuple[int, list[Trajectory] | None]:
        """(samples returned, trajectories): the small first object tells the driver the request is done
        (or raises its error) without fetching the trajectories, which go to rewards and learners by reference.
        `weights`: RolloutRank.generate's."""
        try:
            trajectories = self.rank.generate(request, policy, weights)
        except Exception:
            if self.rank.out_of_step is not None and self.group is not None:
                # The peers waiting in this request's collective fail it now (not at the collective timeout), and the
                # replica goes out of service (RolloutReplica._collect reports this rank's own error).
                self.group.destroy()
                self.group = None
            raise
        return (0 if trajectories is None else len(trajectories)), trajectories

    def get_adapter_weights(self) -> dict[str, torch.Tensor]:
        return self.rank.get_adapter_weights()

    @ray.method(concurrency_group="weights")
    def stage_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        self.rank.receiver.stage(version, tensors)

    @ray.method(concurrency_group="weights")
    def rewind_weights(self, version: int) -> None:
        self.rank.receiver.rewind(version)

    @ray.method(concurrency_group="monitor")
    def abandon_waits(self) -> None:
        """WeightReceiver.abandon_waits; on the monitor thread, which answers while the weights thread receives."""
        self.rank.receiver.abandon_waits()

    @ray.method(concurrency_group="weights")
    def join_sync(self, rendezvous: Rendezvous, group_name: str, rank: int, size: int) -> None:
        """Join (a new generation of) the weight-sync group as `rank`; the previous generation is closed."""
        if self.sync_group is not None:
            self.sync_group.destroy()
            # Not left pointing at the destroyed generation if this one fails to form: a later receive_weights then
            # names the failed join instead of an AttributeError from the destroyed group.
            self.sync_group = None
        r = self.rank
        self.sync_group = CollectiveGroup(group_name, rendezvous, rank, size, r.device, timeout_s=r.spec.collective_timeout_s)

    @ray.method(concurrency_group="weights")
    def receive_weights(self, manifest: Manifest, bucket_bytes: int) -> None:
        """Join the sync source's broadcast of one version and stage it (runs beside a request)."""
        if self.sync_group is None:
            raise RuntimeError(f"rollout rank {self.rank.rank}: no weight-sync group to receive version {manifest.version} "
                               f"from (its last join_sync failed, or none was asked for)")
        self.rank.receiver.receive(self.sync_group, manifest, bucket_bytes)

    @ray.method(concurrency_group="monitor")
    def progress(self) -> tuple[str, int] | None:
        return self.rank.progress

    @ray.method(concurrency_group="monitor")
    def timings(self) -> dict[str, float]:
        return self.rank.timings()

    def close(self) -> None:
        for group in (self.group, self.sync_group):
            if group is not None:
                group.destroy()
        self.group = self.sync_group = None


@ray.remote(concurrency_groups=CONCURRENCY_GROUPS)
class RolloutWorker(RolloutRankHost):
    """A rollout rank that loads its own model and receives its weights from the weight-sync actor."""

    def __init__(self, spec: RolloutRankSpec, rank: int, world_size: int):
        from rayflow.rollout.rank import RolloutRank

        install_tensor_pickling()
        self.rank = RolloutRank(spec, rank, world_size)
