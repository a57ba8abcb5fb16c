"""StalenessQueue: admission control and staleness bookkeeping between rollout and training.

Pure bookkeeping (no Ray, no tensors beyond what trajectories carry), driven by the trainer with
the learner's version v = optimizer steps applied:

- Admission: new samples may be submitted only while accepted + running ≤ (max_staleness + v + 1)·B,
  where B is the batch size, `accepted` counts samples that finished and were kept (trained on or
  waiting), and `running` those submitted and not finished. max_staleness = 0 is synchronous:
  one batch in flight, generated entirely under the weights of the current version.
- A trajectory's staleness when the learner takes it is v − the oldest policy version among its
  steps. A group staler than max_staleness is never trained on: it is regenerated (same prompt and
  seeds, resubmitted) or dropped, and counted.
- A group becomes trainable when all of its samples are back and scored; its advantages are
  computed then (or at batch time with a batch-wide std).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflow.data.prompts import PromptGroup
from rayflow.types import Trajectory, TrajectoryRef


@dataclass
class GroupInFlight:
    group: PromptGroup
    trajectories: list[Trajectory | TrajectoryRef] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.trajectories) == len(self.group.seeds) and all(t.reward is not None for t in self.trajectories)

    def staleness(self, version: int) -> int:
        return version - min(t.oldest_version for t in self.trajectories)


@dataclass
class QueueStats:
    """Counters since the start of the run, and figures of the last batch taken."""

    regenerated: int = 0
    dropped: int = 0
    batches: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    partial_ratio: float = 0.0
    """Share of the last batch's trajectories whose steps span more than one policy version."""
    max_partial_span: int = 0
    """Largest (newest − oldest) version within one trajectory of the last batch."""


class StalenessQueue:
    def __init__(self, batch_size: int, group_size: int, max_staleness: int, over_stale: str = "regenerate"):
        """`max_staleness`, `over_stale`: the run's async.* (checked by AsyncConfig.validate)."""
        if batch_size % group_size:
            raise ValueError(f"batch size {batch_size} is not a multiple of the group size {group_size}")
        self.batch_size = batch_size
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.over_stale = over_stale
        self.accepted = 0
        self.running = 0
        self.groups: dict[int, GroupInFlight] = {}
        self.stats = QueueStats()

    # -- admission -------------------------------------------------------------------------
    def capacity(self, version: int) -> int:
        """Samples that may still be submitted at this learner version."""
        return (self.max_staleness + version + 1) * self.batch_size - self.accepted - self.running

    def can_admit(self, version: int) -> bool:
        return self.capacity(version) >= self.group_size

    def submitted(self, group: PromptGroup) -> None:
        """A new group's samples were submitted for rollout."""
        if group.group_id in self.groups:
            raise ValueError(f"group {group.group_id} is already in flight")
        self.groups[group.group_id] = GroupInFlight(group)
        self.running += len(group.seeds)

    def finished(self, trajectory: Trajectory | TrajectoryRef) -> None:
        """A trajectory came back from rollout with its reward."""
        entry = self.groups[trajectory.group_id]
        entry.trajectories.append(trajectory)
        self.running -= 1
        self.accepted += 1

    @property
    def depth(self) -> int:
        """Samples finished and in the queue, not yet taken into a batch (asynchronously, a batch handed to the learners
        behind the step training has left it)."""
        return sum(len(e.trajectories) for e in self.groups.values())

    # -- batches ---------------------------------------------------------------------------
    def take_batch(self, version: int) -> tuple[list[Trajectory | TrajectoryRef] | None, list[PromptGroup]]:
        """The next training batch, if enough fresh complete groups are waiting.

        Returns (batch or None, groups to resubmit). Complete groups staler than the bound are
        taken out first: regenerated (returned for resubmission, already counted as running) or
        dropped. The batch holds the complete groups with the smallest ids (the order in which
        they were drawn), each group's trajectories ordered by seed, so a synchronous run forms
        exactly the reference trainer's batches.
        """
        resubmit = []
        for gid in sorted(self.groups):
            entry = self.groups[gid]
            if entry.complete and entry.staleness(version) > self.max_staleness:
                n = len(entry.trajectories)
                self.accepted -= n
                if self.over_stale == "regenerate":
                    entry.trajectories = []
                    self.running += n
                    self.stats.regenerated += 1
                    resubmit.append(entry.group)
                else:
                    del self.groups[gid]
                    self.stats.dropped += 1
        ready = [gid for gid in sorted(self.groups) if self.groups[gid].complete]
        needed = self.batch_size // self.group_size
        if len(ready) < needed:
            return None, resubmit
        batch = []
        for gid in ready[:needed]:
            batch += sorted(self.groups.pop(gid).trajectories, key=lambda t: t.seed)
        self._record(batch, version)
        return batch, resubmit

    def _record(self, batch: list[Trajectory | TrajectoryRef], version: int) -> None:
        stale = [version - t.oldest_version for t in batch]
        spans = [t.newest_version - t.oldest_version for t in batch]
        s = self.stats
        s.batches += 1
        s.staleness_mean = sum(stale) / len(stale)
        s.staleness_max = max(stale)
        s.partial_ratio = sum(span > 0 for span in spans) / len(spans)
        s.max_partial_span = max(spans)
