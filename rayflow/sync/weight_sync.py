"""WeightSync: the driver-side handle of the WeightSyncActor and its group with the rollout ranks.

    sync = WeightSync(cfg.sync, rollout_spec, pool.replicas)   # actor placed, group formed
    learners.push_weights(sync.actor)                          # learner rank 0 pushes version v
    sync.wait(v)                                               # staged on every rollout rank
    sync.attach(new_replica, pool.replicas)                    # late joiner: new group, current version

The version protocol is rayflow.sync.source.WeightSource's. When a receiver dies, or stalls (no answer
within the collective timeout), `wait` raises rayflow.sync.source.ReceiversLost (and `lost_versions` lists
them) within `deadline_s`: `connect` the live replicas again and the newest version is broadcast to the new
generation.

`failure()` answers at once with what stopped the sync (WeightSyncError: a refused push, a failed
broadcast; or the actor's death), from one `watch` call kept in flight, or WeightSyncStalled once `connect`
found the actor stopped (the rollout pool connects as a replica dies or comes back: raised there, it stopped
the run). A dead or stalled actor is replaced in its bundle by `restart` (sync.max_restarts per
sync.restart_window_s), which re-forms the group; the caller then pushes the current version again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import ray
import torch

from rayflow.config import SyncConfig
from rayflow.distributed.placement import Reservation, resolve_gpus
from rayflow.distributed.placement import reserve as reserve_placement
from rayflow.distributed.restart_budget import RestartBudget
from rayflow.errors import one_line
from rayflow.models.synced import SyncedModelSpec
from rayflow.sync.actor import WeightSyncActor
from rayflow.sync.source import SyncReport, SyncSpec, WeightSyncError

log = logging.getLogger("rayflow")


class WeightSyncStalled(TimeoutError):
    """The weight-sync actor neither died nor took a push within the sync's timeout (stuck in it, or stopped), or did
    not settle for `connect` within its deadline."""


class SyncedReplica(Protocol):
    """What WeightSync needs of a rollout replica (rayflow.rollout.RolloutReplica is one)."""

    name: str
    world_size: int
    workers: list[ray.actor.ActorHandle]
    """Rank actors serving `join_sync`, `receive_weights`, `rewind_weights` and `abandon_waits`
    (rayflow.rollout.worker.RolloutRankHost)."""

    @property
    def alive(self) -> bool: ...

    def describe_rank(self, rank: int) -> str: ...

    def stage_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> list[ray.ObjectRef]: ...


class WeightSync:
    def __init__(self, cfg: SyncConfig, rollout_spec: SyncedModelSpec, replicas: list[SyncedReplica] | None,
                 timeout_s: float = 300.0, name: str = "rayflow-weight-sync", reservation: Reservation | None = None):
        """`rollout_spec`: what the rollout ranks hold (a rayflow.rollout.RolloutRankSpec is one); only its
        SyncedModelSpec fields cross to the actor. `replicas` None: the actor starts, and `connect` forms the group
        later (once the replicas are up). `reservation`: the actor's placement asked for already
        (`WeightSync.reserve`)."""
        self.cfg = cfg
        self.placed = (reservation or self.reserve(cfg, name)).wait()
        self.spec = SyncSpec(cfg.mode, cfg.bucket_mb, cfg.verify_checksum, timeout_s)
        self.synced = rollout_spec.synced_model()
        self.timeout_s = timeout_s
        self.deadline_s = self.spec.broadcast_deadline_s + self.spec.grace_s
        """How long to `wait` for a version: past the actor's own verdict on its broadcast (ReceiversLost)."""
        self.generation = 0
        self.budget = RestartBudget(cfg.max_restarts, cfg.restart_window_s)
        self.restarts = 0
        """Replacements of a dead actor started."""
        self._start_actor()
        if replicas is None:
            return
        try:
            self.connect(replicas)
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def reserve(cfg: SyncConfig, name: str = "rayflow-weight-sync") -> Reservation:
        """The actor's placement, asked for without waiting."""
        return reserve_placement(1, cfg.cpus, resolve_gpus(cfg.gpus), cfg.resources, name=name)

    def _start_actor(self) -> None:
        # No restarts by Ray: a new actor must join a new group generation, which `restart` forms.
        self.actor = self.placed.spawn(0, WeightSyncActor, self.spec, self.synced, max_restarts=0)
        self._watch = self.actor.watch.remote()
        self.stalled: WeightSyncStalled | None = None
        """Set when `connect` found this actor stalled: `failure()` reports it, `wait` and `lost_versions` raise it."""

    def connect(self, replicas: list[SyncedReplica]) -> None:
        """Form a new generation of the group: the actor as rank 0, every rank of every live replica after it.
        Raises TimeoutError naming the ranks that did not join (stalled) instead of waiting for them forever. An actor
        that does not settle within `deadline_s` (stopped) is marked `stalled` and no group formed: the driver replaces
        it (`restart`, from `failure()`), which connects the live replicas then; its callers (the rollout pool, which
        connects as a replica dies or comes back) go on meanwhile. A dead actor forms none either, and is replaced alike
        (one node lost with a rollout replica: the pool's `connect` for the replica raised its death out of the loop)."""
        if self.stalled is not None:
            return  # its replacement connects every live replica
        members = _ranks_in_service(replicas)
        workers = [r.workers[rank] for r, rank in members]
        self.generation += 1
        name = f"rayflow-weight-sync-{self.generation}"
        # A broadcast in flight (to a lost receiver: up to deadline_s) ends first, or the ranks' store connects would
        # time out (one collective timeout) while the actor finishes it before it can host the new group.
        settled = self.actor.settle.remote()
        if not ray.wait([settled], timeout=self.deadline_s)[0]:
            self.stalled = WeightSyncStalled(f"weight-sync group {name!r} not formed: the actor did not settle (end "
                                             f"its broadcast in flight) within {self.deadline_s:.0f}s: stuck or stopped")
            log.error("%s; the driver replaces it", self.stalled)
            return
        try:
            ray.get(settled)
        except ray.exceptions.RayActorError:  # dead: `failure()` reports it, and its replacement connects the replicas
            return
        rendezvous = self.actor.rendezvous.remote()
        size = len(workers) + 1
        joins = [w.join_sync.remote(rendezvous, name, i + 1, size) for i, w in enumerate(workers)]
        refs = [self.actor.join.remote(rendezvous, name, workers), *joins]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.deadline_s + self.timeout_s)
        late = _late_ranks(members, joins, ready)
        if late:
            raise TimeoutError(f"weight-sync group {name!r}: {late} did not join within "
                               f"{self.deadline_s + self.timeout_s:.0f}s (stalled)")
        ray.get(refs)

    def slot_tensors(self, adapter: dict[str, torch.Tensor]) -> ray.ObjectRef:
        """`adapter` (full tensors of a learner adapter) as the rollout ranks' slot holds it (merged mode: folded into
        the base weights), to sample a request under: the evaluation EMA."""
        return self.actor.slot_tensors.remote(adapter)

    def wait(self, version: int, timeout_s: float | None = None, check: Callable[[], None] | None = None,
             check_every_s: float = 1.0) -> SyncReport:
        """Block until `version` is staged on every rollout rank; raises the sync's failure, or TimeoutError when it is
        not staged within `timeout_s` (the actor's verdict; a stopped actor, which gives none, a grace later; one
        `connect` found stalled, at once). `check`, called every `check_every_s` while waiting, may raise to stop the
        wait: the caller's look at what the version depends on (the learner that owns its push until the actor took
        it; dead, the version never comes, and only the deadline said so)."""
        if self.stalled is not None:
            raise self.stalled
        staged = self.actor.wait.remote(version, timeout_s)
        end = None if timeout_s is None else time.monotonic() + timeout_s + self.spec.grace_s
        while check is not None and (end is None or time.monotonic() < end):
            if ray.wait([staged], timeout=check_every_s)[0]:
                break
            check()
        return ray.get(staged, timeout=None if end is None else max(0.0, end - time.monotonic()))

    def lost_versions(self) -> list[int]:
        """Versions whose broadcast met a dead receiver since the last `connect`; raises the sync's failure, or
        TimeoutError when the actor gives no answer within the sync's timeout (stopped: its other threads answer while
        one is stuck in a push; one `connect` found stalled, at once)."""
        if self.stalled is not None:
            raise self.stalled
        return ray.get(self.actor.lost_versions.remote(), timeout=self.timeout_s)

    @property
    def watching(self) -> ray.ObjectRef:
        """The actor's `watch` call: finishes (with an error) only when the sync stops or the actor dies."""
        return self._watch

    def failure(self, timeout_s: float = 0.0) -> BaseException | None:
        """What stopped the sync, or None while it runs (waiting up to `timeout_s`): WeightSyncError (a refused push,
        a failed broadcast; its cause chained), RayActorError (the actor died: `restart` it), or WeightSyncStalled
        (`connect` found it stopped: `restart` it)."""
        if self.stalled is not None:
            return self.stalled
        if not ray.wait([self._watch], timeout=timeout_s)[0]:
            return None
        try:
            ray.get(self._watch)
        except ray.exceptions.RayTaskError as e:
            return e.cause or e
        except ray.exceptions.RayError as e:
            return e
        raise AssertionError("WeightSyncActor.watch returned without a failure")

    def restart(self, replicas: list[SyncedReplica], died: BaseException) -> None:
        """Replace the dead actor (`died` a WeightSyncStalled: the stalled one, killed first) in its bundle and form a
        new group generation with the live `replicas`; the caller pushes the current version again. Raises
        WeightSyncError once sync.max_restarts per sync.restart_window_s are used up."""
        cause, what = one_line(died), "stalled" if isinstance(died, WeightSyncStalled) else "died"
        if not self.budget.take():
            raise WeightSyncError(
                f"the weight-sync actor {what} ({cause}) and its restarts are used up (sync.max_restarts="
                f"{self.cfg.max_restarts} per sync.restart_window_s={self.cfg.restart_window_s}); stopping the run"
            ) from died
        self.restarts += 1
        log.error("the weight-sync actor %s (%s); replacing it (restart %d) and re-forming its group", what, cause,
                  self.restarts)
        self._replace_actor(replicas)

    def rewind(self, version: int, replicas: list[SyncedReplica]) -> None:
        """The learners restarted from a checkpoint of `version`: the versions after it are void. A new actor (so no
        push of the lost learners reaches the rollouts) and a new group; every rank of the live `replicas` drops the
        newer versions it holds (rayflow.sync.receiver.WeightReceiver.rewind). The caller pushes `version` next.
        Raises TimeoutError naming the ranks that did not answer within the time a join gets (stopped: asked with no
        deadline, the driver hung), the actor killed and no group formed; the caller takes them out and asks again."""
        ray.kill(self.actor)  # first: it broadcasts none of those versions after the ranks forgot them
        members = _ranks_in_service(replicas)
        refs = [r.workers[rank].rewind_weights.remote(version) for r, rank in members]
        # A rank's weights thread may first end a receive from the killed actor (its collective timeout).
        deadline_s = self.deadline_s + self.timeout_s
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=deadline_s) if refs else ([], [])
        late = _late_ranks(members, refs, ready)
        if late:
            raise TimeoutError(f"rewinding the rollout weights to version {version}: {late} did not answer "
                               f"within {deadline_s:.0f}s (stalled)")
        ray.get(refs)
        self._replace_actor(replicas)

    def abandon_waits(self, replicas: list[SyncedReplica]) -> None:
        """The learners died: every rank of the live `replicas` fails the requests that wait for a version until the
        `rewind` (rayflow.sync.receiver.WeightReceiver.abandon_waits), so that dropping the requests in flight does not
        wait for versions that will never come. A dead or stopped rank is not waited for: the pool finds it."""
        refs = [w.abandon_waits.remote() for r in replicas if r.alive for w in r.workers]
        ray.wait(refs, num_returns=len(refs), timeout=self.spec.grace_s)

    def _replace_actor(self, replicas: list[SyncedReplica]) -> None:
        ray.kill(self.actor)
        self._start_actor()
        self.connect(replicas)

    def attach(self, replica: SyncedReplica, replicas: list[SyncedReplica]) -> None:
        """Bring a restarted or added `replica` (one of `replicas`) into the group, and stage the current
        version on it before it serves a request."""
        self.connect(replicas)
        if self.stalled is not None:  # its replacement receives the version pushed after the restart
            return
        try:
            current = ray.get(self.actor.current.remote())
        except ray.exceptions.RayActorError:  # dead: its replacement receives the version pushed after the restart
            return
        if current is not None and current[0] > 0:  # a new rank holds version 0 (the initial adapter) already
            ray.get(replica.stage_weights(*current))

    def shutdown(self) -> None:
        ray.wait([self.actor.close.remote()], timeout=5.0)
        ray.kill(self.actor)
        self.placed.remove()


def _ranks_in_service(replicas: list[SyncedReplica]) -> list[tuple[SyncedReplica, int]]:
    """(replica, rank) for every rank of every live replica, in the group's order."""
    return [(r, rank) for r in replicas if r.alive for rank in range(r.world_size)]


def _late_ranks(members: list[tuple[SyncedReplica, int]], refs: list[ray.ObjectRef], ready: list[ray.ObjectRef]) -> str:
    """The ranks of `members` whose call in `refs` (one each, in order) is not among `ready`, named for an error ("" if
    none)."""
    return ", ".join(f"{r.describe_rank(rank)} of rollout replica {r.name!r}" for (r, rank), ref in zip(members, refs)
                     if ref not in ready)
