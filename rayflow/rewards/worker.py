"""Rewards on Ray: RewardWorker actors (their own resources) and the driver-side RewardPool.

A reward call that raises is logged with its traceback and retried (reward.max_retries times);
then the run stops with a clear message. Rewards are never silently zero.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import ray
import torch

from rayflow.config import RewardConfig, RewardFnConfig
from rayflow.distributed.placement import PlacedGroup, make_bundles, place
from rayflow.rewards.weighted import WeightedReward, assign_rewards, reward_inputs
from rayflow.types import Trajectory

log = logging.getLogger("rayflow.rewards")


class RewardError(RuntimeError):
    """A reward function kept failing after its retries."""


@ray.remote
class RewardWorker:
    """Holds the run's reward functions (which may load models) and scores batches of images."""

    def __init__(self, functions: list[RewardFnConfig], threads: int = 1):
        torch.set_num_threads(threads)
        self.reward = WeightedReward(functions)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.reward(images, prompts, metadata)


@dataclass
class _Call:
    trajectories: list[Trajectory]
    ref: ray.ObjectRef
    worker: int
    attempt: int


class RewardPool:
    """reward.num_workers RewardWorkers in one placement group; batches go round robin."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.placed: PlacedGroup = place(
            make_bundles(cfg.num_workers, cfg.cpus_per_worker, cfg.gpus_per_worker), strategy="PACK", name="rayflow-rewards"
        )
        self.workers = [
            RewardWorker.options(
                num_cpus=cfg.cpus_per_worker, num_gpus=cfg.gpus_per_worker,
                scheduling_strategy=self.placed.strategy_for_rank(i),
            ).remote(cfg.functions)
            for i in range(cfg.num_workers)
        ]
        self._next_worker = itertools.cycle(range(cfg.num_workers))
        self.calls: list[_Call] = []

    def _send(self, trajectories: list[Trajectory], attempt: int) -> _Call:
        worker = next(self._next_worker)
        ref = self.workers[worker].score.remote(*reward_inputs(trajectories))
        return _Call(trajectories, ref, worker, attempt)

    def submit(self, trajectories: list[Trajectory]) -> None:
        """Queue trajectories for scoring, in batches of reward.batch_size."""
        for i in range(0, len(trajectories), self.cfg.batch_size):
            self.calls.append(self._send(trajectories[i : i + self.cfg.batch_size], attempt=0))

    @property
    def pending(self) -> int:
        return len(self.calls)

    def collect(self, timeout_s: float | None = 0.0) -> list[Trajectory]:
        """Trajectories whose rewards arrived (their .reward and .rewards filled in), waiting up to
        timeout_s for at least one batch (None: until one is done)."""
        if not self.calls:
            return []
        done, _ = ray.wait([c.ref for c in self.calls], num_returns=1, timeout=timeout_s)
        done_set = set(done)
        scored, still = [], []
        for call in self.calls:
            if call.ref not in done_set:
                still.append(call)
                continue
            try:
                assign_rewards(call.trajectories, *ray.get(call.ref))
                scored += call.trajectories
            except Exception as e:  # the reward raised inside the worker (RayTaskError) or the worker died
                if call.attempt >= self.cfg.max_retries:
                    raise RewardError(
                        f"reward failed {call.attempt + 1} times on a batch of {len(call.trajectories)} images "
                        f"(prompts {sorted({t.prompt for t in call.trajectories})[:3]}); stopping the run. Last error:\n{e}"
                    ) from None
                log.warning("reward call failed (attempt %d of %d), retrying:\n%s",
                            call.attempt + 1, self.cfg.max_retries + 1, e)
                still.append(self._send(call.trajectories, call.attempt + 1))
        self.calls = still
        return scored

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.placed.remove()
