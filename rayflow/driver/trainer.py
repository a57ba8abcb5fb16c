"""Trainer: the driver's loop over rollout replicas, reward workers, learners and the weight sync.

One pass of the loop (every call returns futures; the loop only waits for "something finished"):

    admit     new prompt groups while the StalenessQueue allows (max_staleness bounds it)
    rollout   finished requests → rewards (by reference: trajectories never pass through the driver)
    reward    scored trajectories → the queue; complete, fresh groups form a batch
    train     batch → advantages → learners (algorithm.num_inner_epochs x num_minibatches optimizer steps, version + 1);
              asynchronous, the next batch is handed over while the step before it trains (Trainer._may_queue_behind)
    sync      learner rank 0 pushes the rollout adapter as its train step ends; the WeightSyncActor broadcasts it
    log       TensorBoard / Ray metrics / progress bar; eval and checkpoint on their schedule

With async.max_staleness = 0 the loop is synchronous: a batch is rolled out entirely under the
current weights, trained on, and the new weights are on every rollout rank before the next batch
starts (its requests are submitted at once and wait on the ranks for them: RolloutRequest.min_version);
the run then equals the single-process reference trainer (rayflow.reference) bit for bit.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

import ray
import torch

from rayflow.algorithms.advantages import assign_advantages
from rayflow.checkpoint import (base_model_record, checkpoint_root, is_save_step, load_checkpoint, remove_leftovers,
                                resolve_resume, save_checkpoint)
from rayflow.config import RayflowConfig, to_dict
from rayflow.data.prompts import GroupSampler, PromptGroup, load_prompts
from rayflow.distributed.colocated import ColocatedDevices
from rayflow.distributed.tensor_pickle import install as install_tensor_pickling
from rayflow.driver.evaluation import Evaluator, evaluation_params
from rayflow.driver.queue import QueueStats, StalenessQueue
from rayflow.driver.timing import Phases, StepClock
from rayflow.distributed.watchdog import Watchdog
from rayflow.models.lora import EVAL_EMA_ADAPTER
from rayflow.learner.minibatches import learner_batch
from rayflow.learner.optim import SkippedSteps, SkipRuns
from rayflow.learner.spec import LearnerSpec
from rayflow.learner.worker import LearnerError, LearnerGroup, LearnerStalled
from rayflow.logging.monitor import Monitor
from rayflow.rewards.normalize import training_rewards
from rayflow.rewards.worker import RewardPool
from rayflow.rollout.pool import PoolFuture, RolloutPool
from rayflow.rollout.spec import RolloutRankSpec
from rayflow.sampling.window import window_params
from rayflow.sync.source import ReceiversLost
from rayflow.sync.weight_sync import WeightSync, WeightSyncStalled
from rayflow.types import RolloutRequest, Trajectory, TrajectoryRef

log = logging.getLogger("rayflow")

POLL_S = 1.0
"""The longest the loop waits for something to finish before it looks at deadlines and replacements again."""

TRAJECTORY_LOSSES_PER_REQUEST = 3
"""How often one rollout request's trajectories may be lost before they are scored (each time with the node that
sampled them, whose object store held them) and the request be sampled again; one loss more stops the run."""


class TrajectoriesLost(RuntimeError):
    """A rollout request's trajectories were lost more than TRAJECTORY_LOSSES_PER_REQUEST times."""


@dataclasses.dataclass
class TrainStep:
    """A train step handed to the learners, with what its log line takes from the moment its batch was formed."""

    refs: list[ray.ObjectRef]
    """Each learner rank's metrics."""
    batch: list[TrajectoryRef]
    pushing_to: ray.actor.ActorHandle
    """The weight-sync actor its version is pushed to when it ends."""
    queue_stats: QueueStats
    """The queue's figures (staleness, regenerated groups) as its batch was taken."""
    normalized_means: dict[str, float]
    """Batch mean of each reward component after its normalisation (logged as reward/<name>/normalized)."""
    zero_signal_groups: int
    filtered_samples: int
    """Zero-advantage samples left out of training (FlowGRPO)."""


class Trainer:
    def __init__(self, cfg: RayflowConfig, prompts: list[str] | None = None):
        """`prompts`: the training prompts if already loaded (else read from data.prompts, before any actor starts)."""
        self.cfg = cfg
        install_tensor_pickling()  # what the driver sends (evaluation weights) as its actors send theirs
        prompts = prompts if prompts is not None else load_prompts(cfg.data.prompts, cfg.data.max_prompt_chars)
        self.sampler = GroupSampler(prompts, cfg.algorithm.group_size, cfg.trainer.seed, cfg.data.shuffle)
        self.queue = self._new_queue(accepted=0)
        self.version = 0
        self.skips = SkippedSteps(cfg.trainer.max_skipped_steps)
        self.history: list[dict[str, float]] = []
        self.train_s = 0.0
        """This start's training time so far: its steps' wall time, evaluations excluded (trainer.time_limit_s); a
        rewind keeps the time of the steps it trains again (time spent, though their first log lines are dropped)."""
        self.next_batch_committed = False
        """Synchronous mode: the next batch went to the rollout in time, before its step's broadcast, and
        trainer.time_limit_s passed during that broadcast. It is trained, as an asynchronous step already handed to the
        learners is, rather than left rolling out for nothing ahead of the final evaluation's requests."""
        self.retrain_until = 0
        """A learner death after trainer.time_limit_s passed rewinds to a checkpoint before the step the run was stopping
        at: the run is not out of time again until it has trained up to that step once more (`lost`, and any step in
        flight it was to finish first: a synchronous batch committed, a step queued), and evaluates and checkpoints
        there (it ended at the rewind point instead: with no checkpoint before it, with nothing at all)."""
        self.evaluating: set[PoolFuture] = set()
        """Requests the driver waits for itself (evaluation) instead of scoring them for training."""
        self.trajectory_losses: collections.Counter[str] = collections.Counter()
        """Per rollout request id: how often its trajectories were lost before they were scored (since the last rewind,
        which draws the same request ids again)."""
        self.learner_watchdog = Watchdog(cfg.learner.stall_timeout_s, cfg.rollout.stall_factor)
        """The deadline of a train step."""
        self.components: list = []  # shut down in reverse order
        self.startup_s: dict[str, float] = {}
        """Seconds of each start-up phase (logged by the launcher; tools/bench.py startup)."""
        phase = Phases(self.startup_s)
        try:
            spec, learner_spec = RolloutRankSpec.from_config(cfg), LearnerSpec.from_config(cfg)
            if cfg.placement.colocated:
                with phase("devices"):  # both placements asked for before either is waited for, as below
                    reward_pg = self._own(RewardPool.reserve(cfg.reward))
                    devices_pg = self._own(ColocatedDevices.reserve(cfg.placement, learner_spec.learner.world_size))
                    self.rewards = self._own(RewardPool(cfg.reward, reservation=reward_pg))  # started, not waited for
                    devices = self._own(ColocatedDevices(learner_spec, spec, cfg.placement, cfg.rollout,
                                                         reservation=devices_pg))
                self.learners, self.rollout, self.sync = devices.learners, devices.rollout, devices.weights
            else:
                # Every role's placement is asked for before any is waited for, so that an autoscaler starts all the
                # nodes the run needs together (a placement never taken is removed at shutdown). Then every role's
                # actors start at once (on a cluster, on their own nodes): the reward workers, rollout ranks and
                # weight-sync actor load while the learners do; the weight-sync group forms once the replicas are up.
                # The learners and rollout ranks, the longest to build, are created first: a raylet starts as many
                # workers at a time as its node has cores, in the order asked (2 here: created last, the learners
                # were forked ~1 s after the weight-sync actor and reward workers, and the start-up waited for them).
                with phase("actors"):
                    reward_pg = self._own(RewardPool.reserve(cfg.reward))
                    rollout_pgs = [self._own(reservation) for reservation in RolloutPool.reserve(cfg.rollout)]
                    sync_pg = self._own(WeightSync.reserve(cfg.sync))
                    learner_pg = self._own(LearnerGroup.reserve(learner_spec))
                    self.learners = self._own(LearnerGroup(learner_spec, reservation=learner_pg, wait=False))
                    self.rollout = self._own(RolloutPool.start(spec, cfg.rollout, reservations=rollout_pgs))
                    self.rewards = self._own(RewardPool(cfg.reward, reservation=reward_pg))
                    self.sync = self._own(WeightSync(cfg.sync, spec, None, cfg.rollout.collective_timeout_s,
                                                     reservation=sync_pg))
                    self.learners.wait_ready()
                with phase("rollout"):
                    self.rollout.wait_ready()
                with phase("weight sync"):
                    self.sync.connect(self.rollout.replicas)
            self.rollout.sync_with(self.sync)
            self.evaluator = Evaluator(cfg.data, evaluation_params(cfg.sampling, cfg.trainer), prompts, self._generate,
                                       self.rewards)
            with phase("resume"):
                self._resume()
            wandb_run = {"name": cfg.trainer.run_name, "dir": cfg.trainer.run_dir, "config": to_dict(cfg)}
            self.monitor = self._own(Monitor(cfg.trainer.logdir, cfg.logging, cfg.trainer.total_steps, self.version,
                                             wandb_run=wandb_run))
        except BaseException:
            self.shutdown()
            raise

    def _own(self, component):
        self.components.append(component)
        return component

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> list[dict[str, float]]:
        """Train until trainer.total_steps batches (policy versions); returns each step's logged scalars."""
        cfg = self.cfg
        training: collections.deque[TrainStep] = collections.deque()  # in the learners' order: at most two
        if cfg.trainer.eval_at_start and self.version == 0:
            self._evaluate_at_start()
        clock = StepClock()
        while (self.version < cfg.trainer.total_steps and self._forms_batches) or training:
            try:
                self._check_sync_failure(training_in_flight=bool(training))
            except LearnerError as e:  # a rank died in the push to a replaced weight-sync actor (none in flight)
                self._restart_learners(e)
                continue
            if self._forms_batches:
                if not self.out_of_time:
                    self._admit()
                if not training or (len(training) == 1 and self._may_queue_behind(self.version + 1)):
                    version = self.version + len(training)  # the version this batch is trained at
                    batch, stale = self.queue.take_batch(version)
                    self._submit(stale)  # regenerated under the current weights
                    if batch is not None:
                        self.next_batch_committed = False
                        training.append(self._train(batch, version))
            clock.tick(rollout_busy=bool(self.rollout.in_flight), learner_busy=bool(training))
            self._serve(training[0].refs if training else None)
            if training and self.learners.settled(training[0].refs):
                step, version = training.popleft(), self.version
                try:
                    self._finish(step, clock, queued=bool(training))
                except LearnerError as e:  # a rank died in the step, or in the save, evaluation or push after it
                    # The steps in flight the run was still to train, out of time or not: this one unless it ended
                    # before the death (in its save, evaluation or push), one queued behind it.
                    unfinished = int(self.version == version) + len(training)
                    training.clear()  # a step queued behind it trains again after the rewind
                    self._restart_learners(e, unfinished)
            elif training and self.learner_watchdog.overdue():
                self._learner_stalled(training[0].refs)
        return self.history

    def _evaluate_at_start(self) -> None:
        """The evaluation before the first step. A learner rank found dead in it (a weight-sync actor lost with it, one
        node, and the push to its replacement failing) restarts the learners as in a step, and the evaluation runs
        again (it stopped the run, restarts left or not)."""
        while True:
            try:
                self.evaluator.run(0, self.monitor)
                return
            except LearnerError as e:
                self._restart_learners(e)

    @property
    def _forms_batches(self) -> bool:
        """Whether the loop admits groups and forms batches: in time, or (without admitting) to train a synchronous
        batch submitted in time (`next_batch_committed`)."""
        return not self.out_of_time or self.next_batch_committed

    def _may_queue_behind(self, version_after: int) -> bool:
        """Whether the next batch may be handed to the learners while the step that ends at `version_after` trains,
        so that it starts the moment that one ends, not after the driver has logged it and formed the batch (one
        round trip per step). Asynchronous runs only (a synchronous batch waits for that step's weights), with
        the staleness bound taken at the version the batch is trained at; never behind a step that evaluates,
        checkpoints or ends the run, which must see the learners at `version_after`, not one step later (out of time
        and training again the steps a rewind dropped, the run ends at `retrain_until`: one step queued behind it was
        trained past it, and the step the run stopped at had no evaluation or checkpoint)."""
        cfg, t = self.cfg, self.cfg.trainer
        return (cfg.async_.max_staleness > 0 and version_after < t.total_steps and not self._evaluates_at(version_after)
                and not is_save_step(version_after, t.save_every, t.total_steps)
                and not self._out_of_time_at(0.0, version=version_after))

    def _evaluates_at(self, version: int) -> bool:
        """Whether the step that ends at `version` evaluates on trainer.eval_every's schedule: every eval_every-th,
        and the last (trainer.total_steps), whose policy is the run's result."""
        every = self.cfg.trainer.eval_every
        return bool(every) and (version % every == 0 or version == self.cfg.trainer.total_steps)

    def _train(self, batch: list[TrajectoryRef], version: int) -> TrainStep:
        """Rewards → advantages → the learners' train step at `version` (algorithm.steps_per_batch optimizer steps,
        after any step already in flight)."""
        cfg = self.cfg
        totals, normalized_means = training_rewards(batch, cfg.reward.functions)
        adv = assign_advantages(batch, global_std=cfg.algorithm.global_std, clip_max=cfg.algorithm.adv_clip_max,
                                stat_tracking=cfg.algorithm.stat_tracking, rewards=totals)
        trained, filtered = learner_batch(batch, self.learners.spec, version)
        self.learner_watchdog.busy("learners")
        return TrainStep(self.learners.train_step(trained, push_to=self.sync.actor), batch, self.sync.actor,
                         dataclasses.replace(self.queue.stats), normalized_means, adv.zero_signal_groups, filtered)

    def _serve(self, training: list[ray.ObjectRef] | None) -> None:
        """Wait (at most POLL_S) for something to finish; finished rollouts go to rewards (evaluation's stay with
        their futures), scored trajectories to the queue."""
        watching = [self.sync.watching] if self.sync.watching is not None else []
        refs = self.rollout.refs + self.rollout.replacement_refs + self.rewards.refs + (training or []) + watching
        if refs:
            ray.wait(refs, num_returns=1, timeout=POLL_S)
        else:  # nothing in flight or starting: poll without spinning
            time.sleep(POLL_S)
        finished = [future for future in self.rollout.collect() if future not in self.evaluating]
        for future in finished:
            self.rewards.submit_rollout(future.ref, future.request)
        if finished and self.cfg.learner.prefetch:  # the learners fetch them while the rest of the batch rolls out
            self.learners.prefetch([future.ref for future in finished], self.version)
        for trajectory in self.rewards.collect(timeout_s=0):
            self.queue.finished(trajectory)
        for request in self.rewards.take_lost():
            self._sample_again(request)

    def _sample_again(self, request: RolloutRequest) -> None:
        """`request`'s trajectories were lost before they were scored (the node that sampled them is gone, and its
        object store with them): it is sampled again as a dead replica's request is (same prompts, seeds and version
        bound: a synchronous run's samples are the same), and its group counted in rollout/regenerated. Its samples
        still count as running for admission: none of them reached the queue."""
        self.trajectory_losses[request.request_id] += 1
        self._allow_another_sampling("rollout", request, self.trajectory_losses[request.request_id], "they were scored")
        self.queue.stats.regenerated += 1
        self.rollout.submit(request)

    def _learner_stalled(self, training: list[ray.ObjectRef]) -> None:
        """A stalled learner rank holds the whole optimizer state: the run stops loudly (the last checkpoint is
        intact; the same command continues from it) rather than waiting on it."""
        (_, silent_s), = self.learner_watchdog.overdue()
        raise LearnerStalled(
            f"train step {self.version + 1} not done after {silent_s:.0f}s (deadline {self.learner_watchdog.deadline_s():.0f}s, "
            f"learner.stall_timeout_s={self.cfg.learner.stall_timeout_s}): {', '.join(self.learners.late_ranks(training))} "
            f"neither finished nor died; stopping. Continue from the last checkpoint with trainer.resume=auto"
        )

    def _admit(self) -> None:
        while self.queue.can_admit(self.version):
            self._submit([self.sampler.next_group()], new=True)

    def _submit(self, groups: list[PromptGroup], new: bool = False) -> None:
        # Every request starts under the newest version (the learners pushed it as their step ended): a rank still
        # holding an older one waits for it to be staged, so the driver need not wait for the broadcast. Synchronous
        # runs need that to be on-policy; asynchronous ones, because a trajectory begun under the older version would
        # be one version staler than its batch allows when trained, and be sampled again.
        min_version = self.version
        for group in groups:
            if new:
                self.queue.submitted(group)
            sampling = window_params(self.cfg.sampling, self.cfg.trainer.seed, self.version)
            for request in group.requests(sampling, self.cfg.rollout.micro_batch_size, min_version):
                self.rollout.submit(request)

    def _check_sync_failure(self, training_in_flight: bool) -> None:
        """Every pass of the loop (asynchronous mode waits for no version): a failed push or broadcast ends the run
        with its cause; a dead weight-sync actor, or one the rollout pool's `connect` found stalled, is replaced, and
        the current version pushed to it unless a train step is in flight (its end pushes the next version to the new
        actor; its own push went to the old one)."""
        failure = self.sync.failure()
        if failure is None:
            return
        if not isinstance(failure, (ray.exceptions.RayActorError, WeightSyncStalled)):
            raise failure
        self._replace_sync(failure, push=not training_in_flight)

    def _replace_sync(self, failure: ray.exceptions.RayActorError | WeightSyncStalled, push: bool) -> None:
        """Replace the dead or stalled weight-sync actor (sync.max_restarts; `failure` is logged as its cause),
        re-forming its group with the live rollout ranks; with `push`, learner rank 0 pushes the current version to
        the new actor (else the caller's next push goes to it). A rollout rank lost with the actor (one node) is taken
        out of service first: the new group waited for it to join until its collective timeout, and the run stopped."""
        self.rollout.take_out_dead()
        self.sync.restart(self.rollout.replicas, failure)
        if push:
            self._push_weights()

    def _push_weights(self) -> dict[str, float]:
        """Learner rank 0 hands the current version to the weight-sync actor; the ranks' push timings. An actor that
        had not taken rank 0's previous push is replaced as stalled, and the version pushed to its replacement."""
        while True:
            push = self.learners.get(self.learners.push_weights(self.sync.actor), self.learner_watchdog.deadline_s(),
                                     f"the weight push of version {self.version}")[0]
            if "stalled_version" not in push:
                return push
            self._replace_sync(self._stalled_at(int(push["stalled_version"])), push=False)  # the loop pushes to it

    def _stalled_at(self, version: int) -> WeightSyncStalled:
        """The weight-sync actor neither died nor took learner rank 0's push of `version`, or did not stage it, within
        the sync's timeout (stuck in it, or stopped): it is replaced as a dead one is (`_replace_sync`), not blamed on
        the learners, whose rank 0 waited for it (with no deadline it blocked their step until the learners' watchdog
        stopped the run), nor on the rollout replicas whose requests wait for the version."""
        return WeightSyncStalled(f"version {version} not taken from learner rank 0 or not staged within "
                                 f"{self.sync.timeout_s:.0f}s (rollout.collective_timeout_s): stuck or stopped")

    def _check_sync(self, push: bool = True) -> None:
        """A broadcast that met a dead receiver: find the dead replicas; a new sync group resends the newest version.
        A dead weight-sync actor is replaced (`push`: _replace_sync's), and a stopped one, which gives no answer, as
        stalled (asked with no deadline, it hung the run)."""
        try:
            lost = self.sync.lost_versions()
        except ray.exceptions.RayActorError as e:
            self._replace_sync(e, push)
            return
        except TimeoutError:
            self._replace_sync(self._stalled_at(self.version), push)
            return
        if lost:
            self.rollout.find_dead()

    def _generate(self, requests: list[RolloutRequest], weights: ray.ObjectRef | None = None) -> list[Trajectory]:
        """Blocking (evaluation): the requests' trajectories in request order, sampled under `weights` (synced-slot
        tensors; None: the rollout weights) while the loop serves the training requests in flight. A request whose
        trajectories are lost before the driver fetches them (with the node that sampled them, whose object store held
        them: ObjectLostError and its kinds) is sampled again, the same request (prompts, seeds, version bound: the
        evaluation's samples are the same), at most TRAJECTORY_LOSSES_PER_REQUEST times (it stopped the run)."""
        futures = self.rollout.map(requests, weights=weights)
        self.evaluating = set(futures)
        results: list[list[Trajectory] | None] = [None] * len(futures)
        losses: collections.Counter[int] = collections.Counter()
        try:
            while any(r is None for r in results):
                for i, future in enumerate(futures):
                    if results[i] is not None or not future.finished:
                        continue
                    try:
                        results[i] = future.result()
                    except ray.exceptions.ObjectLostError as e:
                        losses[i] += 1
                        futures[i] = self._evaluate_again(future, losses[i], e)
                        self.evaluating.add(futures[i])
                if any(r is None for r in results):
                    # No train step is in flight during an evaluation: a dead weight-sync actor is replaced now and
                    # the current version pushed (its `watch`, always ready once it died, spun `_serve`, and a replica
                    # replaced meanwhile joined no group).
                    self._check_sync_failure(training_in_flight=False)
                    self._serve(training=None)
        finally:
            self.evaluating = set()
        return [t for result in results for t in result]

    @staticmethod
    def _allow_another_sampling(kind: str, request: RolloutRequest, losses: int, lost_before: str,
                                error: BaseException | None = None) -> None:
        """The `kind` ("rollout", "evaluation") request's trajectories were lost `losses` times now, each before
        `lost_before`: TrajectoriesLost once that is more than TRAJECTORY_LOSSES_PER_REQUEST, else logged as sampled
        again."""
        if losses > TRAJECTORY_LOSSES_PER_REQUEST:
            raise TrajectoriesLost(
                f"the trajectories of {kind} request {request.request_id} (prompt {request.prompts[0]!r}) were lost "
                f"{losses} times before {lost_before} (each time with the node that sampled them; at most "
                f"{TRAJECTORY_LOSSES_PER_REQUEST} are sampled again); stopping the run. Continue from the last "
                f"checkpoint with trainer.resume=auto"
            ) from error
        cause = f": {type(error).__name__}" if error is not None else ""
        log.warning("sampling %s request %s again (its trajectories were lost%s; %d of %d times allowed)", kind,
                    request.request_id, cause, losses, TRAJECTORY_LOSSES_PER_REQUEST)

    def _evaluate_again(self, lost: PoolFuture, losses: int, error: ray.exceptions.ObjectLostError) -> PoolFuture:
        """An evaluation request whose trajectories were lost (`losses` times now) sent again, as `_sample_again` does
        for a training request's; one loss more than TRAJECTORY_LOSSES_PER_REQUEST stops the run."""
        self._allow_another_sampling("evaluation", lost.request, losses, "the driver fetched them", error)
        return self.rollout.submit(lost.request, lost.policy, lost.weights)

    def _finish(self, step: TrainStep, clock: StepClock, queued: bool) -> None:
        """The learners' step `step` has settled: its metrics (LearnerError if a rank failed), then `_step_done`."""
        try:
            metrics = self.learners.get(step.refs)[0]
        finally:
            self.learner_watchdog.progressed("learners", still_busy=queued)
        self._step_done(metrics, step, clock, queued)

    def _step_done(self, metrics: dict[str, float], step: TrainStep, clock: StepClock, queued: bool) -> None:
        """An optimizer step finished: new version → push weights → log → eval → checkpoint. `queued`: another
        step trains behind it (the run then stops after that one when out of time)."""
        cfg, batch = self.cfg, step.batch
        self.version += 1
        if "sync/stalled_version" in metrics and self.sync.actor is step.pushing_to:
            # Learner rank 0 sent no push: the actor had not taken its previous one. Replaced, it is pushed to below.
            self._replace_sync(self._stalled_at(int(metrics["sync/stalled_version"])), push=False)
        if self.sync.actor is step.pushing_to:  # learner rank 0 pushed the version when the step ended
            push_s = metrics.get("sync/gather_s", 0.0) + metrics.get("sync/push_s", 0.0)
        elif queued:
            # The weight-sync actor was replaced while the step trained (its push went to the dead one), and a step
            # is queued behind it, whose end pushes a newer version (its own push, or this branch's below): a push now
            # would run after that step on the learners, blocking the loop while it trains, and carry its version,
            # pushed again when it ended and refused as not newer (the run stopped). Requests wait for it meanwhile.
            push_s = 0.0
        else:  # the weight-sync actor was replaced while the step trained: its push went to the dead one
            push = self._push_weights()
            push_s = push["gather_s"] + push["push_s"]
        sync_s = push_s
        submitted_next = False
        if cfg.async_.max_staleness == 0:
            # The next batch rolls out as soon as the broadcast lands on the rollout ranks: its requests go now. Not
            # before an evaluation: it would roll out behind the evaluation's requests, inside the time excluded from
            # every step, and the next step would time its training alone (perf/step_s, trainer.time_limit_s); the
            # loop submits it once the evaluation is done.
            if (self.version < cfg.trainer.total_steps and not self._out_of_time_at(clock.elapsed())
                    and not self._evaluates_at(self.version)):
                self._admit()
                submitted_next = True
            sync_s += self._wait_synced()
        else:
            self._check_sync(push=not queued)
        rewards = torch.tensor([t.reward for t in batch])
        q = step.queue_stats
        scalars = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std(unbiased=False)),
            **{f"reward/{name}": float(torch.tensor([t.rewards[name] for t in batch]).mean()) for name in batch[0].rewards},
            **step.normalized_means,
            "loss/policy": metrics["loss/policy"],
            "loss/kl": metrics["loss/kl"],
            "train/clip_frac": metrics.get("train/clip_frac", 0.0),
            "train/approx_kl": metrics.get("train/approx_kl", 0.0),
            "train/grad_norm": metrics["train/grad_norm"],
            "train/skipped_steps": metrics["train/skipped_steps"],
            "train/zero_signal_groups": step.zero_signal_groups,
            "train/filtered_samples": step.filtered_samples,
            "staleness/mean": q.staleness_mean,
            "staleness/max": q.staleness_max,
            "rollout/partial_ratio": q.partial_ratio,
            "rollout/max_partial_span": q.max_partial_span,
            "rollout/regenerated": q.regenerated,
            "rollout/dropped": q.dropped,
            "rollout/queue_depth": self.queue.depth,
            "rollout/replica_restarts": self.replica_restarts,
            "perf/sync_s": sync_s,
            "perf/push_s": push_s,
            "perf/fetch_s": metrics["perf/fetch_s"],
            "perf/prefetched": metrics["perf/prefetched"],
            **clock.lap(images=len(batch)),
        }
        self.train_s += scalars["perf/step_s"]
        scalars["perf/train_s"] = self.train_s
        self.history.append(scalars)
        self.monitor.log(self.version, scalars)
        self.skips.observe(int(metrics["train/skipped_steps"]) - self.skips.total, self.version - 1, cfg.algorithm.steps_per_batch,
                           SkipRuns.from_metrics(metrics))
        if not cfg.logging.progress_bar:
            log.info("step %d  reward %.4f  loss %+.5f  staleness %.2f  %.2fs", self.version, scalars["reward/mean"],
                     scalars["loss/policy"], scalars["staleness/mean"], scalars["perf/step_s"])
        # A synchronous batch submitted before the broadcast, in time, is trained even if the limit passed during the
        # broadcast (it rolled out for nothing, and the final evaluation's requests queued behind it); the run stops
        # after it.
        self.next_batch_committed = submitted_next and self.out_of_time
        stopping = self.out_of_time and self.version < cfg.trainer.total_steps and not queued and not submitted_next
        if cfg.trainer.eval_every and (self._evaluates_at(self.version) or stopping):
            with clock.excluded():  # neither this step's time nor the next one's
                if cfg.async_.max_staleness > 0:
                    # The evaluation's requests wait on the rollout ranks for this step's version (the EMA's tensors
                    # come from the weight-sync actor): its broadcast is waited for first, within the sync's deadline,
                    # so that a stuck or stopped weight-sync actor is replaced as stalled. The requests had only the
                    # rollout watchdog's deadline (rollout.stall_timeout_s), which replaced the replicas instead. No
                    # train step is in flight for a push to queue behind: none queues behind a step that evaluates
                    # (_may_queue_behind), and a stopping one has none queued.
                    self._wait_synced()
                self.evaluator.run(self.version, self.monitor, self._eval_weights())
        if is_save_step(self.version, cfg.trainer.save_every, cfg.trainer.total_steps) or stopping:
            # Not left out of the clock as evaluation is: the next batch rolls out meanwhile (a synchronous one went
            # before the broadcast), and its rollout would go uncounted. The save is in the next step's perf/step_s.
            self._save()

    @property
    def out_of_time(self) -> bool:
        """trainer.time_limit_s has passed (the loop ends after this step, or after the one queued behind it, or the
        synchronous batch submitted before its broadcast: `next_batch_committed`)."""
        return self._out_of_time_at(0.0)

    def _out_of_time_at(self, step_s: float, version: int | None = None) -> bool:
        """trainer.time_limit_s has passed once the step in progress has taken `step_s` (and the steps a rewind after it
        dropped are trained again: `retrain_until`), at `version` (None: the current one)."""
        limit, version = self.cfg.trainer.time_limit_s, self.version if version is None else version
        return limit is not None and self.train_s + step_s >= limit and version >= self.retrain_until

    @property
    def replica_restarts(self) -> int:
        """Rollout replicas replaced in the whole run (rollout/replica_restarts): this start's and those before it."""
        return self.replica_restarts_before + sum(self.rollout.restarts)

    def _eval_weights(self) -> ray.ObjectRef | None:
        """With trainer.ema_decay > 0, the "ema" adapter as the rollout ranks' slot holds it (flow_grpo evaluates
        its train.ema weights); else None: evaluate the rollout weights."""
        if self.cfg.trainer.ema_decay == 0:
            return None
        adapter = self.learners.get(self.learners.adapter_weights(EVAL_EMA_ADAPTER), self.learner_watchdog.deadline_s(),
                                    f"the evaluation weights of step {self.version}")[0]
        return self.sync.slot_tensors(adapter)

    def _wait_synced(self) -> float:
        """Block until the newest version is on every live rollout rank; seconds the broadcast took."""
        while True:
            try:
                # The learners' death (below) is looked for every POLL_S, not only at the deadline (620 s by default).
                return self.sync.wait(self.version, timeout_s=self.sync.deadline_s, check_every_s=POLL_S,
                                      check=lambda: self.learners.check_alive(POLL_S)).broadcast_s
            except ReceiversLost as e:
                log.warning("%s", e)
                self._check_sync()
            except ray.exceptions.RayActorError as e:  # the weight-sync actor died
                self._replace_sync(e, push=True)
            except TimeoutError:  # not staged in time: its push not taken (or not broadcast), or the actor stopped
                # Learner rank 0 owns its push until the actor has taken it: dead before that (its node lost as the
                # actor fetched it), the version never came. That is the learners' death (LearnerError: they restart
                # and rewind), not a stalled actor's (it was replaced, a sync restart spent, before the push to the
                # replacement found the death).
                self.learners.check_alive(self.sync.spec.grace_s)
                self._replace_sync(self._stalled_at(self.version), push=True)

    # -- checkpoints -------------------------------------------------------------------------------
    def _save(self) -> None:
        pending = sorted(self.queue.groups)
        data = {**self.sampler.state_dict(), "pending_groups": pending}
        ckpt = self.learners.checkpoint(self.version, data, timeout_s=self.learner_watchdog.deadline_s())
        ckpt.base_model = base_model_record(self.cfg.model)
        ckpt.counters["consecutive_skipped"] = self.skips.in_a_row
        ckpt.counters["regenerated_groups"] = self.queue.stats.regenerated  # the run's totals, as logged
        ckpt.counters["dropped_groups"] = self.queue.stats.dropped
        ckpt.counters["replica_restarts"] = self.replica_restarts
        path = save_checkpoint(checkpoint_root(self.cfg.trainer.run_dir), ckpt, self.cfg.trainer.keep_checkpoints,
                               previous_step=self.rewind_step)
        self.rewind_point, self.rewind_step = path, ckpt.step
        log.info("saved %s", path)

    def _resume(self) -> None:
        self.resumed_from = resolve_resume(self.cfg.trainer.resume, checkpoint_root(self.cfg.trainer.run_dir))
        """The checkpoint the run started from (None: from the start)."""
        self.rewind_point = self.resumed_from
        """Where a learner death rewinds to: the newest checkpoint of this run's own timeline (the last one it saved,
        else the one it started from), never one the run directory holds from an abandoned timeline (a later step
        that a resume from an earlier checkpoint left behind, set aside only at the first save) or another run."""
        self.first_version = 0
        self.rewind_step = 0
        """The step of `rewind_point` (0: the start): a save sets aside the checkpoints after it that are not this
        run's (save_checkpoint's previous_step)."""
        self.replica_restarts_before = 0
        """Rollout replica restarts of the run before this start (its checkpoint's): rollout/replica_restarts is the
        run's total, as rollout/regenerated and rollout/dropped are."""
        if self.resumed_from is not None:
            self._restore(self.resumed_from)
            self.first_version = self.rewind_step = self.version
            log.info("resumed from %s at step %d", self.resumed_from, self.version)

    def _restore(self, path: str | None, rewind: bool = False) -> None:
        """Continue from checkpoint `path` (None: from the start, the learners at version 0): learner state, data
        position, skipped-step counters; the rollout ranks get the version's weights (`rewind`: they forget the newer
        versions they hold first); then a new queue (admission counts every sample trained on so far) and the groups
        in flight at the save, drawn again first."""
        if path is None:
            version, data, counters = 0, {"groups_drawn": 0, "seed": self.cfg.trainer.seed}, {}
        else:
            ckpt = load_checkpoint(path, self.learners.identity)
            self.learners.restore(ckpt, timeout_s=self.learner_watchdog.deadline_s())
            version, data, counters = ckpt.version, ckpt.data, ckpt.counters
        self.skips.load(counters)
        self.sampler.load_state_dict(data)
        self.version = version
        if rewind:
            self._rewind_rollout(version)
        else:  # a rewind goes on from this process's restarts, which happened
            self.replica_restarts_before = counters.get("replica_restarts", 0)
        self._push_weights()
        self._wait_synced()
        # A rewind goes on from this process's totals (groups regenerated since the checkpoint were regenerated); a
        # resumed run from the checkpoint's.
        totals = self.queue.stats if rewind else QueueStats(regenerated=counters.get("regenerated_groups", 0),
                                                             dropped=counters.get("dropped_groups", 0))
        self.queue = self._new_queue(accepted=version * self.cfg.algorithm.batch_size, totals=totals)
        for gid in data.get("pending_groups", []):  # under the version's weights
            group = self.sampler.group(gid)
            self.queue.submitted(group)
            self._submit([group])

    def _rewind_rollout(self, version: int) -> None:
        """The rollout ranks in service forget the versions after `version` and join a new weight-sync group. A rank
        found dead as they are asked (on a lost node Ray marks its actors dead only once the node's health checks
        fail, which can be after the learners' death was seen and the pool asked), or one that does not answer
        (stopped since the pool's last liveness check, which now finds it stalled), is taken out of service, and the
        rest asked again."""
        while True:
            try:
                self.sync.rewind(version, self.rollout.replicas)
                return
            except (ray.exceptions.RayActorError, TimeoutError):
                if not self.rollout.take_out_dead():
                    raise

    def _new_queue(self, accepted: int, totals: QueueStats | None = None) -> StalenessQueue:
        """An empty queue whose admission counts `accepted` samples trained on so far, and whose counts of regenerated
        and dropped groups go on from `totals` (the queue a rewind replaces: they are logged as the run's totals)."""
        cfg = self.cfg
        queue = StalenessQueue(cfg.algorithm.batch_size, cfg.algorithm.group_size, cfg.async_.max_staleness,
                               cfg.async_.over_stale)
        queue.accepted = accepted
        if totals is not None:
            queue.stats.regenerated, queue.stats.dropped = totals.regenerated, totals.dropped
        return queue

    def _restart_learners(self, died: LearnerError, unfinished: int = 0) -> None:
        """A learner rank died. The learners hold the only copy of the optimizer state (sharded: the dead rank's
        part is gone), so the group is started again in its bundles (learner.max_restarts) and the run rewinds to
        `rewind_point`: the work in flight is dropped, the weight-sync actor replaced (no push of the dead
        ranks can reach the rollouts), the rollout ranks forget later versions, and the steps after it are trained
        again. A rank that raised (not died) would raise again: the run stops. A rank that could not fetch its batch's
        trajectories (lost with the node that sampled them: ObjectLostError and its kinds) is handled as a death: the
        batch is gone, and its peers may wait for that rank in a collective; the rewind samples the batch again. A
        rank that dies during the restore restarts the group again (each restart counts against learner.max_restarts).
        `unfinished`: the learners' steps in flight the run was to train before it stopped (a synchronous batch
        committed is counted here: a death found at the top of the loop, before that batch is formed, skipped it)."""
        lost = self.version
        if self.out_of_time:  # the run was stopping at `lost` + the steps in flight: it trains up to there again
            self.retrain_until = max(self.retrain_until, lost + unfinished + int(self.next_batch_committed))
        while True:
            if not isinstance(died.__cause__, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
                raise died
            self.learner_watchdog.forget("learners")  # its clock starts with the next step, not the restart
            self.learners.restart(died)
            # A rank that died saving (full fine-tuning) left its shards' staging directory: removed now, not at the
            # next start (a run with restarts left could leave one of a model's size per death).
            remove_leftovers(checkpoint_root(self.cfg.trainer.run_dir))
            path = self.rewind_point
            log.error("%s; learner group restarted (restart %d), rewinding from step %d to %s", died,
                      self.learners.restarts, lost, path or "the start")
            # Requests in flight waiting for a version the rewind voids, or whose push died with the learners, would
            # hold their replicas (dropping them waited out the rollout watchdog's deadline): they fail at once.
            self.sync.abandon_waits(self.rollout.replicas)
            self._drop_in_flight()
            # A rollout rank may have died with it (one node lost): an idle pool has not noticed, and the rewind asks
            # every rank in service to forget the newer versions.
            self.rollout.take_out_dead()
            try:
                self._restore(path, rewind=True)
                break
            except LearnerError as again:  # a rank of the new group died in the restore: restart again, on budget
                died = again
        del self.history[self.version - self.first_version:]
        # The skipped-step total is the checkpoint's again (the other counters' totals are kept across a rewind).
        self.monitor.rewind(self.version, {"train/skipped_steps": self.skips.total})
        redone = ("no finished step is lost" if lost == self.version else f"step {lost} is trained again"
                  if lost == self.version + 1 else f"steps {self.version + 1}..{lost} are trained again")
        log.warning("rewound to step %d (%s); training goes on from step %d", self.version, redone, self.version + 1)

    def _drop_in_flight(self) -> None:
        """Drop the rollouts and reward calls in flight (after they finish: replicas and workers serve in order): they
        belong to the steps being rewound."""
        self.rollout.drop_in_flight()
        self.rewards.drain()
        self.next_batch_committed = False  # its requests were among those dropped
        # Their losses go with them: the rewind draws the same groups again, under the same request ids, and a loss in
        # the dropped timeline counted against the new one's (TRAJECTORY_LOSSES_PER_REQUEST reached early).
        self.trajectory_losses.clear()

    def shutdown(self) -> None:
        for component in reversed(self.components):
            try:
                component.shutdown() if hasattr(component, "shutdown") else component.close()
            except Exception as e:  # keep tearing down the rest
                log.warning("shutting down %s: %s", type(component).__name__, e)
        self.components = []
