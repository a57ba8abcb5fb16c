"""Rewards on Ray: RewardWorker actors (their own resources) and the driver-side RewardPool.

A reward call that raises is logged with its traceback and retried (reward.max_retries times);
then the run stops with a clear message. Rewards are never silently zero. A call whose trajectories are gone
from the object store (the rollout node that held them was lost: ObjectLostError and its kinds) is not a
failure of the reward: it spends no retry, and its request is handed back to the caller (`take_lost`) to be
sampled again. A worker whose process
dies, or that finishes nothing within the watchdog's deadline (a stopped process neither answers nor
dies), is reported, killed and replaced in its own bundle (reward.max_restarts per
reward.restart_window_s), and its calls are issued again: a lost worker spends no retry of the
reward. Once a worker's restarts are used up it is left out of the rotation. A worker whose rewards cannot be built
(its constructor raised) stops the run at once with that error: a replacement would fail alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
import torch

from rayflow.config import RewardConfig, RewardFnConfig
from rayflow.distributed.placement import PlacedGroup, Reservation
from rayflow.distributed.placement import reserve as reserve_placement
from rayflow.distributed.watchdog import Watchdog
from rayflow.rewards.weighted import WeightedReward, reward_inputs
from rayflow.distributed.restart_budget import RestartBudget
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


@dataclass(eq=False)
class _Call:
    payload: list[Trajectory] | ray.ObjectRef
    """What is scored (sent again on a retry): trajectories, or a rollout request's result by reference."""
    request: RolloutRequest | None
    """The request whose result `payload` refers to (None for trajectories)."""
    attempt: int = 0
    """Failures of the reward on this call so far (a lost worker does not count)."""
    worker: int = -1
    """Index of the worker the call was last sent to."""
    restarts: int = 0
    """That worker's restart count when it was sent: a call of a worker replaced since is only re-issued."""
    ref: ray.ObjectRef | None = None

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


POLL_S = 1.0
"""How often a blocking `score` looks at the watchdog while it waits."""


class RewardPool:
    """reward.num_workers RewardWorkers in one placement group; calls go round robin."""

    def __init__(self, cfg: RewardConfig, name: str = "rayflow-rewards", reservation: Reservation | None = None):
        """`reservation`: the workers' placement asked for already (`RewardPool.reserve`)."""
        self.cfg = cfg
        self.placed: PlacedGroup = (reservation or self.reserve(cfg, name)).wait()
        self.workers = [self._start(i) for i in range(cfg.num_workers)]
        self.restarts = [0] * cfg.num_workers
        """Replacements started per worker."""
        self.budgets = [RestartBudget(cfg.max_restarts, cfg.restart_window_s) for _ in self.workers]
        self.starting = {i: w.__ray_ready__.remote() for i, w in enumerate(self.workers)}
        """Workers still starting (index → their readiness): the watchdog's clock starts once they are up, so
        loading a reward model does not count as a stall."""
        self.watchdog = Watchdog(cfg.stall_timeout_s, cfg.stall_factor)
        self._turn = 0  # round robin position
        self.dead: set[int] = set()
        """Workers lost for good (restarts used up)."""
        self.calls: list[_Call] = []
        self._held: list[Trajectory | TrajectoryRef] = []
        """Results that finished while `score` waited for its own; the next `collect` returns them."""
        self._lost: list[RolloutRequest] = []
        """Requests whose trajectories were gone when their call fetched them; the next `take_lost` returns them."""

    @staticmethod
    def reserve(cfg: RewardConfig, name: str = "rayflow-rewards") -> Reservation:
        """The workers' placement, asked for without waiting."""
        return reserve_placement(cfg.num_workers, cfg.cpus_per_worker, cfg.gpus_per_worker, cfg.resources, name=name)

    def _start(self, index: int) -> ray.actor.ActorHandle:
        cfg = self.cfg
        # No restarts by Ray: the pool replaces a lost worker itself, so restarts count per window and a
        # stalled worker is handled like a dead one.
        threads = max(1, int(cfg.cpus_per_worker))  # the torch threads of CPU-bound rewards (CLIP on CPU): the CPUs reserved
        return self.placed.spawn(index, RewardWorker, cfg.functions, cfg.batch_size, cfg.max_outage_s, threads,
                                 max_restarts=0)

    def _send(self, call: _Call, avoid: int | None = None) -> _Call:
        """Send `call` to the next live worker in round robin, other than `avoid` (the worker it failed or
        was lost on) if another one is alive."""
        live = [w for w in range(len(self.workers)) if w not in self.dead]
        if not live:
            raise RewardError(f"all {len(self.workers)} reward workers are lost (reward.max_restarts="
                              f"{self.cfg.max_restarts} per reward.restart_window_s={self.cfg.restart_window_s}); "
                              f"stopping the run")
        choices = [w for w in live if w != avoid] or live
        call.worker = choices[self._turn % len(choices)]
        self._turn += 1
        call.restarts = self.restarts[call.worker]
        call.ref = self.workers[call.worker].score.remote(call.payload)
        if call.worker not in self.starting:
            self.watchdog.busy(call.worker)
        return call

    def _queue(self, trajectories: list[Trajectory]) -> None:
        for i in range(0, len(trajectories), self.cfg.batch_size):
            self.calls.append(self._send(_Call(trajectories[i : i + self.cfg.batch_size], None)))

    def submit(self, trajectories: list[Trajectory]) -> None:
        """Queue trajectories held by the caller, in calls of reward.batch_size; collect fills in their rewards."""
        self._queue(trajectories)

    def submit_rollout(self, ref: ray.ObjectRef, request: RolloutRequest) -> None:
        """Queue the trajectories a rollout request returned, by reference; collect returns TrajectoryRefs."""
        self.calls.append(self._send(_Call(ref, request)))

    @property
    def pending(self) -> int:
        return len(self.calls) + len(self._held)

    @property
    def refs(self) -> list[ray.ObjectRef]:
        """The calls in flight, for a caller waiting on several kinds of work at once."""
        return [c.ref for c in self.calls]

    def collect(self, timeout_s: float | None = 0.0) -> list[Trajectory | TrajectoryRef]:
        """Scored trajectories of the calls that finished, waiting up to timeout_s for at least one
        (None: until one is done). A failed call is logged and retried on another worker; a lost or
        stalled worker is replaced and its calls issued again."""
        scored = self._held + self._finish(timeout_s)
        self._held = []
        return scored

    def take_lost(self) -> list[RolloutRequest]:
        """The rollout requests whose trajectories were lost before they were scored (the object store of the node
        that sampled them went with that node), since the last call: the caller samples them again. No retry of the
        reward is spent on them: the reward did not fail, and scoring the same reference again would fail alike."""
        lost, self._lost = self._lost, []
        return lost

    def score(self, trajectories: list[Trajectory]) -> None:
        """Score trajectories held by the caller now (blocking, with the same retries and deadlines), e.g. an
        evaluation between training steps; other calls that finish meanwhile wait for the next `collect`."""
        mine = {id(t) for t in trajectories}
        self._queue(trajectories)
        while any(t.reward is None for t in trajectories):
            self._held += [t for t in self._finish(POLL_S) if id(t) not in mine]

    def drain(self) -> None:
        """Wait for every call in flight (a worker serves in order: later calls must not queue behind them) and drop
        the results: the trajectories belong to training steps that are being rewound. A call that fails, or whose
        worker is lost (replaced as usual), is dropped too, not retried or re-issued: its result would be thrown away,
        and a reward failing on it stopped the run over a batch that is never trained."""
        while self.calls:
            self._finish(POLL_S, dropping=True)
        self._held, self._lost = [], []

    def _finish(self, timeout_s: float | None, dropping: bool = False) -> list[Trajectory | TrajectoryRef]:
        """Scored trajectories of the calls that finished; the others stay in `calls` (retried, re-issued; `dropping`:
        a failed or lost call leaves `calls` instead, as `drain` wants)."""
        done: list[ray.ObjectRef] = []
        if self.calls:
            refs = self.refs
            done, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
            if done:  # every call that has finished by now, not only the first one
                done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done_set = set(done)
        scored, progressed = [], set()
        for call in [c for c in self.calls if c.ref in done_set]:
            try:
                scored += call.finish(ray.get(call.ref))
            except ray.exceptions.RayActorError as e:  # the worker died, or was killed as stalled
                if getattr(e, "_actor_init_failed", False):  # its rewards could not be built: every restart would fail alike
                    raise RewardError(f"reward worker {self.placed.describe(call.worker)} could not build the run's "
                                      f"rewards; stopping the run. {e.error_msg}") from None
                self._worker_lost(call, e, resend=not dropping)
            except Exception as e:  # the reward raised inside the worker (RayTaskError)
                # The worker answered: its watchdog clock must not run on while it holds no call (it was then killed
                # as stalled while idle, spending a restart, once no call reached it for the deadline).
                progressed.add(call.worker)
                if dropping:
                    self.calls.remove(call)
                    log.warning("reward call on %s failed while its results were being dropped (worker %d); dropped, "
                                "not retried:\n%s", call.describe(), call.worker, e)
                elif call.request is not None and isinstance(e, ray.exceptions.ObjectLostError):
                    # The argument could not be fetched (a RayTaskError whose cause is the loss is an instance of it):
                    # the trajectories went with their rollout node. Retrying the reward would fail alike, and stop
                    # the run blaming the reward; the request is sampled again instead.
                    self.calls.remove(call)
                    self._lost.append(call.request)
                    log.warning("the trajectories of rollout request %s were lost before they were scored (worker %d "
                                "could not fetch them: %s); handing the request back to be sampled again",
                                call.request.request_id, call.worker, type(e).__name__)
                else:
                    self._retry(call, e)
            else:
                self.calls.remove(call)
                progressed.add(call.worker)
        for worker in progressed:
            self.watchdog.progressed(worker, still_busy=any(c.worker == worker for c in self.calls))
        self._watch_started()
        self._replace_stalled()
        return scored

    def _retry(self, call: _Call, error: Exception) -> None:
        if call.attempt >= self.cfg.max_retries:
            raise RewardError(
                f"reward failed {call.attempt + 1} times on {call.describe()}; stopping the run. Last error:\n{error}"
            ) from None
        where = "on another worker" if len(self.workers) - len(self.dead) > 1 else "on the same worker"
        log.warning("reward call on %s failed (attempt %d of %d, worker %d); retrying %s:\n%s",
                    call.describe(), call.attempt + 1, self.cfg.max_retries + 1, call.worker, where, error)
        call.attempt += 1
        self._send(call, avoid=call.worker)

    def _worker_lost(self, call: _Call, error: Exception, resend: bool = True) -> None:
        """The worker of `call` is gone: replace it (at the first of its calls to tell), then issue the call
        again (`resend`; else drop it). The reward did not fail, so no retry is spent."""
        worker = call.worker
        if call.restarts == self.restarts[worker] and worker not in self.dead:
            self._replace(worker, f"reward worker {self.placed.describe(worker)} died while scoring "
                                  f"{call.describe()}: {str(error).strip().splitlines()[0]}")
        if resend:
            self._send(call, avoid=worker)
        else:
            self.calls.remove(call)

    def _replace_stalled(self) -> None:
        """A worker past the watchdog's deadline is reported (node, what it was scoring) and replaced like a
        dead one: killing it fails its calls, which `_worker_lost` then issues again."""
        for worker, silent_s in self.watchdog.overdue():
            scoring = "; ".join(c.describe() for c in self.calls if c.worker == worker)
            self._replace(worker, (
                f"reward worker {self.placed.describe(worker)} stalled: finished nothing for "
                f"{silent_s:.0f}s (deadline {self.watchdog.deadline_s():.0f}s, reward.stall_timeout_s="
                f"{self.cfg.stall_timeout_s}) while scoring {scoring}; re-issuing its calls"
            ))

    def _replace(self, worker: int, why: str) -> None:
        """Kill `worker` and start its replacement in the same bundle, while its restart budget lasts."""
        ray.kill(self.workers[worker], no_restart=True)
        self.watchdog.forget(worker)
        self.starting.pop(worker, None)
        if not self.budgets[worker].take():
            self.dead.add(worker)
            log.error("%s; its restarts are used up (reward.max_restarts=%d per reward.restart_window_s=%s): "
                      "going on without it", why, self.cfg.max_restarts, self.cfg.restart_window_s)
            return
        self.restarts[worker] += 1
        self.workers[worker] = self._start(worker)
        self.starting[worker] = self.workers[worker].__ray_ready__.remote()
        log.error("%s; replacing it (restart %d)", why, self.restarts[worker])

    def _watch_started(self) -> None:
        """Start the watchdog's clock of each worker that finished starting and has calls."""
        for worker, ready in list(self.starting.items()):
            if ray.wait([ready], timeout=0)[0]:
                del self.starting[worker]
                if any(c.worker == worker for c in self.calls):
                    self.watchdog.busy(worker)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.placed.remove()
