"""WeightSync: the driver-side handle of the WeightSyncActor and its group with the rollout ranks.

    sync = WeightSync(cfg.sync, rollout_spec, pool.replicas)   # actor placed, group formed
    learners.push_weights(sync.actor)                          # learner rank 0 pushes version v
    sync.wait(v)                                               # staged on every rollout rank
    sync.attach(new_replica, pool.replicas)                    # late joiner: new group, current version

When a receiver dies, `wait` raises rayflow.sync.actor.ReceiversLost (and `lost_versions` lists them): `connect` the
live replicas again and the newest version is broadcast to the new generation.
"""

from __future__ import annotations

import ray
import torch

from rayflow.config import SyncConfig
from rayflow.distributed.placement import make_bundles, place, resolve_gpus
from rayflow.rollout.rank import RolloutWorkerSpec
from rayflow.rollout.replica import RolloutReplica
from rayflow.sync.actor import SyncReport, SyncSpec, WeightSyncActor
from rayflow.sync.buckets import to_wire


class WeightSync:
    def __init__(self, cfg: SyncConfig, rollout_spec: RolloutWorkerSpec, replicas: list[RolloutReplica] | None,
                 timeout_s: float = 300.0, name: str = "rayflow-weight-sync"):
        """Place and start the actor and form its group with `replicas`; with None the group forms at the
        first `connect` (the actor's start then overlaps the replicas' loading)."""
        gpus = resolve_gpus(cfg.gpus)
        self.placed = place(make_bundles(1, cfg.cpus, gpus, cfg.resources), "PACK", name=name)
        self.actor = WeightSyncActor.options(
            num_cpus=cfg.cpus, num_gpus=gpus, scheduling_strategy=self.placed.strategy_for_rank(0)
        ).remote(SyncSpec(cfg.mode, cfg.bucket_mb, cfg.verify_checksum, timeout_s), rollout_spec)
        self.generation = 0
        if replicas is None:
            return
        try:
            self.connect(replicas)
        except BaseException:
            self.shutdown()
            raise

    def connect(self, replicas: list[RolloutReplica]) -> None:
        """Form a new generation of the group: the actor as rank 0, every rank of every live replica after it."""
        workers = [w for r in replicas if r.alive for w in r.workers]
        self.generation += 1
        name = f"rayflow-weight-sync-{self.generation}"
        rendezvous = self.actor.rendezvous.remote()
        size = len(workers) + 1
        ray.get([self.actor.join.remote(rendezvous, name, workers)]
                + [w.join_sync.remote(rendezvous, name, i + 1, size) for i, w in enumerate(workers)])

    def push(self, version: int, tensors: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """Hand `version` to the actor from the driver (learners push with LearnerGroup.push_weights);
        the ref resolves once the actor holds it."""
        return self.actor.push.remote(to_wire(version, tensors))

    def wait(self, version: int, timeout_s: float | None = None) -> SyncReport:
        """Block until `version` is staged on every rollout rank; raises the sync's failure."""
        return ray.get(self.actor.wait.remote(version, timeout_s))

    def lost_versions(self) -> list[int]:
        """Versions whose broadcast met a dead receiver since the last `connect`; raises the sync's failure."""
        return ray.get(self.actor.lost_versions.remote())

    def attach(self, replica: RolloutReplica, replicas: list[RolloutReplica]) -> None:
        """Bring a restarted or added `replica` (one of `replicas`) into the group, and stage the current
        version on it before it serves a request."""
        self.connect(replicas)
        current = ray.get(self.actor.current.remote())
        if current is not None:
            ray.get(replica.stage_weights(*current))

    def shutdown(self) -> None:
        ray.wait([self.actor.close.remote()], timeout=5.0)
        ray.kill(self.actor)
        self.placed.remove()
