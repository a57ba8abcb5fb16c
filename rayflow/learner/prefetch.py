"""Trajectories on their way to a learner rank: fetched as their rollout requests finish, not after the batch forms.

    cache = TrajectoryCache(max_staleness)
    cache.prefetch([ref], version)          # a rollout request finished (a thread of its own: runs beside training)
    shard, stats = cache.fetch(light)       # the train step: (ref, index, advantage) entries → Trajectories
    cache.forget_before(version)            # after the step: what no later step can train on

Each rollout request returns one ObjectRef to its list of trajectories. The driver hands that ref to every learner
rank the moment the request finishes, while the batch's other requests still roll out. What a rank does with it
depends on whether it trains the whole batch:

- one rank (`hold=True`): every request is its own, so it deserializes the list now and keeps it; the train step
  finds its data in memory.
- one of several ranks (`hold=False`): a rank cannot know before the batch forms which requests its shard will
  hold, and deserializing every request on every rank would cost each rank the whole batch's bytes and memory. It
  only pulls the request onto its node (`ray.wait(fetch_local=True)`: over the network once per node, however many
  ranks run there; the ranks of one node read the same copy); the train step deserializes its own requests from
  the node's object store, with no network wait.

An entry the cache does not hold (not prefetched, a pulled-only request, or a prefetch that failed) is fetched
with `ray.get`, so what the step trains on never depends on the cache: only when the bytes move.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time

import ray

from rayflow.types import Trajectory

LightEntry = tuple  # (ObjectRef to a request's list[Trajectory], index in it, advantage)


def without_images(trajectories: list[Trajectory]) -> list[Trajectory]:
    """Learners never read the decoded images: the cache does not hold them."""
    return [dataclasses.replace(t, image=None) for t in trajectories]


@dataclasses.dataclass
class FetchStats:
    """How one train step came by its trajectories."""

    wait_s: float
    """Seconds the step waited for trajectories (fetching the misses, waiting for prefetches still landing)."""
    requests: int
    """Rollout requests whose trajectories the step needed."""
    prefetched: int
    """Of those, the ones a prefetch had already fetched (or pulled onto this node), or was doing so, when the step
    asked; a prefetch that failed is not counted (the step fetched that request itself)."""


class TrajectoryCache:
    """One learner rank's rollout requests fetched ahead of their train step, keyed by ObjectRef.

    `prefetch` and `fetch` may run on different threads (a threaded actor's concurrency groups); every entry is a
    future, created before its fetch starts, so a step asking for a request still landing waits for that fetch
    rather than starting a second one."""

    def __init__(self, max_staleness: int, hold: bool = True):
        """`max_staleness`: async.max_staleness. A request finished at driver version u is trained at a version
        ≤ u + max_staleness (its oldest step is no older than u), so older entries can be forgotten.
        `hold`: deserialize prefetched requests and keep their trajectories (a rank that trains the whole batch);
        False: only pull them onto this node (one rank of several)."""
        self.max_staleness = max_staleness
        self.hold = hold
        self._entries: dict[ray.ObjectRef, tuple[int, concurrent.futures.Future]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def prefetch(self, refs: list[ray.ObjectRef], version: int) -> None:
        """Fetch the trajectory lists of finished rollout requests (finished at driver version `version`), or with
        hold=False pull them onto this node. A failed fetch is kept as the future's exception; `fetch` then tries
        again itself."""
        mine = []
        with self._lock:
            for ref in refs:
                if ref not in self._entries:
                    future = concurrent.futures.Future()
                    self._entries[ref] = (version, future)
                    mine.append((ref, future))
        for ref, future in mine:
            try:
                if self.hold:
                    future.set_result(without_images(ray.get(ref)))
                else:  # a failed rollout's error object counts as ready here; `fetch` raises it
                    ray.wait([ref], fetch_local=True)
                    future.set_result(None)
            except Exception as e:  # noqa: BLE001 (kept for `fetch`, which fetches it again and raises there)
                future.set_exception(e)

    def fetch(self, shard: list[Trajectory | LightEntry]) -> tuple[list[Trajectory], FetchStats]:
        """`shard` as Trajectories: (ref, index, advantage) entries from the cache or, for the requests it does not
        hold, from the object store (each request's list once), given their advantage; Trajectories as they are."""
        start = time.perf_counter()
        refs = list(dict.fromkeys(item[0] for item in shard if isinstance(item, tuple)))
        with self._lock:
            prefetched = {ref: self._entries[ref][1] for ref in refs if ref in self._entries}
        lists, landed = {}, 0
        for ref, future in prefetched.items():
            try:
                held = future.result()  # waits for a prefetch still landing
            except Exception:  # noqa: BLE001 (the prefetch failed: fetched below, raising what the object store says)
                continue
            landed += 1
            if held is not None:
                lists[ref] = held
        missing = [ref for ref in refs if ref not in lists]
        if missing:
            lists.update(zip(missing, (without_images(x) for x in ray.get(missing))))
        trajectories = [
            dataclasses.replace(lists[item[0]][item[1]], advantage=item[2]) if isinstance(item, tuple) else item
            for item in shard
        ]
        return trajectories, FetchStats(time.perf_counter() - start, len(refs), landed)

    def forget(self, refs: list[ray.ObjectRef]) -> None:
        """Drop `refs` (a trained batch's requests: each request belongs to one group, trained once)."""
        with self._lock:
            for ref in refs:
                self._entries.pop(ref, None)

    def forget_before(self, version: int) -> None:
        """Drop the requests no step at learner version ≥ `version` can train on (groups regenerated or dropped as
        too stale): those finished before version − max_staleness − 1. The one version of slack: a rollout may
        sample under a version its learner made before the driver counted it."""
        with self._lock:
            for ref in [r for r, (v, _) in self._entries.items() if v < version - self.max_staleness - 1]:
                del self._entries[ref]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
