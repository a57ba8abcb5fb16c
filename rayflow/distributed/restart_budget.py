"""A restart budget per time window: at most `max_restarts` restarts within any `window_s` seconds.

A week-long run loses a replica now and then for reasons that pass (a preempted node, a driver
hiccup); counting restarts over the whole run would end it on the fourth such loss. Counting them
per window still stops a replica that dies again and again, which is what the budget is for.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable


class RestartBudget:
    def __init__(self, max_restarts: int, window_s: float, clock: Callable[[], float] = time.monotonic):
        """`window_s` = 0: the budget is for the whole run."""
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.clock = clock
        self.times: deque[float] = deque()
        """When each restart still inside the window happened (clock seconds)."""

    def take(self) -> bool:
        """Count a restart now if the window has room for one; False when the budget is used up."""
        now = self.clock()
        while self.window_s and self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            return False
        self.times.append(now)
        return True
