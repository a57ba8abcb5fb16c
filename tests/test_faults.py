"""Actors killed in a running Trainer, and a weight broadcast that fails: a fault past recovery stops an asynchronous
run before another step, naming its cause; a killed weight-sync actor or learner rank is replaced while its restarts
last; with one actor of each kind killed, a synchronous run stays equal, step for step, to the single-process
reference trainer."""

import dataclasses
import os
import re
import signal
import threading
import time
from types import SimpleNamespace
from typing import Callable

import pytest
import ray
import torch

from rayflow import reference
from rayflow.checkpoint import checkpoint_root, load_checkpoint, sharded_staging_dir, step_dir
from rayflow.driver import trainer as trainer_module
from rayflow.driver.trainer import Trainer, TrajectoriesLost
from rayflow.learner.worker import LearnerError, LearnerGroup, LearnerStalled
from rayflow.sync.source import WeightSyncError
from rayflow.sync.buckets import to_wire
from tiny_run import GRPO, lost_ref, slow_learners, small_cfg, wait_until_dead

STEPS = 4
SYNCHRONOUS = ("trainer.eval_every=0", "logging.progress_bar=false", "async.max_staleness=0", "trainer.save_every=2",
               f"trainer.total_steps={STEPS}")
ASYNCHRONOUS = ("trainer.eval_every=0", "logging.progress_bar=false", "async.max_staleness=1")
SYNC_STALLS_IN_3_S = ("trainer.save_every=0", "trainer.total_steps=4", "rollout.collective_timeout_s=3",
                      "learner.stall_timeout_s=60")
"""A weight-sync actor that takes no push is found within 3 s, long before the learners' watchdog (its deadlines, in
multiples of the timeout, are the fault tests' longest waits: a stopped actor's settle 4 x 3 = 12 s)."""


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir, tmp_path_factory):
    """The single-process reference trainer's STEPS synchronous steps: (history, final adapters)."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path_factory.mktemp("faults") / "reference", *SYNCHRONOUS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as conftest's _one_thread, which a module fixture runs before
    try:
        _, history = reference.train(cfg, log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    return history, load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), STEPS)).adapters


def assert_equal_to_undisturbed(trainer: Trainer, undisturbed) -> None:
    expected, adapters = undisturbed
    history = trainer.history
    assert [h["reward/mean"] for h in history] == [r.reward_mean for r in expected]
    assert [h["loss/policy"] for h in history] == [r.metrics["loss/policy"] for r in expected]
    assert [h["train/grad_norm"] for h in history] == [r.grad_norm for r in expected]
    final = load_checkpoint(step_dir(checkpoint_root(trainer.cfg.trainer.run_dir), STEPS)).adapters
    assert all(torch.equal(final[n][k], v) for n in adapters for k, v in adapters[n].items())


def run_to(trainer: Trainer, step: int) -> None:
    trainer.cfg.trainer.total_steps = step
    trainer.run()


def kill_after_steps(trainer: Trainer, monkeypatch, schedule: dict[int, Callable[[], list]]) -> None:
    """After step k is done (logged, checkpointed), kill the actors `schedule[k]()` returns; once, even if a rewind
    trains step k again."""
    step_done = trainer._step_done

    def step_done_then_kill(*args):
        step_done(*args)
        for actor in schedule.pop(trainer.version, lambda: [])():
            ray.kill(actor)

    monkeypatch.setattr(trainer, "_step_done", step_done_then_kill)


def test_a_learner_ranks_death_is_reported_over_its_peers_collective_error(ray_session):
    """With several ranks, a rank's death fails its peers' collectives, often before Ray reports the death. The learners
    restart on a death and stop on any other error: `LearnerGroup.get` reports the death (it reported the first error)."""

    @ray.remote(num_cpus=0)
    def peer_step():
        raise RuntimeError("[gloo] Connection closed by peer")

    @ray.remote(num_cpus=0)
    class Rank:
        def step(self):
            time.sleep(60)

    dying = Rank.remote()
    refs = [peer_step.remote(), dying.step.remote()]
    ray.wait(refs[:1])  # the peer's error is in first
    ray.kill(dying)
    group = SimpleNamespace(placed=SimpleNamespace(describe=lambda rank: f"{rank} of 2"))
    with pytest.raises(LearnerError, match=r"^learner rank 1 of 2 failed: ActorDiedError") as info:
        LearnerGroup.get(group, refs)
    assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)


def test_faults_past_recovery_stop_an_asynchronous_run_before_another_step_naming_the_cause(
        ray_session, tiny_model_dir, tmp_path):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, "learner.max_restarts=0")
    trainer = Trainer(cfg)
    try:
        run_to(trainer, 1)
        ray.kill(trainer.learners.workers[0])
        with pytest.raises(LearnerError, match=r"learner rank 0 of 1 on node .*ActorDiedError.*restarts are used up "
                                               r"\(learner.max_restarts=0 per learner.restart_window_s=3600"):
            run_to(trainer, 3)
        # A push whose adapter binds nothing on the rollout ranks: every receiver refuses it and the broadcast fails.
        # Asynchronous rollouts would go on under version 1 while every group turned stale and was regenerated.
        trainer.sync.actor.push.remote(to_wire(2, {"bogus.lora_A.weight": torch.zeros(2, 2)}))
        assert trainer.sync.failure(timeout_s=60) is not None
        with pytest.raises(WeightSyncError, match=r"stopped at version 2: ValueError: .*unexpected .*bogus"):
            run_to(trainer, 3)
        assert len(trainer.history) == 1  # raised before another step
    finally:
        trainer.shutdown()


def test_a_killed_weight_sync_actor_or_learner_rank_is_replaced_in_an_asynchronous_run_while_restarts_last(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, "trainer.save_every=2", "trainer.total_steps=5",
                    "sync.max_restarts=1", "sync.restart_window_s=0", "learner.max_restarts=1")
    trainer = Trainer(cfg)
    try:
        kill_after_steps(trainer, monkeypatch, {
            1: lambda: [trainer.sync.actor],
            4: lambda: [trainer.sync.actor],
        })
        # The learner rank dies once step 3 trains with the next batch queued behind it (rewinding to step 2's
        # checkpoint, with rollouts in flight); the queued step had restarted the learners' clock as the step failed.
        # A learner slower than rollout has the batch complete in time (steps 2 and 4 checkpoint: none queues behind).
        slow_learners(trainer, 1.0)
        train, restart_learners, clocks_after_rewind, totals_after_rewind = trainer._train, trainer._restart_learners, [], []

        def train_then_kill(batch, version):
            step = train(batch, version)
            queued_behind = version > trainer.version  # trained at a version the step in flight has not reached yet
            if queued_behind and trainer.version == 2 and not clocks_after_rewind:
                ray.kill(trainer.learners.workers[0])
                wait_until_dead(trainer.learners.workers[0])
            return step

        def restart_and_look(died, *args):
            trainer.queue.stats.regenerated, trainer.queue.stats.dropped = 7, 2  # as if groups had gone stale
            restart_learners(died, *args)
            clocks_after_rewind.append(dict(trainer.learner_watchdog.busy_since))
            totals_after_rewind.append((trainer.queue.stats.regenerated, trainer.queue.stats.dropped))

        monkeypatch.setattr(trainer, "_train", train_then_kill)
        monkeypatch.setattr(trainer, "_restart_learners", restart_and_look)
        with pytest.raises(WeightSyncError, match=r"the weight-sync actor died \(ActorDiedError.*restarts are used up "
                                                  r"\(sync.max_restarts=1 per sync.restart_window_s=0"):
            trainer.run()
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 1
        # Step 3 failed before it finished: no finished step is lost.
        assert "rewound to step 2 (no finished step is lost); training goes on from step 3" in caplog.text
        # No learner clock runs through the restart: the step queued behind the failed one had started it, and the
        # restart's seconds counted against the next step's deadline (and inflated the measured service times).
        assert clocks_after_rewind == [{}]
        # rollout/regenerated and rollout/dropped are the run's totals: the rewind's new queue goes on from them.
        assert totals_after_rewind == [(7, 2)]
        # Each replacement got the current version: the rollouts followed the learner (else every group would have
        # turned stale and been regenerated for ever), within the bound, up to the second death of the sync actor.
        assert [h["staleness/max"] <= 1 for h in trainer.history] == [True] * 4
    finally:
        trainer.shutdown()


def test_a_weight_sync_actor_killed_with_a_step_queued_behind_the_one_training_is_replaced(ray_session, tiny_model_dir,
                                                                                             tmp_path, monkeypatch):
    """Asynchronous, the next batch queued on the learners behind the step in flight, both pushing to the weight-sync
    actor, which is killed: the replacement gets each version once. The driver pushed again as the first step ended,
    which ran on the learners after the queued step and carried its version; that step's end pushed it again, refused
    as not newer: "weight sync stopped at version 2: ValueError: push of version 2: not newer than version 2"."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, "trainer.save_every=0", "trainer.total_steps=5",
                    "sync.max_restarts=1", "sync.restart_window_s=0")
    trainer = Trainer(cfg)
    try:
        slow_learners(trainer, 1.0)  # rollout outpaces training: batches queue behind the step in flight
        train, killed = trainer._train, []

        def train_then_kill(batch, version):
            step = train(batch, version)
            if version > trainer.version and not killed:  # queued behind the step in flight
                killed.append(trainer.sync.actor)
                ray.kill(trainer.sync.actor)
                wait_until_dead(trainer.sync.actor)
            return step

        monkeypatch.setattr(trainer, "_train", train_then_kill)
        trainer.run()
        assert killed and trainer.sync.restarts == 1 and len(trainer.history) == 5
        assert [h["staleness/max"] <= 1 for h in trainer.history] == [True] * 5  # the rollouts followed the learners
    finally:
        trainer.shutdown()


def kill_in_save(trainer: Trainer, monkeypatch, step: int, actors: Callable[[], list]) -> None:
    """Kill the actors `actors()` returns as step `step`'s checkpoint is asked of the learners (once), and wait
    until they are dead, so the save meets the death."""
    checkpoint = trainer.learners.checkpoint

    def killed_first(at: int, data: dict, **kwargs):
        if at == step and not getattr(killed_first, "done", False):
            killed_first.done = True
            for actor in actors():
                ray.kill(actor)
                wait_until_dead(actor)
        return checkpoint(at, data, **kwargs)

    monkeypatch.setattr(trainer.learners, "checkpoint", killed_first)


def test_one_actor_of_each_kind_killed_during_a_synchronous_run_leaves_it_equal_to_an_undisturbed_one(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """A rollout rank and a reward worker after step 1, the weight-sync actor after step 2, a learner rank after
    step 3 (the newest checkpoint is step 2's: step 3 is trained again) and one inside step 4's save (steps 3 and 4
    trained again: a death there stopped the run)."""
    # The driver wakes on what it waits for (a replacement's placement and ranks starting, not only the requests in
    # flight): no step here waits out its poll, which the lone replica's replacement did twice.
    monkeypatch.setattr(trainer_module, "POLL_S", 60.0)
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS))
    try:
        kill_after_steps(trainer, monkeypatch, {
            1: lambda: [trainer.rollout.replicas[0].workers[0], trainer.rewards.workers[0]],
            2: lambda: [trainer.sync.actor],
            3: lambda: [trainer.learners.workers[0]],
        })
        kill_in_save(trainer, monkeypatch, STEPS, lambda: [trainer.learners.workers[0]])
        trainer.run()
        assert trainer.rollout.restarts == [1] and trainer.rewards.restarts == [1]
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 2
        assert "rewound to step 2 (step 3 is trained again)" in caplog.text
        assert "rewound to step 2 (steps 3..4 are trained again)" in caplog.text
        assert all(h["perf/step_s"] < trainer_module.POLL_S for h in trainer.history), trainer.history
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def test_a_learner_and_a_rollout_rank_lost_together_rewind_and_replace_the_rank(ray_session, tiny_model_dir, tmp_path,
                                                                                undisturbed, monkeypatch, caplog):
    """One node lost in step 2's save: a learner rank and the rollout rank serving the next batch die together. The
    requests in flight are dropped; the rewind finds the dead replica and replaces it before it asks every rank to
    forget the newer versions (it asked the dead one, and the run stopped), and the run ends equal to an undisturbed
    one."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS))
    try:
        kill_in_save(trainer, monkeypatch, 2, lambda: [trainer.learners.workers[0], trainer.rollout.replicas[0].workers[0]])
        trainer.run()
        assert trainer.learners.restarts == 1 and trainer.rollout.restarts == [1]
        assert "rewound to step 0 (steps 1..2 are trained again)" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def test_trajectories_lost_with_their_node_are_sampled_again_and_the_run_stays_equal_to_an_undisturbed_one(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """A request's trajectories live in the object store of the rollout node that sampled them. Lost before they are
    scored (step 3's request): the reward call failed with an ObjectLostError, was retried and stopped the run as
    "reward failed". Lost before the learners fetch them (step 3's batch): the learner rank raised and the run stopped.
    Now the request is sampled again (counted in rollout/regenerated), and the learners' step is handled as a death:
    the group restarts and rewinds to step 2, which samples the batch again, under the same request ids: a loss of the
    request there is counted afresh (the dropped timeline's loss counted too, and the limit, here 1, stopped the run).
    The run ends equal to an undisturbed one."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS))
    monkeypatch.setattr(trainer_module, "TRAJECTORY_LOSSES_PER_REQUEST", 1)
    submit_rollout, train_step = trainer.rewards.submit_rollout, trainer.learners.train_step
    lost = {"reward": []}

    def scored_after_its_node_is_lost(ref, request):
        if trainer.version == 2 and len(lost["reward"]) < 1 + ("learner" in lost):  # once in each timeline
            lost["reward"].append(request.request_id)
            ref = lost_ref()
        submit_rollout(ref, request)

    def fetched_after_its_node_is_lost(batch, push_to=None):
        if trainer.version == 2 and "learner" not in lost:
            lost["learner"] = True
            batch = [dataclasses.replace(batch[0], ref=lost_ref()), *batch[1:]]
        return train_step(batch, push_to)

    monkeypatch.setattr(trainer.rewards, "submit_rollout", scored_after_its_node_is_lost)
    monkeypatch.setattr(trainer.learners, "train_step", fetched_after_its_node_is_lost)
    try:
        trainer.run()
        assert lost == {"reward": ["g2-s0", "g2-s0"], "learner": True}
        assert trainer.rewards.restarts == [0] and "retrying" not in caplog.text
        assert trainer.trajectory_losses == {"g2-s0": 1}
        assert caplog.text.count("sampling rollout request g2-s0 again (its trajectories were lost; 1 of 1") == 2
        assert [h["rollout/regenerated"] for h in trainer.history] == [0, 0, 2, 2]  # the run's total: both losses
        assert trainer.learners.restarts == 1 and "rewound to step 2 (no finished step is lost)" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def test_an_evaluation_requests_trajectories_lost_with_their_node_are_sampled_again_the_evaluation_unchanged(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """An evaluation request's trajectories are lost before the driver fetches them (the node that sampled them gone:
    simulated with an object whose owner was killed): the ObjectLostError stopped the run. The same request (seeds,
    version bound) is sampled again, and the evaluation equals an undisturbed one; a fourth loss stops the run."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS))
    try:
        undisturbed = trainer.evaluator.run(0, trainer.monitor)
        lost, collect, losses_left = lost_ref(), trainer.rollout.collect, [1]

        def collect_losing_eval_0():
            finished = collect()
            for future in finished:
                if future.request.request_id == "eval-0" and losses_left[0] > 0:
                    losses_left[0] -= 1
                    future.result = lambda: ray.get(lost)  # as PoolFuture.result meets a lost object
            return finished

        monkeypatch.setattr(trainer.rollout, "collect", collect_losing_eval_0)
        assert trainer.evaluator.run(0, trainer.monitor) == undisturbed
        assert losses_left == [0]
        assert "sampling evaluation request eval-0 again (its trajectories were lost: OwnerDiedError; 1 of 3" in caplog.text
        losses_left[0] = 4
        with pytest.raises(TrajectoriesLost, match="evaluation request eval-0 .* lost 4 times"):
            trainer.evaluator.run(0, trainer.monitor)
    finally:
        trainer.shutdown()


def test_deaths_during_the_rewinds_restore_restart_the_learners_again_and_replace_a_rollout_rank(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """A learner rank killed after step 3; a rank of the restarted group killed while it loads step 2's checkpoint,
    and as the next group loads it, a rollout rank. The group restarts again (the second death escaped the first
    restart and stopped the run, restarts left or not). The rollout rank is found dead only after the rewind asked the
    pool (on a lost node Ray marks the actors dead once the node's health checks fail): asking it to forget the newer
    versions raised its ActorDiedError out of the rewind and stopped the run; it is taken out of service and replaced.
    The run ends equal to an undisturbed one."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS))
    restore, restores = trainer.learners.restore, []

    def deaths_in_the_restores(ckpt, **kwargs):
        restores.append(ckpt.step)
        dying = trainer.learners.workers[0] if len(restores) == 1 else trainer.rollout.replicas[0].workers[0]
        if len(restores) <= 2:
            ray.kill(dying)
            wait_until_dead(dying)
        return restore(ckpt, **kwargs)

    monkeypatch.setattr(trainer.learners, "restore", deaths_in_the_restores)
    try:
        kill_after_steps(trainer, monkeypatch, {3: lambda: [trainer.learners.workers[0]]})
        trainer.run()
        assert trainer.learners.restarts == 2 and trainer.rollout.restarts == [1] and restores == [2, 2]
        assert caplog.text.count("rewinding from step 3 to") == 2
        assert "rewound to step 2 (step 3 is trained again)" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def test_a_learner_death_rewinds_within_the_runs_own_timeline(ray_session, tiny_model_dir, tmp_path, undisturbed,
                                                              monkeypatch, caplog):
    """Started from another run's step-2 checkpoint in a directory that holds an older step of its own (step 1): a
    learner killed after step 3, before this run's first save, rewinds to the step it started from, not to the
    directory's step 1 (which it used to pick, slicing its history with a negative index), and the run ends equal to
    the undisturbed one. The staging directory of shards a rank dying in a full fine-tuning save leaves is removed at
    the restart, not at the next start."""
    other = small_cfg(GRPO, tiny_model_dir, tmp_path / "other", *SYNCHRONOUS)
    reference.train(other, log=lambda *_: None)  # steps 2 and 4 saved
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", *SYNCHRONOUS)
    old = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", *SYNCHRONOUS, "trainer.total_steps=1")
    reference.train(old, log=lambda *_: None)  # the directory's own step 1
    cfg.trainer.resume = step_dir(checkpoint_root(other.trainer.run_dir), 2)
    trainer = Trainer(cfg)
    try:
        root = checkpoint_root(cfg.trainer.run_dir)
        died_saving = []
        kill_after_steps(trainer, monkeypatch, {3: lambda: died_saving.append(sharded_staging_dir(root, 4)) or
                                                [trainer.learners.workers[0]]})
        trainer.run()
        assert trainer.learners.restarts == 1
        assert "rewound to step 2 (step 3 is trained again)" in caplog.text
        assert died_saving and not os.path.exists(died_saving[0])
        assert f"removing {died_saving[0]}, left by a checkpoint save that did not finish" in caplog.text
        expected, adapters = undisturbed
        assert [h["reward/mean"] for h in trainer.history] == [r.reward_mean for r in expected[2:]]
        final = load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), STEPS)).adapters
        assert all(torch.equal(final[n][k], v) for n in adapters for k, v in adapters[n].items())
    finally:
        trainer.shutdown()


def test_a_learner_death_in_the_push_to_a_replaced_weight_sync_actor_rewinds(ray_session, tiny_model_dir, tmp_path,
                                                                             undisturbed, monkeypatch, caplog):
    """With no step in flight, a replaced weight-sync actor gets the current version from the top of the loop; a
    learner rank that dies in that push restarts and rewinds, as in any other push (it stopped the run)."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS))
    check = trainer._check_sync_failure

    def push_into_a_dead_learner(training_in_flight: bool) -> None:
        if trainer.version == 3 and not training_in_flight and not getattr(push_into_a_dead_learner, "done", False):
            push_into_a_dead_learner.done = True
            ray.kill(trainer.learners.workers[0])
            wait_until_dead(trainer.learners.workers[0])
            trainer._push_weights()  # what _replace_sync does after replacing the actor
        check(training_in_flight)

    monkeypatch.setattr(trainer, "_check_sync_failure", push_into_a_dead_learner)
    try:
        trainer.run()
        assert trainer.learners.restarts == 1
        assert "rewound to step 2 (step 3 is trained again)" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def hang_push_of(trainer: Trainer, version: int) -> None:
    """The weight-sync actor gets stuck inside the push of `version`: the call neither returns nor fails, and the actor
    lives on (its other calls answer)."""
    def hang(actor, version):  # defined here: Ray ships it by value to the actor's process
        import threading

        push = actor.source.push

        def hanging(wire):
            if wire.manifest.version == version:
                threading.Event().wait()
            return push(wire)
        actor.source.push = hanging

    ray.get(trainer.sync.actor.__ray_call__.remote(hang, version))


def after_step(trainer: Trainer, monkeypatch, step: int, action: Callable[[], None]) -> None:
    """Run `action()` once step `step` is done (logged, checkpointed); once, even if a rewind trains it again."""
    step_done, done = trainer._step_done, []

    def step_done_then_act(*args):
        step_done(*args)
        if trainer.version == step and not done:
            done.append(step)
            action()

    monkeypatch.setattr(trainer, "_step_done", step_done_then_act)


def test_a_weight_sync_actor_stuck_in_a_push_is_replaced_as_stalled_in_a_synchronous_run(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """Version 2's push is never taken: the driver's wait for it ends at the sync's deadline (it stopped the run with a
    TimeoutError), the actor is replaced as stalled and the version pushed again; the run equals an undisturbed one."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS, "rollout.collective_timeout_s=3"))
    try:
        after_step(trainer, monkeypatch, 1, lambda: hang_push_of(trainer, 2))
        trainer.run()
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 0
        assert "the weight-sync actor stalled (WeightSyncStalled: version 2 not taken" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def test_a_learner_rank_0_lost_before_the_weight_sync_actor_took_its_push_rewinds_with_no_sync_restart(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """Synchronous: learner rank 0 ends step 1 (its metrics in) and dies before the weight-sync actor took the push it
    owned (its node lost as the actor fetched it; simulated by a push never sent). The driver's wait for version 1
    ended at the sync's deadline and the actor was replaced as stalled (with sync.max_restarts=0 the run stopped) before
    the push to the replacement found the learners' death. The death is found first, as the rank dies, not at the
    sync's deadline (80 s here; 620 s by default), which the wait had to reach before it looked: the learners rewind."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS, "rollout.collective_timeout_s=30",
                                "sync.max_restarts=0"))
    assert trainer.sync.deadline_s == 80.0

    def push_nothing_at(worker, version):  # defined here: Ray ships it by value to the learner process
        push = worker.push_weights

        def unsent(sync_actor):
            if worker.backend.version == version:
                return {"version": version, "gather_s": 0.0, "push_s": 0.0}
            return push(sync_actor)
        worker.push_weights = unsent

    finish, dead = trainer._finish, []

    def rank_0_dies_after_step_1s_metrics(step, *args, **kwargs):
        if trainer.version == 0 and not dead:
            dead.append(trainer.learners.workers[0])
            trainer.learners.get(step.refs)
            ray.kill(dead[0])
            wait_until_dead(dead[0])
        finish(step, *args, **kwargs)

    ray.get(trainer.learners.workers[0].__ray_call__.remote(push_nothing_at, 1))
    monkeypatch.setattr(trainer, "_finish", rank_0_dies_after_step_1s_metrics)
    try:
        trainer.run()
        assert trainer.sync.restarts == 0 and trainer.learners.restarts == 1
        assert "rewound to step 0 (step 1 is trained again)" in caplog.text
        assert all(h["perf/step_s"] < 30 for h in trainer.history), trainer.history  # the rewound step 1's wait too
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def test_a_weight_sync_actor_stuck_in_a_push_is_replaced_as_stalled_not_blamed_on_the_learners(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Asynchronous: version 2's push is never taken, and learner rank 0 waited for it with no deadline as it pushed 3,
    blocking the learners' step until their watchdog stopped the run naming them (LearnerStalled). It waits the sync's
    timeout (rollout.collective_timeout_s) and reports the push not taken; the driver replaces the actor."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, *SYNC_STALLS_IN_3_S)
    trainer = Trainer(cfg)
    try:
        after_step(trainer, monkeypatch, 1, lambda: hang_push_of(trainer, 2))
        trainer.run()
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 0 and len(trainer.history) == 4
        assert "the weight-sync actor stalled (WeightSyncStalled: version 2 not taken from learner rank 0" in caplog.text
        assert [h["staleness/max"] <= 1 for h in trainer.history] == [True] * 4  # the rollouts followed the learners
    finally:
        trainer.shutdown()


def test_a_weight_sync_actor_that_dies_during_an_evaluation_is_replaced_during_it(ray_session, tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """Synchronous: the weight-sync actor dies as step 1's evaluation starts. The evaluation's loop replaces it and
    pushes the version again (nothing looked at the sync there: its `watch`, ready once the actor died, made every pass
    return at once, and the actor was replaced only after the evaluation)."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.eval_every=1", "logging.progress_bar=false",
                    "async.max_staleness=0", "trainer.save_every=0", "trainer.total_steps=2")
    trainer = Trainer(cfg)
    evaluate, serve, seen = trainer.evaluator.run, trainer._serve, {"serves": 0}

    def kill_then_evaluate(step, *args):
        if step == 1:
            ray.kill(trainer.sync.actor)
            wait_until_dead(trainer.sync.actor)
            seen["serves"] = 0
        scalars = evaluate(step, *args)
        if step == 1:
            seen["restarts"] = trainer.sync.restarts
        return scalars

    def counted_serve(*args, **kwargs):
        seen["serves"] += 1
        return serve(*args, **kwargs)

    monkeypatch.setattr(trainer.evaluator, "run", kill_then_evaluate)
    monkeypatch.setattr(trainer, "_serve", counted_serve)
    try:
        trainer.run()
        assert seen["restarts"] == 1 and trainer.sync.restarts == 1 and len(trainer.history) == 2
        assert seen["serves"] < 100, f"{seen['serves']} passes of the loop during the evaluation: it spun"
    finally:
        trainer.shutdown()


def test_a_learner_rank_lost_with_the_weight_sync_actor_in_the_evaluation_at_start_restarts_the_learners(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """One node lost as the evaluation before the first step starts: the weight-sync actor and learner rank 0 die. The
    evaluation replaces the actor, whose push finds the learners dead: that LearnerError came out of the run, which
    stopped with restarts left. The learners restart, the evaluation runs again, and the run equals an undisturbed
    one (an evaluation does not change the training)."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS, "trainer.eval_at_start=true")
    trainer = Trainer(cfg)
    evaluate, evaluated = trainer.evaluator.run, []

    def kill_then_evaluate(step, *args):
        if not evaluated:
            for actor in (trainer.learners.workers[0], trainer.sync.actor):
                ray.kill(actor)
                wait_until_dead(actor)
        evaluated.append(step)
        return evaluate(step, *args)

    monkeypatch.setattr(trainer.evaluator, "run", kill_then_evaluate)
    try:
        trainer.run()
        assert trainer.learners.restarts == 1 and trainer.sync.restarts >= 1 and evaluated[:2] == [0, 0]
        assert "rewinding from step 0 to the start" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()


def stop_sync_actor(trainer: Trainer, stopped: list[int]) -> None:
    """SIGSTOP the weight-sync actor's process (it neither answers nor dies), noting its pid in `stopped`."""
    stopped.append(ray.get(trainer.sync.actor.__ray_call__.remote(lambda actor: os.getpid())))
    os.kill(stopped[-1], signal.SIGSTOP)


def continue_stopped(stopped: list[int]) -> None:
    """SIGCONT the processes `stop_sync_actor` stopped: a replacement killed them, unless the test failed before it."""
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_stopped_weight_sync_actor_is_replaced_as_stalled_in_an_asynchronous_run(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Asynchronous: the weight-sync actor is stopped (SIGSTOP) after step 1: it neither answers nor dies. The driver
    asked it for the versions a broadcast lost with no deadline after every step, and the run hung there; it waits the
    sync's timeout (rollout.collective_timeout_s) and replaces the actor as stalled."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, *SYNC_STALLS_IN_3_S)
    trainer, stopped = Trainer(cfg), []
    try:
        after_step(trainer, monkeypatch, 1, lambda: stop_sync_actor(trainer, stopped))
        trainer.run()
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 0 and len(trainer.history) == 4
        assert "the weight-sync actor stalled" in caplog.text
        assert [h["staleness/max"] <= 1 for h in trainer.history] == [True] * 4
    finally:
        continue_stopped(stopped)
        trainer.shutdown()


def test_an_evaluation_waiting_for_a_version_never_staged_replaces_the_weight_sync_actor_not_a_rollout_replica(
        ray_session, tiny_model_dir, tmp_path, caplog):
    """Asynchronous: the weight-sync actor is stuck in the push of version 2 (it answers for the versions a broadcast
    lost), and step 2 evaluates: its requests wait on the rollout ranks for version 2, which nothing waited for but the
    rollout watchdog (rollout.stall_timeout_s), which replaced the rollout replica as stalled, again and again. The
    driver waits for the broadcast before the evaluation, within the sync's deadline, and replaces the weight-sync
    actor as stalled."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, *SYNC_STALLS_IN_3_S, "trainer.total_steps=2",
                    "trainer.eval_every=2", "rollout.stall_timeout_s=30")
    trainer = Trainer(cfg)
    try:
        hang_push_of(trainer, 2)
        trainer.run()
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 0 and len(trainer.history) == 2
        assert "the weight-sync actor stalled (WeightSyncStalled: version 2 not taken" in caplog.text
        assert trainer.rollout.restarts == [0], "the rollout replica waiting for version 2 was replaced as stalled"
    finally:
        trainer.shutdown()


def test_a_weight_sync_actor_stopped_as_a_rollout_replica_dies_is_replaced_as_stalled(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Asynchronous: after step 1 the weight-sync actor is stopped (SIGSTOP) and a rollout rank dies. The pool re-forms
    the sync group without the dead replica (`connect`), and the stopped actor's settle for it went unanswered: a bare
    TimeoutError out of the pool stopped the run. `connect` marks the actor stalled instead, the driver replaces it as
    stalled on sync.max_restarts (the replacement connects the live replicas) and pushes the version again."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, *SYNC_STALLS_IN_3_S)
    trainer, stopped = Trainer(cfg), []

    def stop_sync_actor_and_kill_a_rollout_rank():
        stop_sync_actor(trainer, stopped)
        rank = trainer.rollout.replicas[0].workers[0]
        ray.kill(rank)
        wait_until_dead(rank)
        # What the pool does as it finds the death (a failed request in `collect`), here before the learners' next push
        # to the stopped actor could have it replaced first.
        trainer.rollout.take_out_dead()

    try:
        after_step(trainer, monkeypatch, 1, stop_sync_actor_and_kill_a_rollout_rank)
        trainer.run()
        assert "not formed: the actor did not settle" in caplog.text
        assert trainer.sync.restarts == 1 and trainer.learners.restarts == 0 and len(trainer.history) == 4
        assert "the weight-sync actor stalled (WeightSyncStalled: weight-sync group" in caplog.text
        assert trainer.rollout.restarts == [1]
        assert [h["staleness/max"] <= 1 for h in trainer.history] == [True] * 4
    finally:
        continue_stopped(stopped)
        trainer.shutdown()


def test_a_learner_death_releases_the_rollouts_waiting_for_a_version_the_rewind_voids(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Asynchronous: version 3 is pushed but never broadcast (the weight-sync actor is stuck in its push), the requests
    admitted after step 3 wait for it, and a learner rank dies in step 4. The rewind to step 2 voids version 3, and the
    new timeline reaches it only by training on requests queued behind those waiting: dropping them waited out the
    rollout watchdog's deadline, and the replica, still waiting, was replaced as stalled. They fail at once instead."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, "trainer.save_every=2", "trainer.total_steps=4",
                    "learner.max_restarts=1", "rollout.stall_timeout_s=60")
    trainer = Trainer(cfg)
    try:
        after_step(trainer, monkeypatch, 2, lambda: hang_push_of(trainer, 3))
        kill_after_steps(trainer, monkeypatch, {3: lambda: [trainer.learners.workers[0]]})
        drop_in_flight, dropping_s = trainer._drop_in_flight, []

        def timed_drop():
            start = time.monotonic()
            drop_in_flight()
            dropping_s.append(time.monotonic() - start)

        monkeypatch.setattr(trainer, "_drop_in_flight", timed_drop)
        trainer.run()
        assert trainer.learners.restarts == 1 and len(trainer.history) == 4
        assert "rewound to step 2" in caplog.text
        assert len(dropping_s) == 1 and dropping_s[0] < 30.0, f"dropping the requests in flight took {dropping_s}"
        assert trainer.rollout.restarts == [0], "a replica waiting for the voided version was replaced as stalled"
    finally:
        trainer.shutdown()


def test_a_learner_death_in_the_save_at_the_time_limit_trains_the_dropped_steps_again_and_checkpoints(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """trainer.time_limit_s passes during step 1 (of 50, no checkpoint before), and a learner rank dies in the save the
    run stops with. The rewind to the start found the run out of time and ended it there: 0 steps, no checkpoint, no
    error (the launcher printed "done"). Step 1 is trained again, and checkpointed, as an undisturbed run's."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS, "trainer.total_steps=50", "trainer.save_every=0",
                    "trainer.time_limit_s=0.001")
    trainer = Trainer(cfg)
    try:
        kill_in_save(trainer, monkeypatch, 1, lambda: [trainer.learners.workers[0]])
        trainer.run()
        assert trainer.learners.restarts == 1 and "rewound to step 0 (step 1 is trained again)" in caplog.text
        expected, _ = undisturbed
        assert [h["reward/mean"] for h in trainer.history] == [expected[0].reward_mean]
        assert load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), 1)).version == 1
    finally:
        trainer.shutdown()


def limit_passes_in_the_broadcast_of(trainer: Trainer, monkeypatch, step: int) -> None:
    """Synchronous: trainer.time_limit_s passes in step `step`'s weight broadcast, after the next step's batch went to
    the rollout (`next_batch_committed`): the run is to train that batch and stop there."""
    wait_synced, passed = trainer._wait_synced, []

    def passing_in_the_broadcast():
        waited = wait_synced()
        if trainer.version == step and not passed:
            passed.append(trainer.train_s)
            trainer.cfg.trainer.time_limit_s = trainer.train_s  # out of time from here on
        return waited

    monkeypatch.setattr(trainer, "_wait_synced", passing_in_the_broadcast)


def assert_rewound_to_step_2_and_stopped_at_step_3(trainer: Trainer, undisturbed, log: str) -> None:
    """One learner restart, the rewind to step 2's checkpoint, and step 3 trained as an undisturbed run's and saved."""
    assert trainer.learners.restarts == 1 and "rewound to step 2 (no finished step is lost)" in log
    expected, _ = undisturbed
    assert [h["reward/mean"] for h in trainer.history] == [r.reward_mean for r in expected[:3]]
    assert load_checkpoint(step_dir(checkpoint_root(trainer.cfg.trainer.run_dir), 3)).version == 3


def test_a_learner_death_in_the_batch_committed_as_the_time_limit_passed_trains_that_batch_again(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """Synchronous: trainer.time_limit_s passes in step 2's broadcast (a save step), after step 3's batch went to the
    rollout, so the run trains step 3 and stops there; a learner rank dies in step 3. The rewind to step 2 counted only
    the steps done: the run ended at step 2, one step short, without the evaluation and checkpoint it stops with. Now it
    trains step 3 again and stops there, as an undisturbed run does."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS)
    trainer = Trainer(cfg)
    limit_passes_in_the_broadcast_of(trainer, monkeypatch, 2)
    try:
        kill_after_steps(trainer, monkeypatch, {2: lambda: [trainer.learners.workers[0]]})
        trainer.run()
        assert_rewound_to_step_2_and_stopped_at_step_3(trainer, undisturbed, caplog.text)
    finally:
        trainer.shutdown()


def test_a_learner_rank_lost_with_the_weight_sync_actor_after_the_batch_committed_at_the_time_limit_trains_it(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog):
    """Synchronous: trainer.time_limit_s passes in step 2's broadcast, after step 3's batch went to the rollout; then
    one node is lost with learner rank 0 and the weight-sync actor. The top of the loop replaces the actor, and the push
    to it finds the learners dead, before step 3's batch is formed. That rewind did not count the committed batch: the
    run ended at step 2, one step short, without the evaluation and checkpoint it stops with (as a death in step 3 did
    before it was fixed). It trains step 3 again and stops there, as an undisturbed run does."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS)
    trainer = Trainer(cfg)
    limit_passes_in_the_broadcast_of(trainer, monkeypatch, 2)

    def lose_the_node():
        assert trainer.next_batch_committed
        for actor in (trainer.learners.workers[0], trainer.sync.actor):
            ray.kill(actor)
            wait_until_dead(actor)
        assert trainer.sync.failure(timeout_s=30) is not None  # seen at the top of the loop, before step 3's batch

    try:
        after_step(trainer, monkeypatch, 2, lose_the_node)
        trainer.run()
        assert_rewound_to_step_2_and_stopped_at_step_3(trainer, undisturbed, caplog.text)
    finally:
        trainer.shutdown()


def test_an_asynchronous_run_retraining_up_to_the_step_it_was_stopping_at_queues_no_step_behind_that_one(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Asynchronous: trainer.time_limit_s passes as step 3 is handed to the learners (none queued behind it), and a
    learner rank dies in it: the run was stopping at step 3. The rewind to step 2 trains step 3 again; it queued step 4
    behind it (step 3 is neither a save nor an evaluation step), so the run trained a step past the one it was stopping
    at, and step 3, where an undisturbed run stops, got no checkpoint."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *ASYNCHRONOUS, "trainer.save_every=2", "trainer.total_steps=6")
    trainer = Trainer(cfg)
    try:
        slow_learners(trainer, 1.0)  # rollout outpaces training: a batch is ready to queue behind the step in flight
        train, killed = trainer._train, []

        def train_then_die_out_of_time(batch, version):
            step = train(batch, version)
            if version == 2 and not killed:  # step 3, with no step queued behind it (step 2 saved)
                trainer.cfg.trainer.time_limit_s = trainer.train_s  # out of time from here on
                killed.append(trainer.learners.workers[0])
                ray.kill(killed[0])
                wait_until_dead(killed[0])
            return step

        monkeypatch.setattr(trainer, "_train", train_then_die_out_of_time)
        trainer.run()
        assert trainer.learners.restarts == 1 and "rewound to step 2 (no finished step is lost)" in caplog.text
        assert len(trainer.history) == 3
        assert load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), 3)).version == 3
    finally:
        trainer.shutdown()


def test_a_learner_rank_stopped_in_the_rewinds_restore_stops_the_run_at_the_learners_deadline(
        ray_session, tiny_model_dir, tmp_path, monkeypatch):
    """A learner rank killed after step 3, and a rank of the restarted group stopped (SIGSTOP: it neither answers nor
    dies) as it loads step 2's checkpoint. The driver waited for the restore with no deadline: the run hung, silent.
    The learners' deadline applies to what the driver asks of them outside a step too: the run stops loudly, naming
    the rank, as a train step that misses it does."""
    trainer = Trainer(small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS, "learner.stall_timeout_s=5"))
    restore, stopped, raised = trainer.learners.restore, [], []

    def stopped_in_the_restore(ckpt, **kwargs):
        if not stopped:
            stopped.append(ray.get(trainer.learners.workers[0].__ray_call__.remote(lambda worker: os.getpid())))
            os.kill(stopped[0], signal.SIGSTOP)
        return restore(ckpt, **kwargs)

    def run():
        try:
            trainer.run()
        except BaseException as e:  # noqa: BLE001 (looked at below)
            raised.append(e)

    monkeypatch.setattr(trainer.learners, "restore", stopped_in_the_restore)
    thread = threading.Thread(target=run, daemon=True)
    try:
        kill_after_steps(trainer, monkeypatch, {3: lambda: [trainer.learners.workers[0]]})
        thread.start()
        thread.join(60.0)
        assert not thread.is_alive(), "the driver still waits for the stopped learner rank's restore"
        assert stopped and isinstance(raised[0], LearnerStalled), raised
        assert re.search(r"learner rank 0 of 1 .*neither finished nor died", str(raised[0]))
    finally:
        continue_stopped(stopped)
        thread.join(120.0)
        trainer.shutdown()


@pytest.mark.parametrize("found_first", ["by_the_pool", "by_the_driver"])
def test_a_weight_sync_actor_and_a_rollout_rank_lost_together_are_both_replaced(
        ray_session, tiny_model_dir, tmp_path, undisturbed, monkeypatch, caplog, found_first):
    """One node lost after step 1: the weight-sync actor and the rollout rank die together. Found first by the pool (a
    request failed), the re-formed sync group asked the dead actor to settle, and its ActorDiedError stopped the run;
    found first by the driver (the actor's death), the replacement's group waited for the dead rank to join until the
    collective timeout (300 s by default), and the run stopped. Both are replaced; the run equals an undisturbed one."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, *SYNCHRONOUS, "rollout.collective_timeout_s=3")
    trainer = Trainer(cfg)

    def lose_the_node():
        actors = [trainer.sync.actor, trainer.rollout.replicas[0].workers[0]]
        for actor in actors:
            ray.kill(actor)
        for actor in actors:
            wait_until_dead(actor)
        if found_first == "by_the_pool":
            trainer.rollout.take_out_dead()  # what the pool does as a request of the dead rank fails (`collect`)

    try:
        after_step(trainer, monkeypatch, 1, lose_the_node)
        trainer.run()
        assert trainer.sync.restarts == 1 and trainer.rollout.restarts == [1]
        assert "the weight-sync actor died" in caplog.text
        assert_equal_to_undisturbed(trainer, undisturbed)
    finally:
        trainer.shutdown()
