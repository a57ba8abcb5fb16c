"""A discrete-event model of the driver's loop: step time, throughput, idle shares and staleness of a
run shape, from the cost of each piece of work.

The model follows rayflow/driver/trainer.py and rayflow/driver/queue.py:

- admission: a prompt group (group_size samples, split into requests of micro_batch_size) is
  submitted while accepted + running + group_size <= (max_staleness + v + 1)·B, and only once
  version v is on every rollout replica (the real driver submits earlier, each request carrying v as
  its min_version, and the ranks wait for it: the request starts at the same moment);
- each request goes to the replica with the fewest samples in flight (ties: lowest index) and is
  served first come first served; it samples under the version its replica holds when it starts;
- a finished request is scored by the next reward worker in round robin;
- when the learner is free and B/group_size complete groups no staler than max_staleness wait, the
  oldest form a batch (staler complete groups are regenerated first); training takes
  train_batch_s, then the learner is blocked push_s while it hands the weights over, then v + 1;
- the new version reaches the replicas broadcast_s after the push (a replica adopts it between
  requests; in the real run it is adopted between denoising steps, a finer grain the model ignores).

Contention: with `cores` set (CPU runs, one thread per actor) every busy actor runs at
min(1, cores / busy actors) of its speed (processor sharing); with `cores` None each actor has its
own device (GPUs). The orchestration's own costs are `overhead_request_s` per request (Ray calls,
serialisation, polling; charged to the request's replica) and `overhead_batch_s` per batch (forming it,
the learners fetching its trajectories; charged to the learner).

Costs are seconds of one actor alone on its device. What the model leaves out: the rollout's
partial-version steps, stragglers within a replica, evaluation and checkpoints, restarts.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from dataclasses import MISSING, dataclass, field, fields
from typing import Callable


class SimulationInputError(ValueError):
    """A cost or shape the simulator cannot run, naming the field, the value and what is allowed."""


@dataclass(frozen=True)
class Costs:
    """Seconds of work, each measured (or assumed) for one actor alone on its device."""

    rollout_request_s: float
    """One rollout request (micro_batch_size samples, every denoising step, decode) on one replica."""
    reward_request_s: float
    """Scoring one request's samples on one reward worker."""
    train_batch_s: float
    """All optimizer steps of one batch on the learner group (rank 0's time)."""
    push_s: float = 0.0
    """The learner blocked after a batch: gathering and handing the rollout weights to the sync actor."""
    broadcast_s: float = 0.0
    """From the push until the new version is on every rollout replica."""
    overhead_request_s: float = 0.0
    """The driver's per-request cost (Ray calls, fetching results), on the request's replica."""
    overhead_batch_s: float = 0.0
    """The per-batch cost on the learner's path (forming the batch, the learners fetching its trajectories)."""

    @classmethod
    def from_dict(cls, data: dict, source: str = "costs") -> "Costs":
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING]
        unknown = sorted(set(data) - set(names) - {"note", "measured", "setup"})
        if unknown:
            raise SimulationInputError(f"{source}: unknown cost {unknown[0]!r}; allowed: {', '.join(names)}")
        missing = [n for n in required if n not in data]
        if missing:
            raise SimulationInputError(f"{source}: missing cost {missing[0]!r} (seconds); the costs are: {', '.join(names)}")
        values = {n: data[n] for n in names if n in data}
        for name, value in values.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise SimulationInputError(f"{source}: {name}: got {value!r}; allowed: a finite number of seconds >= 0")
        for name in ("rollout_request_s", "train_batch_s"):
            if values[name] <= 0:
                raise SimulationInputError(f"{source}: {name}: got {values[name]!r}; allowed: seconds > 0")
        return cls(**{n: float(v) for n, v in values.items()})


@dataclass(frozen=True)
class Shape:
    """What a run is made of (the config keys in brackets)."""

    batch_size: int
    """Samples per trained batch (algorithm.group_size x prompts_per_step)."""
    group_size: int
    micro_batch_size: int
    """Samples per rollout request (rollout.micro_batch_size)."""
    replicas: int = 1
    reward_workers: int = 1
    max_staleness: int = 0
    cores: float | None = None
    """CPU cores the actors share (one thread each), or None for a device per actor."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "group_size", "micro_batch_size", "replicas", "reward_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SimulationInputError(f"{name}: got {value!r}; allowed: an integer >= 1")
        if self.batch_size % self.group_size:
            raise SimulationInputError(
                f"batch_size: got {self.batch_size}; allowed: a multiple of group_size ({self.group_size})")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise SimulationInputError(f"max_staleness: got {self.max_staleness!r}; allowed: an integer >= 0")
        if self.cores is not None and not self.cores > 0:
            raise SimulationInputError(f"cores: got {self.cores!r}; allowed: a number > 0, or None for a device per actor")


@dataclass
class Prediction:
    step_s: float
    """Mean time between consecutive versions, after the warm-up steps."""
    images_per_s: float
    rollout_idle: float
    """Share of the time with no request in flight (the trainer's perf/rollout_idle)."""
    learner_idle: float
    """Share of the time the learner group is neither training nor pushing."""
    staleness_mean: float
    regenerated: int


@dataclass
class _Job:
    work_s: float
    done: Callable[[], None]
    samples: int = 0
    """Samples of a rollout request (the pool balances replicas by samples in flight)."""
    on_start: Callable[[], None] | None = None
    """Called when the job reaches the head of its actor's queue (a request reads its replica's version)."""


@dataclass
class _Group:
    samples: int
    versions: list[int] = field(default_factory=list)
    """The policy version of each scored sample."""

    @property
    def complete(self) -> bool:
        return len(self.versions) == self.samples


class _Simulation:
    def __init__(self, costs: Costs, shape: Shape):
        self.c, self.s = costs, shape
        self.now = 0.0
        self.version = 0
        self.synced_version = 0
        """The newest version on every replica."""
        self.accepted = self.running = 0
        self.groups: dict[int, _Group] = {}
        self.group_ids = itertools.count()
        self.queues: dict[str, deque[_Job]] = {}
        self.remaining: dict[str, float] = {}
        """Work left of the job at the head of each busy actor's queue."""
        self.reward_turn = 0
        self.training = False
        self.version_times: list[float] = []
        self.busy_at_versions: list[tuple[float, float, int]] = []
        """At each version's time: (rollout busy s, learner busy s, staleness entries) so far."""
        self.staleness: list[int] = []
        self.regenerated = 0
        self.broadcasts: list[tuple[float, int]] = []
        """(arrival time, version): broadcasts under way (they occupy no actor of the model)."""
        self.rollout_busy_s = self.learner_busy_s = 0.0

    # -- actors ------------------------------------------------------------------------------------
    def _run(self, actor: str, job: _Job) -> None:
        queue = self.queues.setdefault(actor, deque())
        queue.append(job)
        if len(queue) == 1:
            self._start(actor)

    def _start(self, actor: str) -> None:
        job = self.queues[actor][0]
        self.remaining[actor] = job.work_s
        if job.on_start:
            job.on_start()

    def _rate(self) -> float:
        busy = len(self.remaining)
        return 1.0 if self.s.cores is None or busy <= self.s.cores else self.s.cores / busy

    def _advance(self) -> bool:
        """Move to the next event; False when nothing is left to happen."""
        rate = self._rate()
        finishing = min(((w / rate, a) for a, w in self.remaining.items()), default=None)
        arrival = self.broadcasts[0][0] - self.now if self.broadcasts else None
        if finishing is None and arrival is None:
            return False
        if finishing is None or (arrival is not None and arrival <= finishing[0]):
            self._elapse(arrival, rate)
            _, version = heapq.heappop(self.broadcasts)
            self._broadcast_arrived(version)
            return True
        self._elapse(finishing[0], rate)
        actor = finishing[1]
        job = self.queues[actor].popleft()
        del self.remaining[actor]
        if self.queues[actor]:
            self._start(actor)
        job.done()
        return True

    def _elapse(self, dt: float, rate: float) -> None:
        self.rollout_busy_s += dt * any(a.startswith("replica") for a in self.remaining)
        self.learner_busy_s += dt * ("learner" in self.remaining)
        self.now += dt
        for actor in self.remaining:
            self.remaining[actor] -= dt * rate

    # -- the driver's loop -------------------------------------------------------------------------
    def _admit(self) -> None:
        s = self.s
        if self.synced_version < self.version:
            return  # requests start only under the newest weights (RolloutRequest.min_version)
        while (s.max_staleness + self.version + 1) * s.batch_size - self.accepted - self.running >= s.group_size:
            group = _Group(s.group_size)
            self.groups[next(self.group_ids)] = group
            self.running += s.group_size
            self._submit(group)

    def _submit(self, group: _Group) -> None:
        for first in range(0, group.samples, self.s.micro_batch_size):
            n = min(self.s.micro_batch_size, group.samples - first)
            replica = min(range(self.s.replicas), key=lambda i: sum(j.samples for j in self.queues.get(f"replica{i}", ())))
            self._request(group, replica, n)

    def _request(self, group: _Group, replica: int, n: int) -> None:
        share = n / self.s.micro_batch_size
        version = [0]

        def start() -> None:
            version[0] = self.synced_version  # a replica adopts a new version between requests

        def sampled() -> None:
            worker = self.reward_turn % self.s.reward_workers
            self.reward_turn += 1
            self._run(f"reward{worker}", _Job(self.c.reward_request_s * share, lambda: self._scored(group, version[0], n)))

        work = self.c.rollout_request_s * share + self.c.overhead_request_s
        self._run(f"replica{replica}", _Job(work, sampled, samples=n, on_start=start))

    def _scored(self, group: _Group, version: int, n: int) -> None:
        group.versions += [version] * n
        self.running -= n
        self.accepted += n
        self._try_train()
        self._admit()

    def _try_train(self) -> None:
        if self.training:
            return
        s = self.s
        for group in self.groups.values():
            if group.complete and self.version - min(group.versions) > s.max_staleness:
                self.accepted -= group.samples
                self.running += group.samples
                group.versions = []
                self.regenerated += 1
                self._submit(group)
        ready = [gid for gid in sorted(self.groups) if self.groups[gid].complete]
        needed = s.batch_size // s.group_size
        if len(ready) < needed:
            return
        batch = [self.groups.pop(gid) for gid in ready[:needed]]
        self.staleness += [self.version - v for g in batch for v in g.versions]
        self.training = True
        train = self.c.train_batch_s + self.c.overhead_batch_s
        self._run("learner", _Job(train, lambda: self._run("learner", _Job(self.c.push_s, self._pushed))))

    def _pushed(self) -> None:
        self.version += 1
        self.version_times.append(self.now)
        self.busy_at_versions.append((self.rollout_busy_s, self.learner_busy_s, len(self.staleness)))
        self.training = False
        heapq.heappush(self.broadcasts, (self.now + self.c.broadcast_s, self.version))
        self._try_train()

    def _broadcast_arrived(self, version: int) -> None:
        self.synced_version = max(self.synced_version, version)
        self._admit()

    def run(self, versions: int) -> None:
        self._admit()
        while self.version < versions and self._advance():
            pass


def simulate(costs: Costs, shape: Shape, steps: int = 40, warmup: int = 5) -> Prediction:
    """Run the model for `steps` versions; figures after the first `warmup` (the pipeline filling)."""
    if steps <= warmup:
        raise SimulationInputError(f"steps: got {steps}; allowed: more than warmup ({warmup})")
    sim = _Simulation(costs, shape)
    sim.run(steps)
    times = sim.version_times
    if len(times) < steps:
        raise SimulationInputError(f"the model stopped after {len(times)} of {steps} versions: the shape cannot form a batch")
    deltas = [b - a for a, b in zip(times[warmup - 1 : -1], times[warmup:])]
    step_s = sum(deltas) / len(deltas)
    # Every figure over the same window: from version `warmup` to the last.
    rollout_0, learner_0, batches_0 = sim.busy_at_versions[warmup - 1]
    rollout_1, learner_1, _ = sim.busy_at_versions[-1]
    window = times[-1] - times[warmup - 1]
    staleness = sim.staleness[batches_0:]
    return Prediction(
        step_s=step_s,
        images_per_s=shape.batch_size / step_s,
        rollout_idle=max(0.0, 1 - (rollout_1 - rollout_0) / window),  # busy work can straddle the window's start
        learner_idle=max(0.0, 1 - (learner_1 - learner_0) / window),
        staleness_mean=sum(staleness) / len(staleness),
        regenerated=sim.regenerated,
    )


@dataclass(frozen=True)
class CostBasis:
    """What a cost file's figures were measured (or estimated) for; sizing scales them from here."""

    batch_size: int
    micro_batch_size: int
    learner_ranks: int
    gpus_per_replica: int
    """GPUs of one rollout replica (its CFG-parallel ranks, rollout.cfg_parallel_size)."""


def scaled_costs(costs: Costs, basis: CostBasis, batch_size: int, micro_batch_size: int, learner_ranks: int) -> Costs:
    """Costs at another batch, request size and learner group size: rollout and reward linear in the samples
    of a request; training linear in the batch and, data-parallel, inversely in the ranks (perfect scaling:
    an assumption the README names)."""
    per_request = micro_batch_size / basis.micro_batch_size
    return dataclasses.replace(
        costs,
        rollout_request_s=costs.rollout_request_s * per_request,
        reward_request_s=costs.reward_request_s * per_request,
        train_batch_s=costs.train_batch_s * batch_size / basis.batch_size * basis.learner_ranks / learner_ranks,
    )


@dataclass
class Split:
    replicas: int
    learner_ranks: int
    prediction: Prediction


def size_cluster(costs: Costs, basis: CostBasis, shape: Shape, gpus: int, learner_micro_batch: int = 1,
                 steps: int = 40, num_minibatches: int = 1) -> list[Split]:
    """Every disaggregated split of `gpus` into rollout replicas (basis.gpus_per_replica each) and learner
    ranks, fastest first: the ranks a config takes (RayflowConfig.validate), each of the batch's `num_minibatches`
    mini-batches (algorithm.num_minibatches) split evenly over them in whole micro-batches."""
    if gpus < basis.gpus_per_replica + 1:
        raise SimulationInputError(
            f"gpus: got {gpus}; allowed: at least {basis.gpus_per_replica + 1} (one rollout replica of "
            f"{basis.gpus_per_replica} and one learner rank)")
    splits = []
    for replicas in range(1, (gpus - 1) // basis.gpus_per_replica + 1):
        ranks = gpus - replicas * basis.gpus_per_replica
        minibatch = shape.batch_size // num_minibatches
        if shape.batch_size % num_minibatches or minibatch % (ranks * learner_micro_batch):
            continue
        scaled = scaled_costs(costs, basis, shape.batch_size, shape.micro_batch_size, ranks)
        prediction = simulate(scaled, dataclasses.replace(shape, replicas=replicas, cores=None), steps=steps)
        splits.append(Split(replicas, ranks, prediction))
    return sorted(splits, key=lambda s: s.prediction.step_s)
