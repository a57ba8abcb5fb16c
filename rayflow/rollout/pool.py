"""RolloutPool: `rollout.num_replicas` replicas serving requests concurrently.

A prompt's group of G samples is split into micro-batches (`PromptGroup.requests(params,
rollout.micro_batch_size)`); each request goes to the live replica with the fewest samples in
flight. Every request carries its own seeds and each sample draws from its own generators, so a
request's trajectories do not depend on which replica served it.

A replica that died is replaced (`rollout.max_restarts` times per replica within any
`rollout.restart_window_s` seconds, RestartBudget): `replace` frees its
placement group and starts a new one under the same name without waiting for it to load;
`promote_ready` puts a replacement into service once all its ranks joined, after a caller's hook
(the weight sync's late-join) has run, so it never serves a request under stale weights.
"""

from __future__ import annotations

import logging
from typing import Callable

import ray
import torch

from rayflow.cfg.policy import CFGPolicy
from rayflow.config import RolloutConfig
from rayflow.rollout.rank import RolloutRankSpec
from rayflow.distributed.restart_budget import RestartBudget
from rayflow.rollout.replica import ReplicaError, RolloutFuture, RolloutReplica
from rayflow.types import RolloutRequest, Trajectory

log = logging.getLogger("rayflow")


class RolloutPool:
    def __init__(self, replicas: list[RolloutReplica], start_replica: Callable[[str], RolloutReplica] | None = None,
                 max_restarts: int = 0, restart_window_s: float = 0.0):
        """`start_replica(name)` starts a replacement replica (without waiting for it); None: no restarts.
        Each replica may be replaced `max_restarts` times within any `restart_window_s` seconds (0: in all)."""
        if not replicas:
            raise ValueError("a RolloutPool needs at least one replica")
        self.replicas = replicas
        self._in_flight: list[list[RolloutFuture]] = [[] for _ in replicas]
        self._start_replica = start_replica
        self.max_restarts = max_restarts if start_replica is not None else 0
        self.restarts = [0] * len(replicas)
        """Replacements started per replica, over the whole run."""
        self.budgets = [RestartBudget(self.max_restarts, restart_window_s) for _ in replicas]
        self.starting: dict[int, RolloutReplica] = {}
        """Replacements still loading, by the index of the replica they replace."""

    @classmethod
    def create(cls, spec: RolloutRankSpec, rollout: RolloutConfig, name: str = "rollout") -> "RolloutPool":
        """Start every replica (their actors load concurrently), then wait for all of them."""
        def start(replica_name: str) -> RolloutReplica:
            return RolloutReplica(spec, rollout, name=replica_name)

        replicas = [start(f"{name}-{i}") for i in range(rollout.num_replicas)]
        for replica in replicas:
            replica.wait_ready()
        return cls(replicas, start, rollout.max_restarts, rollout.restart_window_s)

    # -- replacing dead replicas ---------------------------------------------------------------------
    def replace(self, replica: RolloutReplica) -> bool:
        """Shut the dead `replica` down and start its replacement; False when its restarts are used up."""
        replica.shutdown()  # frees its placement group for the replacement
        return self._restart(self.replicas.index(replica))

    def _restart(self, index: int) -> bool:
        if index in self.starting or not self.budgets[index].take():
            return False
        self.restarts[index] += 1
        self.starting[index] = self._start_replica(self.replicas[index].name)
        return True

    def promote_ready(self, before_serving: Callable[[RolloutReplica], None]) -> list[RolloutReplica]:
        """Put every replacement whose ranks all joined into service, calling `before_serving(replica)`
        once it is in `replicas` and before any request can reach it. A replacement that failed to start
        counts as another death: it is replaced again while restarts are left."""
        promoted = []
        for index, replica in list(self.starting.items()):
            try:
                if not replica.ready():
                    continue
            except ReplicaError as e:
                del self.starting[index]
                replica.shutdown()
                log.warning("%s; %s", e, "replacing it again" if self._restart(index) else "its restarts are used up")
                continue
            del self.starting[index]
            self.replicas[index], self._in_flight[index] = replica, []
            before_serving(replica)
            promoted.append(replica)
        return promoted

    def _samples_in_flight(self, index: int) -> int:
        self._in_flight[index] = [f for f in self._in_flight[index] if not f.done()]
        return sum(len(f.request.seeds) for f in self._in_flight[index])

    def submit(self, request: RolloutRequest, policy: CFGPolicy | None = None,
               weights: ray.ObjectRef | None = None) -> RolloutFuture:
        """Send `request` to the least-loaded live replica (ties: the lowest index); `weights`: RolloutReplica.submit's."""
        live = [i for i, r in enumerate(self.replicas) if r.alive]
        if not live:
            raise ReplicaError(f"every rollout replica of the pool is out of service ({len(self.replicas)} replicas)")
        index = min(live, key=self._samples_in_flight)
        future = self.replicas[index].submit(request, policy, weights)
        self._in_flight[index].append(future)
        return future

    def map(self, requests: list[RolloutRequest], policy: CFGPolicy | None = None,
            weights: ray.ObjectRef | None = None) -> list[RolloutFuture]:
        """Submit every request; futures in request order."""
        return [self.submit(r, policy, weights) for r in requests]

    def generate(self, requests: list[RolloutRequest], policy: CFGPolicy | None = None) -> list[Trajectory]:
        """Blocking: all trajectories, in request order."""
        return [t for future in self.map(requests, policy) for t in future.result()]

    def stage_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> list[ray.ObjectRef]:
        """Stage `version` on every rank of every live replica (each applies it at its next step boundary)."""
        ref = ray.put(tensors)  # once for every rank of every replica
        return [r for replica in self.replicas if replica.alive for r in replica.stage_weights(version, ref)]

    def shutdown(self) -> None:
        for replica in self.replicas + list(self.starting.values()):
            replica.shutdown()
        self.starting = {}

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
