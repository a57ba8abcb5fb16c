"""RolloutPool: `rollout.num_replicas` replicas serving requests concurrently.

A prompt's group of G samples is split into micro-batches (`PromptGroup.requests(params,
rollout.micro_batch_size)`); each request goes to the live replica with the fewest samples in
flight. Every request carries its own seeds and each sample draws from its own generators, so a
request's trajectories do not depend on which replica served it.
"""

from __future__ import annotations

import ray
import torch

from rayflow.cfg.policy import CFGPolicy
from rayflow.config import RolloutConfig
from rayflow.rollout.rank import RolloutWorkerSpec
from rayflow.rollout.replica import ReplicaError, RolloutFuture, RolloutReplica
from rayflow.types import RolloutRequest, Trajectory


class RolloutPool:
    def __init__(self, replicas: list[RolloutReplica]):
        if not replicas:
            raise ValueError("a RolloutPool needs at least one replica")
        self.replicas = replicas
        self._in_flight: list[list[RolloutFuture]] = [[] for _ in replicas]

    @classmethod
    def create(cls, spec: RolloutWorkerSpec, rollout: RolloutConfig, name: str = "rollout") -> "RolloutPool":
        """Start every replica (their actors load concurrently), then wait for all of them."""
        replicas = [RolloutReplica(spec, rollout, name=f"{name}-{i}") for i in range(rollout.num_replicas)]
        for replica in replicas:
            replica.wait_ready()
        return cls(replicas)

    def _samples_in_flight(self, index: int) -> int:
        self._in_flight[index] = [f for f in self._in_flight[index] if not f.done()]
        return sum(len(f.request.seeds) for f in self._in_flight[index])

    def submit(self, request: RolloutRequest, policy: CFGPolicy | None = None) -> RolloutFuture:
        """Send `request` to the least-loaded live replica (ties: the lowest index)."""
        live = [i for i, r in enumerate(self.replicas) if r.alive]
        if not live:
            raise ReplicaError(f"every rollout replica of the pool is out of service ({len(self.replicas)} replicas)")
        index = min(live, key=self._samples_in_flight)
        future = self.replicas[index].submit(request, policy)
        self._in_flight[index].append(future)
        return future

    def map(self, requests: list[RolloutRequest], policy: CFGPolicy | None = None) -> list[RolloutFuture]:
        """Submit every request; futures in request order."""
        return [self.submit(r, policy) for r in requests]

    def generate(self, requests: list[RolloutRequest], policy: CFGPolicy | None = None) -> list[Trajectory]:
        """Blocking: all trajectories, in request order."""
        return [t for future in self.map(requests, policy) for t in future.result()]

    def stage_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> list[ray.ObjectRef]:
        """Stage `version` on every rank of every live replica (each applies it at its next step boundary)."""
        ref = ray.put(tensors)  # once for every rank of every replica
        return [r for replica in self.replicas if replica.alive for r in replica.stage_weights(version, ref)]

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
