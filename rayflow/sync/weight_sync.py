"""WeightSync: the driver-side handle of the WeightSyncActor and its group with the rollout ranks.

    sync = WeightSync(cfg.sync, rollout_spec, pool.replicas)   # actor placed, group formed
    learners.push_weights(sync.actor)                          # learner rank 0 pushes version v
    sync.wait(v)                                               # staged on every rollout rank
    sync.attach(new_replica, pool.replicas)                    # late joiner: new group, current version

When a receiver dies, or stalls (no answer within the collective timeout), `wait` raises
rayflow.sync.actor.ReceiversLost (and `lost_versions` lists them) within `deadline_s`: `connect` the live
replicas again and the newest version is broadcast to the new generation.
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


WAIT_GRACE_S = 10.0
"""A waiter's margin over the actor's broadcast deadline, so the actor's verdict arrives first."""


class WeightSync:
    def __init__(self, cfg: SyncConfig, rollout_spec: RolloutWorkerSpec, replicas: list[RolloutReplica],
                 timeout_s: float = 300.0, name: str = "rayflow-weight-sync"):
        gpus = resolve_gpus(cfg.gpus)
        self.placed = place(make_bundles(1, cfg.cpus, gpus, cfg.resources), "PACK", name=name)
        spec = SyncSpec(cfg.mode, cfg.bucket_mb, cfg.verify_checksum, timeout_s)
        self.timeout_s = timeout_s
        self.actor = WeightSyncActor.options(
            num_cpus=cfg.cpus, num_gpus=gpus, scheduling_strategy=self.placed.strategy_for_rank(0)
        ).remote(spec, rollout_spec)
        self.deadline_s = spec.broadcast_deadline_s + WAIT_GRACE_S
        """How long to `wait` for a version: past the actor's own verdict on its broadcast (ReceiversLost)."""
        self.generation = 0
        try:
            self.connect(replicas)
        except BaseException:
            self.shutdown()
            raise

    def connect(self, replicas: list[RolloutReplica]) -> None:
        """Form a new generation of the group: the actor as rank 0, every rank of every live replica after it.
        Raises TimeoutError naming the ranks that did not join (stalled) instead of waiting for them forever."""
        members = [(r, rank) for r in replicas if r.alive for rank in range(r.world_size)]
        workers = [r.workers[rank] for r, rank in members]
        self.generation += 1
        name = f"rayflow-weight-sync-{self.generation}"
        rendezvous = self.actor.rendezvous.remote()
        size = len(workers) + 1
        joins = [w.join_sync.remote(rendezvous, name, i + 1, size) for i, w in enumerate(workers)]
        refs = [self.actor.join.remote(rendezvous, name, workers), *joins]
        # The actor may first finish a broadcast in flight (deadline_s); then joining takes a collective timeout at most.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.deadline_s + self.timeout_s)
        late = [f"{r.describe_rank(rank)} of rollout replica {r.name!r}" for (r, rank), ref in zip(members, joins)
                if ref not in ready]
        if late:
            raise TimeoutError(f"weight-sync group {name!r}: {', '.join(late)} did not join within "
                               f"{self.deadline_s + self.timeout_s:.0f}s (stalled)")
        ray.get(refs)

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
