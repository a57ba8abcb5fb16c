"""Rewards on Ray: RewardWorker actors (their own resources) and the driver-side RewardPool.

A reward call that raises is logged with its traceback and retried (reward.max_retries times);
then the run stops with a clear message. Rewards are never silently zero. A worker whose process
dies is restarted by Ray (reward.max_restarts times, in its own bundle), the calls it had are run
again there, and it stays in the rotation; once its restarts are used up it is left out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
import torch

from rayflow.config import RewardConfig, RewardFnConfig
from rayflow.distributed.placement import PlacedGroup, make_bundles, place
from rayflow.rewards.weighted import WeightedReward, reward_inputs
from rayflow.types import RolloutRequest, Trajectory, TrajectoryRef

log = logging.getLogger("rayflow.rewards")


class RewardError(RuntimeError):
    """A reward function kept failing after its retries."""


@ray.remote
class RewardWorker:
    """Holds the run's reward functions (which may load models) and scores batches of images."""

    def __init__(self, functions: list[RewardFnConfig], batch_size: int, max_outage_s: float = 0.0, threads: int = 1):
        torch.set_num_threads(threads)
        self.reward = WeightedReward(functions, max_outage_s)
        self.batch_size = batch_size

    def score(self, trajectories: list[Trajectory]) -> list[tuple[float, dict[str, float], list[int]]]:
        """(reward, components, per-step versions) of each trajectory, in calls of at most batch_size images.

        Called with the ObjectRef a rollout request returned, Ray hands this worker the trajectories
        straight from the object store: they never pass through the driver."""
        out = []
        for i in range(0, len(trajectories), self.batch_size):
            chunk = trajectories[i : i + self.batch_size]
            total, parts = self.reward(*reward_inputs(chunk))
            out += [
                (float(total[k]), {name: float(v[k]) for name, v in parts.items()}, t.versions.tolist())
                for k, t in enumerate(chunk)
            ]
        return out


@dataclass
class _Call:
    payload: list[Trajectory] | ray.ObjectRef
    """What is scored (sent again on a retry): trajectories, or a rollout request's result by reference."""
    request: RolloutRequest | None
    """The request whose result `payload` refers to (None for trajectories)."""
    ref: ray.ObjectRef
    attempt: int
    worker: int
    """Index of the worker the call went to (a retry goes to another one)."""

    def describe(self) -> str:
        prompts = self.request.prompts if self.request is not None else [t.prompt for t in self.payload]
        return f"a batch of {len(prompts)} images (prompts {sorted(set(prompts))[:3]})"

    def finish(self, scores: list[tuple[float, dict[str, float], list[int]]]) -> list[Trajectory | TrajectoryRef]:
        if self.request is None:
            for t, (reward, rewards, _) in zip(self.payload, scores):
                t.reward, t.rewards = reward, rewards
            return self.payload
        r = self.request
        return [
            TrajectoryRef(self.payload, i, r.prompts[i], r.prompt_ids[i], r.group_ids[i], r.seeds[i], versions,
                          reward=reward, rewards=rewards)
            for i, (reward, rewards, versions) in enumerate(scores)
        ]


class RewardPool:
    """reward.num_workers RewardWorkers in one placement group; calls go round robin."""

    def __init__(self, cfg: RewardConfig, name: str = "rayflow-rewards"):
        self.cfg = cfg
        self.placed: PlacedGroup = place(
            make_bundles(cfg.num_workers, cfg.cpus_per_worker, cfg.gpus_per_worker, cfg.resources),
            strategy="PACK", name=name,
        )
        self.workers = [
            RewardWorker.options(
                num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker,
                # Scoring is idempotent: Ray re-runs a call that a restart interrupted, on the restarted worker.
                max_restarts=cfg.max_restarts, max_task_retries=cfg.max_restarts,
                scheduling_strategy=self.placed.strategy_for_rank(i),
            ).remote(cfg.functions, cfg.batch_size, cfg.max_outage_s)
            for i in range(cfg.num_workers)
        ]
        self._turn = 0  # round robin position
        self.dead: set[int] = set()
        """Workers that died for good (ActorDiedError: restarts used up, or killed without restart)."""
        self.calls: list[_Call] = []

    def _send(self, payload, request: RolloutRequest | None, attempt: int, avoid: int | None = None) -> _Call:
        """Send to the next live worker in round robin, other than `avoid` (a retry's failed worker) if
        another one is alive."""
        live = [w for w in range(len(self.workers)) if w not in self.dead]
        if not live:
            raise RewardError(f"all {len(self.workers)} reward workers died; stopping the run")
        choices = [w for w in live if w != avoid] or live
        worker = choices[self._turn % len(choices)]
        self._turn += 1
        return _Call(payload, request, self.workers[worker].score.remote(payload), attempt, worker)

    def submit(self, trajectories: list[Trajectory]) -> None:
        """Queue trajectories held by the caller, in calls of reward.batch_size; collect fills in their rewards."""
        for i in range(0, len(trajectories), self.cfg.batch_size):
            self.calls.append(self._send(trajectories[i : i + self.cfg.batch_size], None, attempt=0))

    def submit_rollout(self, ref: ray.ObjectRef, request: RolloutRequest) -> None:
        """Queue the trajectories a rollout request returned, by reference; collect returns TrajectoryRefs."""
        self.calls.append(self._send(ref, request, attempt=0))

    @property
    def pending(self) -> int:
        return len(self.calls)

    @property
    def refs(self) -> list[ray.ObjectRef]:
        """The calls in flight, for a caller waiting on several kinds of work at once."""
        return [c.ref for c in self.calls]

    def collect(self, timeout_s: float | None = 0.0) -> list[Trajectory | TrajectoryRef]:
        """Scored trajectories of the calls that finished, waiting up to timeout_s for at least one
        (None: until one is done). A failed call is logged and retried on another worker."""
        scored, self.calls = self._finish(self.calls, timeout_s)
        return scored

    def score(self, trajectories: list[Trajectory]) -> None:
        """Score trajectories held by the caller now (blocking, with the same retries), apart from the
        calls in flight: e.g. an evaluation between training steps."""
        calls = [self._send(trajectories[i : i + self.cfg.batch_size], None, attempt=0)
                 for i in range(0, len(trajectories), self.cfg.batch_size)]
        while calls:
            _, calls = self._finish(calls, timeout_s=None)

    def _finish(self, calls: list[_Call], timeout_s: float | None) -> tuple[list, list[_Call]]:
        """(scored trajectories of the finished calls, the calls still in flight or retried)."""
        if not calls:
            return [], []
        refs = [c.ref for c in calls]
        done, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if done:  # every call that has finished by now, not only the first one
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        scored, still = [], []
        for call in calls:
            if call.ref not in done_set:
                still.append(call)
                continue
            try:
                scored += call.finish(ray.get(call.ref))
            except Exception as e:  # the reward raised inside the worker (RayTaskError) or the worker died
                if isinstance(e, ray.exceptions.ActorDiedError):
                    self.dead.add(call.worker)
                if call.attempt >= self.cfg.max_retries:
                    raise RewardError(
                        f"reward failed {call.attempt + 1} times on {call.describe()}; stopping the run. "
                        f"Last error:\n{e}"
                    ) from None
                where = "on another worker" if len(self.workers) - len(self.dead) > 1 else "on the same worker"
                log.warning("reward call on %s failed (attempt %d of %d, worker %d); retrying %s:\n%s",
                            call.describe(), call.attempt + 1, self.cfg.max_retries + 1, call.worker, where, e)
                still.append(self._send(call.payload, call.request, call.attempt + 1, avoid=call.worker))
        return scored, still

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.placed.remove()
