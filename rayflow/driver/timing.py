"""The driver's clocks: start-up phases, and each step's wall time and idle shares (the perf/* scalars)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time


class Phases:
    """`with phases("name"):` adds the block's wall time to durations["name"]."""

    def __init__(self, durations: dict[str, float]):
        self.durations = durations

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations[name] = self.durations.get(name, 0.0) + time.perf_counter() - start


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc; None elsewhere). In an actor's first call: its worker's
    start, imports and constructor, and the wait for that call."""
    try:
        with open("/proc/self/stat") as f:  # field 22, after the parenthesised command name: start time in ticks
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


@dataclasses.dataclass
class StepClock:
    """Wall time per step, and how much of it rollout and learners spent with nothing to do."""

    start: float = dataclasses.field(default_factory=time.perf_counter)
    last: float = dataclasses.field(default_factory=time.perf_counter)
    rollout_idle: float = 0.0
    learner_idle: float = 0.0
    _rollout_busy: bool = False
    _learner_busy: bool = False

    def tick(self, rollout_busy: bool, learner_busy: bool) -> None:
        """Charge the time since the last tick to the state the loop saw then; remember the new state."""
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        self.rollout_idle += dt * (not self._rollout_busy)
        self.learner_idle += dt * (not self._learner_busy)
        self._rollout_busy, self._learner_busy = rollout_busy, learner_busy

    @contextlib.contextmanager
    def excluded(self):
        """The block's wall time counts toward no step (and no idle share): evaluation."""
        start = time.perf_counter()
        try:
            yield
        finally:
            paused = time.perf_counter() - start
            self.start += paused
            self.last += paused

    def elapsed(self) -> float:
        """Seconds of the step in progress so far."""
        return time.perf_counter() - self.start

    def lap(self, images: int) -> dict[str, float]:
        self.tick(self._rollout_busy, self._learner_busy)
        step_s = self.last - self.start
        out = {
            "perf/step_s": step_s,
            "perf/images_per_s": images / step_s,
            "perf/rollout_idle": self.rollout_idle / step_s,
            "perf/learner_idle": self.learner_idle / step_s,
        }
        self.start, self.rollout_idle, self.learner_idle = self.last, 0.0, 0.0
        return out
