"""RolloutReplica: W CFG-parallel RolloutWorker ranks in one placement group, sharing one process group.

A driver-side handle. Remote calls return futures; the caller decides when to wait:

    replica = RolloutReplica.create(spec, cfg.rollout)        # or RolloutReplica(...) + wait_ready()
    future = replica.submit(request)                          # RolloutFuture; future.ref is rank 0's ObjectRef
    trajectories = future.result()                            # or replica.generate(request)
    replica.shutdown()

Failures are reported, never hung on: a request that contradicts its params fails (on every rank
alike, before any collective) with an error naming the field, and the replica serves the next
one; a rank that dies is reported as a ReplicaError naming its rank and node, and its peers leave
their collective at the latest after `collective_timeout_s`.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from rayflow.cfg.policy import CFGPolicy
from rayflow.config import RolloutConfig
from rayflow.distributed.placement import PlacedGroup, Reservation, describe_rank, resolve_gpus
from rayflow.distributed.placement import reserve as reserve_placement
from rayflow.distributed.process_group import CollectiveError, LeftGroup, answer_grace_s
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.rollout.worker import RolloutWorker
from rayflow.types import RolloutRequest, Trajectory


PEER_FAILURE_GRACE_S = 2.0
"""After a rank's collective failed, how long its peers get to show that one of them broke the group (died, or raised
between two collectives, closing its group first: its error follows its peers' within milliseconds). A stalled peer
shows nothing, and its replica is reported this much later."""


class ReplicaError(RuntimeError):
    """A rank of a rollout replica died; the message names the replica, the rank and its node."""


def _summary(error: Exception) -> str:
    """First and last line of a Ray error: what happened, and its cause (e.g. the exception that
    failed a rank's __init__, or "killed by ray.kill"), without the remote traceback between."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines() if line.strip()]
    return " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else type(error).__name__


def _replica_fault(ref: ray.ObjectRef) -> Exception | None:
    """The error of a finished rank call that puts the replica out of service: its rank died
    (RayActorError), or its collective failed because a peer died or stalled (CollectiveError). None
    for a success or a request's own error (e.g. a ConfigError, raised alike on every rank)."""
    try:
        ray.get(ref, timeout=0)
    except RayActorError as e:
        return e
    except RayTaskError as e:
        return e.cause if isinstance(e.cause, CollectiveError) else None
    return None


class RolloutFuture:
    """One request in flight on a replica. `ref` (rank 0's trajectories) can be handed on without waiting."""

    def __init__(self, replica: "RolloutReplica", request: RolloutRequest, refs: list[ray.ObjectRef], ref: ray.ObjectRef):
        self.replica, self.request = replica, request
        self.refs = refs
        """Each rank's completion (a sample count): small, so waiting on them fetches no trajectories."""
        self.ref = ref

    def done(self) -> bool:
        """Every rank finished, or one is lost or left a collective: then its peers may never finish (a
        stopped rank neither answers nor dies), and `wait` reports the replica at once."""
        ready, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs) or any(_replica_fault(ref) is not None for ref in ready)

    def wait(self, timeout: float | None = None) -> None:
        """Until every rank finished; raises the request's error, or ReplicaError if a rank died."""
        self.replica._collect(self.refs, f"request {self.request.request_id!r}", timeout)

    def result(self, timeout: float | None = None) -> list[Trajectory]:
        """The trajectories (rank 0's), after `wait`."""
        self.wait(timeout)
        return ray.get(self.ref)


class RolloutReplica:
    """`rollout.cfg_parallel_size` ranks of one replica. Construction does not wait for the actors;
    `wait_ready` (or `create`) does."""

    def __init__(self, spec: RolloutRankSpec, rollout: RolloutConfig, name: str = "rollout-0",
                 reservation: Reservation | None = None):
        """`reservation`: the replica's placement asked for already (`RolloutReplica.reserve`)."""
        W = rollout.cfg_parallel_size
        placed = (reservation or self.reserve(rollout, name)).wait()
        workers = [placed.spawn(r, RolloutWorker, spec, r, W) for r in range(W)]
        self._join(name, placed, workers, spec.collective_timeout_s)

    @staticmethod
    def reserve(rollout: RolloutConfig, name: str = "rollout-0") -> Reservation:
        """The replica's placement (one bundle per CFG rank), asked for without waiting."""
        return reserve_placement(rollout.cfg_parallel_size, rollout.cpus_per_rank, resolve_gpus(rollout.gpus_per_rank),
                                 rollout.resources, rollout.placement_strategy, name=name)

    @classmethod
    def over(cls, name: str, placed: PlacedGroup, workers: list[ray.actor.ActorHandle],
             collective_timeout_s: float) -> "RolloutReplica":
        """A replica of rollout ranks someone else started (`workers` serve RolloutRankHost's calls; rank r in
        `placed`'s rank r): colocated devices. Shutting it down kills the ranks but leaves `placed` to its owner."""
        replica = cls.__new__(cls)
        replica._join(name, placed, workers, collective_timeout_s)
        return replica

    def _join(self, name: str, placed: PlacedGroup, workers: list[ray.actor.ActorHandle], collective_timeout_s: float) -> None:
        self.name, self.placed, self.workers = name, placed, workers
        self.world_size = len(workers)
        self.collective_timeout_s = collective_timeout_s
        self.nodes = placed.rank_nodes()
        """(address, node id) of each rank, kept: messages name ranks after a shutdown released `placed` too."""
        # Rank 0 picks the rendezvous on its own node; the others receive it as an ObjectRef argument,
        # so no call here blocks.
        rendezvous = self.workers[0].rendezvous.remote()
        self.join_refs = [w.join.remote(rendezvous, name) for w in self.workers]
        """Each rank's start-up (model loaded, group joined): done once it is up, an error if it failed."""
        self._submit_lock = threading.Lock()
        self._dead: str | None = None

    @classmethod
    def create(cls, spec: RolloutRankSpec, rollout: RolloutConfig, name: str = "rollout-0") -> "RolloutReplica":
        """Start the replica and wait until it is ready; one that fails to start is shut down (its placement group
        stayed reserved and its live ranks running until the driver exited)."""
        replica = cls(spec, rollout, name)
        try:
            return replica.wait_ready()
        except BaseException:
            replica.shutdown()
            raise

    def wait_ready(self, timeout: float | None = None) -> "RolloutReplica":
        """Wait until every rank loaded its model and joined the group."""
        self._collect(self.join_refs, "start-up", timeout)
        return self

    def ready(self) -> bool:
        """Without waiting: True once every rank loaded its model and joined the group; raises
        ReplicaError if a rank failed to start."""
        self._raise_if_dead()
        done, _ = ray.wait(self.join_refs, num_returns=len(self.join_refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as e:
                rank = self.join_refs.index(ref)
                self._dead = f"rollout replica {self.name!r}: {self.describe_rank(rank)} failed to start: {_summary(e)}"
                raise ReplicaError(self._dead) from None
        return len(done) == len(self.join_refs)

    def check_alive(self, timeout: float = 10.0) -> bool:
        """Ask every rank (on its monitor thread, which answers while sampling); False, and out of
        service, if one of them died."""
        if self._dead is None:
            try:
                self._collect([w.progress.remote() for w in self.workers], "a liveness check", timeout)
            except ReplicaError:
                pass
            except TimeoutError as e:  # a stopped process neither answers nor dies
                self.mark_stalled(f"{e}: stalled")
        return self.alive

    def mark_stalled(self, message: str) -> None:
        """Take the replica out of service: a rank stopped answering (the driver's watchdog or a liveness check)."""
        self._dead = self._dead or message

    def late_ranks(self, future: "RolloutFuture") -> list[str]:
        """The ranks that have not finished `future`, described with their nodes."""
        ready, _ = ray.wait(future.refs, num_returns=len(future.refs), timeout=0)
        return [self.describe_rank(rank) for rank, ref in enumerate(future.refs) if ref not in ready]

    def describe_rank(self, rank: int) -> str:
        """As every message names a rank (rayflow.distributed.placement.describe_rank), from the nodes seen at start:
        still known after a shutdown released the placement group."""
        return f"rank {describe_rank(rank, self.world_size, *self.nodes[rank])}"

    # --- requests ------------------------------------------------------------------------------

    def submit(self, request: RolloutRequest, policy: CFGPolicy | None = None,
               weights: ray.ObjectRef | None = None) -> RolloutFuture:
        """Queue `request` on every rank (in the same order on all of them); `policy` overrides the spec's;
        `weights` (a reference to synced-slot tensors) are sampled under instead of the applied version."""
        self._raise_if_dead()
        # Passed by value: a request is a few hundred bytes, which Ray inlines into each rank's call; a ray.put into
        # the object store cost the driver ~1 ms and each rank a fetch from it, between a step's end and the next rollout.
        with self._submit_lock:
            pairs = [w.generate.remote(request, policy, weights) for w in self.workers]
        return RolloutFuture(self, request, [done for done, _ in pairs], pairs[0][1])

    def generate(self, request: RolloutRequest, policy: CFGPolicy | None = None) -> list[Trajectory]:
        return self.submit(request, policy).result()

    # --- weights and monitoring ----------------------------------------------------------------

    def stage_weights(
        self, version: int, tensors: dict[str, torch.Tensor] | ray.ObjectRef, ranks: list[int] | None = None
    ) -> list[ray.ObjectRef]:
        """Stage `tensors` as `version` on `ranks` (default all); applied at the next boundary where every rank has it."""
        ref = tensors if isinstance(tensors, ray.ObjectRef) else ray.put(tensors)
        return [self.workers[r].stage_weights.remote(version, ref) for r in self._ranks(ranks)]

    def adapter_weights(self) -> list[dict[str, torch.Tensor]]:
        """Each rank's adapter, after the requests already submitted."""
        return self._collect([w.get_adapter_weights.remote() for w in self.workers], "adapter_weights", None)

    def progress(self, rank: int = 0) -> tuple[str, int] | None:
        """(request id, step) that `rank` is sampling, or None between requests."""
        return self._collect([self.workers[rank].progress.remote()], "progress", None, ranks=[rank])[0]

    def timings(self) -> list[dict[str, float]]:
        return self._collect([w.timings.remote() for w in self.workers], "timings", None)

    def _ranks(self, ranks: list[int] | None) -> list[int]:
        return list(range(self.world_size)) if ranks is None else ranks

    # --- failures ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """False once a rank died or the replica was shut down."""
        return self._dead is None

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise ReplicaError(self._dead)

    def _collect(
        self, refs: list[ray.ObjectRef], what: str, timeout: float | None, ranks: list[int] | None = None
    ) -> list[Any]:
        """Wait for `refs` (of `ranks`, default one per rank in order) and return their values.

        A dead rank is reported at once. Once a rank has failed, its peers get the collective
        timeout (plus a grace) to fail too; a rank still silent then is stalled, and reported."""
        rank_of = dict(zip(refs, self._ranks(ranks)))
        deadline = None if timeout is None else time.monotonic() + timeout
        pending, failed, values = list(refs), None, {}
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = ", ".join(self.describe_rank(rank_of[r]) for r in pending)
                if failed is None:
                    raise TimeoutError(f"rollout replica {self.name!r}: {what} not done after {timeout}s on {late}")
                self._dead = (
                    f"rollout replica {self.name!r}: {late} stalled during {what} "
                    f"after {self.describe_rank(rank_of[failed])} failed"
                )
                try:
                    self._result(failed, rank_of[failed])
                except Exception as e:
                    raise ReplicaError(self._dead) from e
            fault = _replica_fault(ready[0])
            if isinstance(fault, CollectiveError) and not isinstance(fault, LeftGroup):
                # A collective fails on every rank but the one that broke the group: report that one, if it shows.
                cause = self._cause_of_collective_error([r for r in refs if r != ready[0]], what, rank_of)
                if cause is not None:
                    ref, fault = cause
                    ready = [ref]
            if fault is not None:
                rank = self.describe_rank(rank_of[ready[0]])
                if isinstance(fault, RayActorError):
                    self._dead = f"rollout replica {self.name!r}: {rank} died during {what}: {_summary(fault)}"
                elif isinstance(fault, LeftGroup):
                    self._dead = f"rollout replica {self.name!r}: {rank} refused {what}: {fault}"
                else:  # a collective of the replica's own group failed: the group is broken for good
                    late = ", ".join(self.describe_rank(rank_of[r]) for r in pending) or "a peer"
                    self._dead = (f"rollout replica {self.name!r}: {rank} left a collective during {what} because "
                                  f"{late} died or stalled ({fault})")
                raise ReplicaError(self._dead) from None
            try:
                values[ready[0]] = ray.get(ready[0])
            except Exception:
                if failed is None:
                    failed = ready[0]
                    # Its peers get the collective timeout and a grace to answer (they fail their own collective meanwhile),
                    # else they are reported as stalled.
                    grace = time.monotonic() + self.collective_timeout_s + answer_grace_s(self.collective_timeout_s)
                    deadline = grace if deadline is None else min(deadline, grace)
        # In rank order: the lowest failing rank's error is raised.
        return [values[ref] if ref in values else self._result(ref, rank_of[ref]) for ref in refs]

    def _cause_of_collective_error(self, refs: list[ray.ObjectRef], what: str, rank_of: dict[ray.ObjectRef, int]
                                   ) -> tuple[ray.ObjectRef, RayActorError | LeftGroup] | None:
        """After a rank's collective failed: the first of the other ranks' `refs` that shows, within PEER_FAILURE_GRACE_S,
        that it died or refused the call having left the group ((ref, its error), reported instead), or raised its own
        error between two collectives (the replica goes out of service, that rank having closed its group, and its
        error is raised: it is the request's). None if none does (a peer stalled)."""
        deadline = time.monotonic() + PEER_FAILURE_GRACE_S
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            try:
                ray.get(ready[0], timeout=0)
            except RayActorError as death:
                return ready[0], death
            except RayTaskError as e:
                if isinstance(e.cause, LeftGroup):
                    return ready[0], e.cause
                if not isinstance(e.cause, CollectiveError):
                    rank = self.describe_rank(rank_of[ready[0]])
                    self._dead = (f"rollout replica {self.name!r}: {rank} failed during {what} between two collectives "
                                  f"and left the replica's group")
                    self._result(ready[0], rank_of[ready[0]])
        return None

    def _result(self, ref: ray.ObjectRef, rank: int) -> Any:
        """`ref`'s value, or its task's own exception (e.g. the ConfigError naming a request field) noting
        the rank; the remote traceback stays attached as its cause. Ranks fail alike (validation runs
        before any collective), so the lowest failing rank's error is the one raised."""
        try:
            return ray.get(ref)
        except RayTaskError as e:
            if not isinstance(e.cause, Exception):
                raise
            e.cause.add_note(f"(raised on {self.describe_rank(rank)} of rollout replica {self.name!r})")
            raise e.cause from e

    def shutdown(self) -> None:
        """Close the process groups of a replica in service, kill the ranks, free the placement group. A replica
        out of service is killed at once: a stalled rank would not answer, and killing frees its groups too.
        Idempotent."""
        if self.placed is None:
            return
        if self._dead is None:
            ray.wait([w.close.remote() for w in self.workers], num_returns=len(self.workers), timeout=5.0)
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.placed.remove()
        self.placed = None
        self._dead = self._dead or f"rollout replica {self.name!r} was shut down"

    def __enter__(self) -> "RolloutReplica":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
