"""Watchdog: a deadline for every replica the driver waits on, derived from measured service times.

A rank stopped by the OS (SIGSTOP, a stuck CUDA/NCCL call, a swapped-out host) neither answers nor
dies: Ray reports nothing and the driver would wait forever. The watchdog tracks, per replica with
work in flight, how long it has gone without finishing anything. Each finished request measures the
time it took since the replica last made progress (its service time); a replica silent for longer
than

    deadline = max(floor_s, factor · the longest of the last `window` service times)

is overdue. Queueing does not inflate the measure: the clock restarts at every completion, so a
replica holding ten requests is given one service time per request, not ten.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from typing import Callable


class Watchdog:
    def __init__(self, floor_s: float, factor: float, window: int = 32, clock: Callable[[], float] = time.monotonic):
        self.floor_s, self.factor = floor_s, factor
        self.clock = clock
        self.busy_since: dict[Hashable, float] = {}
        """Replica → when it last made progress (or received work while idle)."""
        self.service_s: deque[float] = deque(maxlen=window)

    def deadline_s(self) -> float:
        """Seconds a busy replica may go without finishing a request."""
        measured = self.factor * max(self.service_s) if self.service_s else 0.0
        return max(self.floor_s, measured)

    def busy(self, replica: Hashable) -> None:
        """`replica` received work; the clock starts if it had none."""
        self.busy_since.setdefault(replica, self.clock())

    def progressed(self, replica: Hashable, still_busy: bool) -> None:
        """`replica` finished a request: measure its service time; restart its clock if work is left."""
        now = self.clock()
        since = self.busy_since.pop(replica, None)
        if since is not None:
            self.service_s.append(now - since)
        if still_busy:
            self.busy_since[replica] = now

    def forget(self, replica: Hashable) -> None:
        """`replica` is out of service: stop watching it."""
        self.busy_since.pop(replica, None)

    def overdue(self) -> list[tuple[Hashable, float]]:
        """(replica, seconds silent) of every busy replica past the deadline."""
        now, limit = self.clock(), self.deadline_s()
        return [(r, now - since) for r, since in self.busy_since.items() if now - since > limit]
