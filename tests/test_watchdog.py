"""The watchdog: deadlines from measured service times (unit); a rollout rank stopped with SIGSTOP (W = 1)
reported within the deadline and replaced, the synchronous run's result unchanged; a stopped learner rank
stops the run loudly within its deadline; a stopped rank of a CFG-parallel replica (W = 2), told by its peer's
collective timeout, and a stopped reward worker are replaced and the synchronous run's result is unchanged."""

import contextlib
import logging
import os
import re
import signal
import time

import pytest

from rayflow import reference
from rayflow.driver.trainer import Trainer
from rayflow.distributed.watchdog import Watchdog
from rayflow.learner.worker import LearnerStalled
from tiny_run import GRPO, small_cfg


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_deadline_is_the_floor_until_measured_then_a_multiple_of_the_longest_service_time():
    clock = Clock()
    dog = Watchdog(floor_s=10.0, factor=4.0, window=3, clock=clock)
    assert dog.deadline_s() == 10.0
    dog.busy("a")
    clock.now = 2.0
    dog.progressed("a", still_busy=True)  # 2 s for the first request; a second one is queued
    clock.now = 7.0
    dog.progressed("a", still_busy=False)  # 5 s since the last progress, not 7 since it was queued
    assert list(dog.service_s) == [2.0, 5.0] and dog.deadline_s() == 20.0
    for _ in range(3):  # older measures leave the window
        dog.busy("a")
        clock.now += 1.0
        dog.progressed("a", still_busy=False)
    assert dog.deadline_s() == 10.0  # 4 x 1 s is below the floor


def test_only_a_busy_replica_past_the_deadline_is_overdue():
    clock = Clock()
    dog = Watchdog(floor_s=10.0, factor=2.0, clock=clock)
    dog.busy("stuck")
    dog.busy("idle-then-busy")
    clock.now = 9.0
    dog.progressed("idle-then-busy", still_busy=False)  # idle now: never overdue
    assert dog.overdue() == []
    clock.now = 18.5  # deadline: max(10, 2 x 9) = 18
    assert dog.overdue() == [("stuck", 18.5)]
    dog.forget("stuck")
    assert dog.overdue() == []


def test_a_stopped_rank_is_reported_within_the_deadline_rollout_replaced_learner_stops_the_run(ray_session, tiny_model_dir, tmp_path, caplog):
    import ray

    floor_s = 4.0
    overrides = ["trainer.eval_every=0", "logging.progress_bar=false", "async.max_staleness=0", "rollout.max_restarts=1",
                 f"rollout.stall_timeout_s={floor_s}", "rollout.stall_factor=2", f"learner.stall_timeout_s={floor_s}"]
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "distributed", "trainer.total_steps=1", *overrides)
    trainer = Trainer(cfg)
    try:
        trainer.run()
        stopped = trainer.rollout.replicas[0]
        pid = ray.get(stopped.workers[0].__ray_call__.remote(lambda worker: os.getpid()))
        os.kill(pid, signal.SIGSTOP)  # neither answers nor dies: Ray reports nothing
        stopped_at = time.time()
        trainer.cfg.trainer.total_steps = 2
        with caplog.at_level(logging.ERROR, logger="rayflow"):
            trainer.run()
        assert trainer.rollout.dead == [stopped] and trainer.rollout.restarts == [1]
        stall = next(r for r in caplog.records if "stalled" in r.getMessage())
        assert "rank 0 of 1 on node 127.0.0.1 (node id " in stall.getMessage() and "while sampling requests ['g1-s0']" in stall.getMessage()
        # Told within the deadline (the floor: requests of the tiny model take well under floor/2), plus the loop's poll.
        assert stall.created - stopped_at < trainer.rollout.watchdog.deadline_s() + 3.0

        # A learner rank stopped: the train step's deadline passes and the run stops, naming the rank.
        pid = ray.get(trainer.learners.workers[0].__ray_call__.remote(lambda worker: os.getpid()))
        os.kill(pid, signal.SIGSTOP)
        trainer.cfg.trainer.total_steps = 3
        with pytest.raises(LearnerStalled, match=r"train step 3 not done after \d+s .*learner rank 0 of 1 on node 127\.0\.0\.1") as e:
            trainer.run()
        assert float(re.search(r"not done after (\d+)s", str(e.value)).group(1)) <= trainer.learner_watchdog.deadline_s() + 2.0
    finally:
        trainer.shutdown()
    _, ref_history = reference.train(small_cfg(GRPO, tiny_model_dir, tmp_path / "reference", "trainer.total_steps=2",
                                               *overrides), log=lambda *_: None)
    assert [h["reward/mean"] for h in trainer.history] == [r.reward_mean for r in ref_history]
    assert [h["loss/policy"] for h in trainer.history] == [r.metrics["loss/policy"] for r in ref_history]
    assert [h["train/grad_norm"] for h in trainer.history] == [r.grad_norm for r in ref_history]


def test_a_stopped_cfg_parallel_rank_and_a_stopped_reward_worker_are_replaced_the_run_unchanged(ray_session, tiny_model_dir, tmp_path, caplog):
    import ray

    collective_s, floor_s = 4.0, 4.0
    # The rollout watchdog's floor is far away: the healthy peer's collective timeout is what tells.
    overrides = ["trainer.eval_every=0", "logging.progress_bar=false", "async.max_staleness=0", "rollout.cfg_parallel_size=2",
                 f"rollout.collective_timeout_s={collective_s}", "rollout.stall_timeout_s=120", "rollout.max_restarts=1",
                 f"reward.stall_timeout_s={floor_s}", "reward.stall_factor=2", "reward.max_restarts=1"]
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "distributed", "trainer.total_steps=1", *overrides)
    trainer, stopped_pids = Trainer(cfg), []

    def stop(actor) -> float:
        stopped_pids.append(ray.get(actor.__ray_call__.remote(lambda worker: os.getpid())))
        os.kill(stopped_pids[-1], signal.SIGSTOP)  # neither answers nor dies: Ray reports nothing
        return time.time()

    try:
        trainer.run()
        stopped = trainer.rollout.replicas[0]
        rank_stopped_at = stop(stopped.workers[1])
        stop(trainer.rewards.workers[0])
        trainer.cfg.trainer.total_steps = 2
        with caplog.at_level(logging.WARNING, logger="rayflow"):
            trainer.run()  # no CollectiveError: the replica is out of service, replaced, its request re-issued
        assert trainer.rollout.dead == [stopped] and trainer.rollout.restarts == [1]
        left = next(r for r in caplog.records if "left a collective" in r.getMessage())
        assert re.search(r"rank 0 of 2 on node 127\.0\.0\.1 \(node id \w+\) left a collective during request 'g1-s0' "
                         r"because rank 1 of 2 on node 127\.0\.0\.1 \(node id \w+\) died or stalled", left.getMessage())
        assert left.created - rank_stopped_at < collective_s + 10.0  # the peer's timeout, plus a loaded machine's lag
        # The replacement's request then met the stopped reward worker: reported, replaced, the call re-issued.
        stall = next(r for r in caplog.records if "reward worker 0" in r.getMessage())
        assert re.search(r"reward worker 0 of \d+ on node 127\.0\.0\.1 \(node id \w+\) stalled: finished nothing for \d+s \(deadline "
                         r"4s, reward.stall_timeout_s=4.0\) while scoring a batch of 4 images \(prompts \[.+\]\); "
                         r"re-issuing its calls; replacing it \(restart 1\)", stall.getMessage())
        assert trainer.rewards.restarts == [1]
    finally:
        for pid in stopped_pids:
            with contextlib.suppress(ProcessLookupError):  # killed as stalled, unless the test failed first
                os.kill(pid, signal.SIGCONT)
        trainer.shutdown()
    _, ref_history = reference.train(small_cfg(GRPO, tiny_model_dir, tmp_path / "reference", "trainer.total_steps=2",
                                               *overrides), log=lambda *_: None)
    assert [h["reward/mean"] for h in trainer.history] == [r.reward_mean for r in ref_history]
    assert [h["loss/policy"] for h in trainer.history] == [r.metrics["loss/policy"] for r in ref_history]
    assert [h["train/grad_norm"] for h in trainer.history] == [r.grad_norm for r in ref_history]
