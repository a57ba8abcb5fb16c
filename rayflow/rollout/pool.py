"""RolloutPool: `rollout.num_replicas` replicas serving requests, with every replica failure handled inside.

    pool = RolloutPool.create(spec, cfg.rollout)   # every replica started and loaded
    pool.sync_with(weight_sync)                    # the group that a dead replica leaves and a replacement joins
    future = pool.submit(request)                  # a PoolFuture: good until the request is sampled, whatever dies
    ray.wait(pool.refs + pool.replacement_refs, num_returns=1)  # finished (or failed), or a replacement moved on
    for future in pool.collect(): ...              # the requests sampled since the last call, each once

Routing: a request goes to the live replica with the fewest samples in flight (ties: the lowest index).
Every request carries its own seeds and each sample draws from its own generators, so its trajectories
do not depend on the replica that served it, nor on how often it was sent.

What the caller never sees (it is told by the log, and `dead` / `restarts` count it):
- a rank dies, or leaves a collective because a peer died or stalled: the replica goes out of service,
  the weight-sync group is re-formed without its ranks, its requests go to the live replicas (or wait
  while none is live and a replacement starts), and its replacement starts (`rollout.max_restarts`
  times per replica within any `rollout.restart_window_s` seconds);
- a rank stops without dying (SIGSTOP, a stuck kernel): past the watchdog's deadline the replica is
  reported (ranks, nodes, requests) and handled as dead;
- a replacement serves once all its ranks joined and the weight sync staged the current version on
  it, so it never samples under stale weights;
- the weight sync lost a receiver (`find_dead`): the replicas are asked, the dead ones handled as above.

What it raises: a request's own error (a field its params contradict) from `collect`, and ReplicaError
once every replica is out of service with no replacement starting.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol

import ray

from rayflow.cfg.policy import CFGPolicy
from rayflow.config import RolloutConfig
from rayflow.distributed.placement import Reservation
from rayflow.distributed.restart_budget import RestartBudget
from rayflow.distributed.watchdog import Watchdog
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.rollout.replica import ReplicaError, RolloutFuture, RolloutReplica
from rayflow.types import RolloutRequest, Trajectory

log = logging.getLogger("rayflow")


class ReplicaMembership(Protocol):
    """The weight sync as the pool needs it: re-form its group with the live replicas; bring a replacement
    into it at the current version."""

    def connect(self, replicas: list[RolloutReplica]) -> None: ...

    def attach(self, replica: RolloutReplica, replicas: list[RolloutReplica]) -> None: ...


class PoolFuture:
    """One request in the pool's care. `attempt` is its current run on a replica (None while it waits for one);
    `finished` once `collect` returned it."""

    def __init__(self, request: RolloutRequest, policy: CFGPolicy | None, weights: ray.ObjectRef | None):
        self.request, self.policy, self.weights = request, policy, weights
        self.attempt: RolloutFuture | None = None
        self.finished = False

    @property
    def replica(self) -> RolloutReplica:
        return self.attempt.replica

    @property
    def ref(self) -> ray.ObjectRef:
        """Rank 0's trajectories, to hand on without fetching them."""
        return self.attempt.ref

    def result(self) -> list[Trajectory]:
        """The trajectories, once finished."""
        return self.attempt.result()


REPLACEMENT_PLACEMENT_S = 600.0
"""How long a replacement's placement may take (an autoscaler adding a node for it) before it counts as lost."""


class RolloutPool:
    def __init__(self, replicas: list[RolloutReplica], start_replica: Callable[..., RolloutReplica] | None = None,
                 max_restarts: int = 0, restart_window_s: float = 0.0, watchdog: Watchdog | None = None,
                 reserve_replica: Callable[[str], Reservation] | None = None):
        """`start_replica(name[, reservation])` starts a replacement replica (without waiting for it to load); None: no
        restarts. With `reserve_replica(name)`, a replacement's placement is asked for first and the replica started
        once it is placed, the pool serving meanwhile (placed inside `start_replica`, the driver waited up to
        REPLACEMENT_PLACEMENT_S for a node that had gone, then stopped). Each replica may be replaced `max_restarts`
        times within any `restart_window_s` seconds (0: in all). `watchdog`: the deadlines of busy replicas (None:
        none, a stopped rank is waited for)."""
        if not replicas:
            raise ValueError("a RolloutPool needs at least one replica")
        self.replicas = replicas
        self._start_replica = start_replica
        self._reserve_replica = reserve_replica
        self.max_restarts = max_restarts if start_replica is not None else 0
        self.restarts = [0] * len(replicas)
        """Replacements started per replica, over the whole run."""
        self.budgets = [RestartBudget(self.max_restarts, restart_window_s) for _ in replicas]
        self.starting: dict[int, RolloutReplica] = {}
        """Replacements still loading, by the index of the replica they replace."""
        self.placing: dict[int, tuple[Reservation, float]] = {}
        """Replacements' placements asked for and not placed yet (with their deadlines), by that index."""
        self.dead: list[RolloutReplica] = []
        """Replicas taken out of service, in order."""
        self.watchdog = watchdog or Watchdog(float("inf"), 1.0)
        self.membership: ReplicaMembership | None = None
        self.in_flight: list[PoolFuture] = []
        self.waiting: list[PoolFuture] = []
        """Requests with no live replica to serve them while replacements start."""

    @classmethod
    def create(cls, spec: RolloutRankSpec, rollout: RolloutConfig, name: str = "rollout") -> "RolloutPool":
        """Start every replica (their actors load concurrently), then wait for all of them; a pool one of whose
        replicas fails to start is shut down (the placement groups stayed reserved until the driver exited)."""
        pool = cls.start(spec, rollout, name)
        try:
            return pool.wait_ready()
        except BaseException:
            pool.shutdown()
            raise

    @staticmethod
    def reserve(rollout: RolloutConfig, name: str = "rollout") -> list[Reservation]:
        """Every replica's placement, asked for without waiting."""
        return [RolloutReplica.reserve(rollout, f"{name}-{i}") for i in range(rollout.num_replicas)]

    @classmethod
    def start(cls, spec: RolloutRankSpec, rollout: RolloutConfig, name: str = "rollout",
              reservations: list[Reservation] | None = None) -> "RolloutPool":
        """Start every replica without waiting for them to load (`wait_ready` does); `reservations`: their
        placements asked for already (`RolloutPool.reserve`)."""
        def start(replica_name: str, reservation: Reservation | None = None) -> RolloutReplica:
            return RolloutReplica(spec, rollout, replica_name, reservation)

        reservations = reservations or cls.reserve(rollout, name)
        replicas: list[RolloutReplica] = []
        try:
            for i, reservation in enumerate(reservations):
                replicas.append(start(f"{name}-{i}", reservation))
        except BaseException:  # a placement that timed out, a rank that failed: free what the others hold
            for replica in replicas:
                replica.shutdown()
            for reservation in reservations:
                reservation.shutdown()  # those not taken yet
            raise
        watchdog = Watchdog(rollout.stall_timeout_s, rollout.stall_factor)
        return cls(replicas, start, rollout.max_restarts, rollout.restart_window_s, watchdog,
                   reserve_replica=lambda replica_name: RolloutReplica.reserve(rollout, replica_name))

    def wait_ready(self) -> "RolloutPool":
        """Wait until every replica's ranks loaded their models and joined their groups."""
        for replica in self.replicas:
            replica.wait_ready()
        return self

    def sync_with(self, membership: ReplicaMembership) -> None:
        """The weight sync: a dead replica leaves its group, a replacement joins it and catches up before serving."""
        self.membership = membership

    # -- requests ------------------------------------------------------------------------------------
    def submit(self, request: RolloutRequest, policy: CFGPolicy | None = None,
               weights: ray.ObjectRef | None = None) -> PoolFuture:
        """Sample `request` (under `policy`, default the spec's; `weights`: synced-slot tensors to sample under
        instead of the applied version, RolloutReplica.submit's)."""
        future = PoolFuture(request, policy, weights)
        self._send(future)
        return future

    def map(self, requests: list[RolloutRequest], policy: CFGPolicy | None = None,
            weights: ray.ObjectRef | None = None) -> list[PoolFuture]:
        """Submit every request; futures in request order."""
        return [self.submit(r, policy, weights) for r in requests]

    @property
    def refs(self) -> list[ray.ObjectRef]:
        """One completion per request in flight: `ray.wait` on them returns when one finished or failed."""
        return [f.attempt.refs[0] for f in self.in_flight]

    @property
    def replacement_refs(self) -> list[ray.ObjectRef]:
        """What the replacements being started wait on: each one's placement, or its ranks still loading their model
        and joining. `ray.wait` on them with `refs` returns as soon as `collect` can move a replacement on, rather than
        at the caller's next poll (a dead replica's requests waited out two of them, 2 s on CPU). A placement or a
        replica's start-up that is done already is among them (`ray.wait` returns at once, and `collect` takes it in):
        left out, a replacement placed or up before the call waited a whole poll."""
        refs = [reservation.ready_ref() for reservation, _ in self.placing.values()]
        for replica in self.starting.values():
            _, loading = ray.wait(replica.join_refs, num_returns=len(replica.join_refs), timeout=0)
            refs += loading or replica.join_refs  # ranks up already are left out while a peer loads: no spinning
        return refs

    def collect(self) -> list[PoolFuture]:
        """Without waiting: the requests sampled since the last call. Requests of replicas that died are sent
        again, stalled replicas replaced, replacements that finished loading put into service."""
        self._promote_ready()
        finished, failed, still = [], [], []
        for future in self.in_flight:
            if not future.attempt.done():
                still.append(future)
                continue
            try:
                future.attempt.wait(timeout=0)
            except ReplicaError as e:  # the replica is out of service; another one samples the request
                log.warning("%s; re-sending request %s", e, future.request.request_id)
                failed.append(future)
                continue
            future.finished = True
            finished.append(future)
        self.in_flight = still
        for future in failed:
            self._out_of_service(future.replica)
            self._send(future)
        for replica in {f.replica for f in finished}:
            self.watchdog.progressed(replica, still_busy=any(f.replica is replica for f in self.in_flight))
        self._replace_stalled()
        return finished

    def _send(self, future: PoolFuture) -> None:
        live = [i for i, r in enumerate(self.replicas) if r.alive]
        if not live:
            if not (self.starting or self.placing):
                raise ReplicaError(f"every rollout replica of the pool is out of service ({len(self.replicas)} replicas)")
            self.waiting.append(future)
            return
        replica = self.replicas[min(live, key=self._samples_in_flight)]
        future.attempt = replica.submit(future.request, future.policy, future.weights)
        self.in_flight.append(future)
        self.watchdog.busy(replica)

    def _samples_in_flight(self, index: int) -> int:
        replica = self.replicas[index]
        return sum(len(f.request.seeds) for f in self.in_flight if f.replica is replica and not f.attempt.done())

    def drop_in_flight(self) -> None:
        """Wait for the requests in flight (a replica serves in order, so later ones must not queue behind them) and
        forget them: they belong to steps being rewound."""
        refs = self.refs
        ray.wait(refs, num_returns=len(refs), timeout=self.watchdog.deadline_s())
        for future in self.in_flight:
            self.watchdog.forget(future.replica)
        self.in_flight, self.waiting = [], []

    # -- failures ------------------------------------------------------------------------------------
    def find_dead(self) -> None:
        """The weight sync lost a receiver: take the dead replicas out of service; there must be one."""
        if not self.take_out_dead():
            raise RuntimeError("weight sync lost a receiver, but every rollout replica answers")

    def take_out_dead(self) -> list[RolloutReplica]:
        """Ask every replica in service; take the dead ones out of service (each replaced while restarts last)."""
        dead = [r for r in self.replicas if r.alive and not r.check_alive()]
        for replica in dead:
            self._out_of_service(replica)
        return dead

    def _out_of_service(self, replica: RolloutReplica) -> None:
        """Leave a dead replica out of the weight sync and start its replacement (rollout.max_restarts)."""
        if replica in self.dead:
            return
        self.dead.append(replica)
        self.watchdog.forget(replica)
        if self.replace(replica):
            log.warning("rollout replica %r died; starting its replacement", replica.name)
        else:
            log.warning("rollout replica %r died and its restarts are used up; going on without it", replica.name)
        if self.membership is not None:
            self.membership.connect(self.replicas)  # a new sync group, without the dead ranks

    def replace(self, replica: RolloutReplica) -> bool:
        """Shut the dead `replica` down and start its replacement; False when its restarts are used up."""
        replica.shutdown()  # frees its placement group for the replacement
        return self._restart(self.replicas.index(replica))

    def _restart(self, index: int) -> bool:
        if index in self.starting or index in self.placing or not self.budgets[index].take():
            return False
        self.restarts[index] += 1
        name = self.replicas[index].name
        if self._reserve_replica is None:
            self.starting[index] = self._start_replica(name)
        else:
            self.placing[index] = (self._reserve_replica(name), time.monotonic() + REPLACEMENT_PLACEMENT_S)
        return True

    def _start_placed(self) -> None:
        """Start each replacement whose placement is ready; one not placed by its deadline counts as another death."""
        for index, (reservation, deadline) in list(self.placing.items()):
            if reservation.placed():
                del self.placing[index]
                self.starting[index] = self._start_replica(self.replicas[index].name, reservation)
            elif time.monotonic() > deadline:
                del self.placing[index]
                reservation.shutdown()
                log.warning("the replacement of rollout replica %r was not placed within %.0fs (bundles %s); %s",
                            self.replicas[index].name, REPLACEMENT_PLACEMENT_S, reservation.bundles,
                            "replacing it again" if self._restart(index) else "its restarts are used up; going on "
                                                                              "without it")

    def _replace_stalled(self) -> None:
        """A replica past the watchdog's deadline is reported (ranks, nodes, requests) and taken out of service; its
        requests fail when its ranks are killed and are sent again by the next `collect`."""
        for replica, silent_s in self.watchdog.overdue():
            futures = [f for f in self.in_flight if f.replica is replica]
            late = replica.late_ranks(futures[0].attempt) if futures else []
            message = (
                f"rollout replica {replica.name!r} stalled: {', '.join(late) or 'its ranks'} finished nothing for "
                f"{silent_s:.0f}s (deadline {self.watchdog.deadline_s():.0f}s, rollout.stall_timeout_s="
                f"{self.watchdog.floor_s}) while sampling requests {[f.request.request_id for f in futures]}; "
                f"replacing it and re-issuing them"
            )
            log.error("%s", message)
            replica.mark_stalled(message)
            self._out_of_service(replica)

    def _promote_ready(self) -> None:
        """Put every replacement whose ranks all joined into service, once the weight sync brought it to the current
        version; then the requests waiting for a live replica go out. A replacement that failed to start counts as
        another death: it is replaced again while restarts are left."""
        self._start_placed()
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
            self.replicas[index] = replica
            if self.membership is not None:
                self.membership.attach(replica, self.replicas)
            log.warning("rollout replica %r is back in service", replica.name)
        if self.waiting and not any(r.alive for r in self.replicas) and not (self.starting or self.placing):
            # The replacements they waited for failed to start or to be placed, their restarts used up: nothing will
            # ever serve them (collect returned nothing, forever, and the driver polled on).
            raise ReplicaError(f"every rollout replica of the pool is out of service ({len(self.replicas)} replicas) "
                               f"and none is being replaced; {len(self.waiting)} requests were waiting for one")
        if self.waiting and any(r.alive for r in self.replicas):
            waiting, self.waiting = self.waiting, []
            for future in waiting:
                self._send(future)

    def shutdown(self) -> None:
        for replica in self.replicas + list(self.starting.values()):
            replica.shutdown()
        for reservation, _ in self.placing.values():
            reservation.shutdown()
        self.starting, self.placing = {}, {}

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
