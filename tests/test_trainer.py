"""The driver's Trainer on the session's local Ray: synchronous mode equals the single-process reference
trainer bit for bit; a resumed run continues exactly; asynchronous mode stays within its staleness bound."""

import os
import shutil
import time

import pytest
import torch

from rayflow import reference
from rayflow.checkpoint import checkpoint_root, load_checkpoint, step_dir
from rayflow.driver.trainer import Trainer
from rayflow.paths import recipe as recipe_path
from tiny_run import GRPO, NFT, final_adapters, slow_learners, slow_rollouts, small_cfg, wait_until_dead

STEPS = 3


def run_trainer(cfg):
    trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.shutdown()


MINIBATCHES = ("algorithm.num_inner_epochs=2", "algorithm.num_minibatches=2")
# A random 2-step window per version; every group's samples start from one initial noise.
WINDOW = ("sampling.sde_window_size=2", "sampling.sde_window_range=[0,3]", "sampling.same_initial_noise=true")
EMA = ("trainer.ema_decay=0.9", "trainer.ema_every=2")  # the "ema" adapter is compared and resumed with the others
EVAL = (f"trainer.eval_every={STEPS}",)  # the last step evaluates (under the "ema" adapter, on the rollout ranks)
# Every transformer weight trained and synced; "old", "ema" and the KL's frozen base are whole-weight copies, and the
# checkpoints (compared, resumed) are sharded; the learner recomputes each block in the backward (the reference does not).
FULL = ("learner.train_mode=full", "sync.mode=merged", "sync.verify_checksum=true", "algorithm.kl_beta=0.01",
        "learner.activation_checkpointing=true")  # recomputed blocks give the same gradients, bit for bit


@pytest.mark.parametrize("recipe, extra", [(GRPO, ()), (NFT, ()), (GRPO, MINIBATCHES + WINDOW + EMA + EVAL), (NFT, MINIBATCHES + EMA),
                                           (NFT, FULL + EMA)],
                         ids=["flow_grpo", "nft", "flow_grpo-minibatches-window-ema", "nft-minibatches-ema", "nft-full-kl-ema"])
def test_synchronous_run_equals_the_reference_trainer_and_resumes_exactly(ray_session, tiny_model_dir, tmp_path, recipe, extra):
    overrides = [f"trainer.total_steps={STEPS}", "trainer.save_every=1", "trainer.keep_checkpoints=3", "trainer.eval_every=0",
                 "logging.progress_bar=false", "async.max_staleness=0", *extra]
    cfg = small_cfg(recipe, tiny_model_dir, tmp_path / "distributed", *overrides)
    history = run_trainer(cfg)

    ref_cfg = small_cfg(recipe, tiny_model_dir, tmp_path / "reference", *overrides)
    model, ref_history = reference.train(ref_cfg, log=lambda *_: None)
    assert [h["reward/mean"] for h in history] == [r.reward_mean for r in ref_history]
    assert [h["reward/std"] for h in history] == [r.reward_std for r in ref_history]
    assert [h["loss/policy"] for h in history] == [r.metrics["loss/policy"] for r in ref_history]
    assert [h["train/grad_norm"] for h in history] == [r.grad_norm for r in ref_history]
    assert [h["train/approx_kl"] for h in history] == [r.metrics.get("train/approx_kl", 0.0) for r in ref_history]
    assert [h["train/clip_frac"] for h in history] == [r.metrics.get("train/clip_frac", 0.0) for r in ref_history]
    assert [h["train/filtered_samples"] for h in history] == [r.metrics["train/filtered_samples"] for r in ref_history]
    if recipe == GRPO:
        # One step per batch trains on-policy (ratio exactly 1); later mini-batches train off-policy.
        assert all(h["train/approx_kl"] > 0 and h["train/clip_frac"] > 0 for h in history) == bool(extra)
    assert all(h["staleness/max"] == 0 and h["rollout/partial_ratio"] == 0 for h in history)
    # The learners trained on trajectories they fetched while the batch rolled out (learner.prefetch), exactly.
    assert any(h["perf/prefetched"] > 0 for h in history) and all(0 <= h["perf/prefetched"] <= 1 for h in history)
    distributed = final_adapters(cfg.trainer.run_dir, STEPS)
    expected = final_adapters(ref_cfg.trainer.run_dir, STEPS)
    assert distributed.keys() == expected.keys()
    for name in expected:
        for key, value in expected[name].items():
            assert torch.equal(distributed[name][key], value), f"{name}/{key} differs from the reference"

    if not extra:
        return  # resume is checked on the variants below, whose checkpoints hold the most state (EMA, mini-batch order)
    # Resume from step 1's checkpoint in a fresh directory: steps 2 and 3 come out the same.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(step_dir(checkpoint_root(cfg.trainer.run_dir), 1), step_dir(checkpoint_root(str(resumed_dir)), 1))
    resumed = run_trainer(small_cfg(recipe, tiny_model_dir, resumed_dir, *overrides))
    assert [h["reward/mean"] for h in resumed] == [h["reward/mean"] for h in history[1:]]
    assert [h["loss/policy"] for h in resumed] == [h["loss/policy"] for h in history[1:]]
    again = final_adapters(str(resumed_dir), STEPS)
    assert all(torch.equal(again[n][k], v) for n in distributed for k, v in distributed[n].items())
    # The reference trainer resumes it too: the groups the distributed run drew before saving (the checkpoint's
    # pending_groups) come first, and steps 2 and 3 are the same (it skipped them, training group 2 at step 2).
    by_reference = tmp_path / "resumed-by-reference"
    shutil.copytree(step_dir(checkpoint_root(cfg.trainer.run_dir), 1), step_dir(checkpoint_root(str(by_reference)), 1))
    _, ref_resumed = reference.train(small_cfg(recipe, tiny_model_dir, by_reference, *overrides), log=lambda *_: None)
    assert [r.reward_mean for r in ref_resumed] == [h["reward/mean"] for h in history[1:]]
    assert [r.metrics["loss/policy"] for r in ref_resumed] == [h["loss/policy"] for h in history[1:]]


def test_a_resumed_run_goes_on_from_its_checkpoints_regenerated_dropped_and_restart_totals(ray_session, tiny_model_dir,
                                                                                          tmp_path):
    """rollout/regenerated, rollout/dropped and rollout/replica_restarts are the run's totals: the checkpoint keeps
    them (a resumed run counted from 0; replica restarts did, until they joined the checkpoint's counters)."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "trainer.total_steps=1", "trainer.save_every=1",
                    "trainer.eval_every=0", "logging.progress_bar=false", "async.max_staleness=1")
    first = Trainer(cfg)
    try:
        first.queue.stats.regenerated, first.queue.stats.dropped = 5, 2  # as if groups had gone stale
        first.rollout.restarts = [3]  # as if its replica had been replaced 3 times
        first.run()
    finally:
        first.shutdown()
    cfg.trainer.total_steps = 2
    resumed = Trainer(cfg)
    try:
        assert resumed.version == 1 and (resumed.queue.stats.regenerated, resumed.queue.stats.dropped) == (5, 2)
        (step_2,) = resumed.run()
        assert step_2["rollout/regenerated"] >= 5 and step_2["rollout/dropped"] >= 2
        assert resumed.rollout.restarts == [0] and step_2["rollout/replica_restarts"] == 3
    finally:
        resumed.shutdown()


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_each_family_trains_synchronously_equal_to_the_reference_trainer(ray_session, tiny_twin, tmp_path, family):
    """SD3 (two-branch CFG replayed) and FLUX.1 (embedded guidance replayed) through the whole distributed
    loop with LoRA weight sync (merged mode rounds differently from a LoRA forward, so it is checked
    weight by weight in test_sync.py)."""
    recipe = recipe_path(f"flowgrpo_{family}.yaml")
    overrides = ["trainer.total_steps=2", "trainer.eval_every=0", "logging.progress_bar=false",
                 "async.max_staleness=0", "sync.verify_checksum=true"]
    history = run_trainer(small_cfg(recipe, tiny_twin(family), tmp_path / "distributed", *overrides))
    ref_cfg = small_cfg(recipe, tiny_twin(family), tmp_path / "reference", *overrides)
    _, ref_history = reference.train(ref_cfg, log=lambda *_: None)
    assert [h["reward/mean"] for h in history] == [r.reward_mean for r in ref_history]
    assert [h["loss/policy"] for h in history] == [r.metrics["loss/policy"] for r in ref_history]
    assert [h["train/grad_norm"] for h in history] == [r.grad_norm for r in ref_history]
    assert history[-1]["train/grad_norm"] > 0
    distributed = final_adapters(str(tmp_path / "distributed"), 2)
    expected = final_adapters(ref_cfg.trainer.run_dir, 2)
    assert all(torch.equal(distributed[n][k], v) for n in expected for k, v in expected[n].items())


def live_placement_groups() -> dict[str, str]:
    """{id: name} of the placement groups not removed."""
    from ray.util import placement_group_table

    return {pg_id: t["name"] for pg_id, t in placement_group_table().items() if t["state"] != "REMOVED"}


@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_every_roles_placement_is_asked_for_before_any_is_waited_for_and_none_outlives_a_failed_start(
        ray_session, tiny_model_dir, tmp_path, monkeypatch, placement):
    """So that an autoscaler starts every node the run needs together (tests/test_cluster.py shows the autoscaler
    seeing both node types' demand in one status report)."""
    from rayflow.distributed.colocated import ColocatedDevices
    from rayflow.distributed.placement import Reservation
    from rayflow.rollout.pool import RolloutPool

    before = live_placement_groups()
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "trainer.total_steps=1", "logging.progress_bar=false",
                    f"placement.mode={placement}")
    if placement == "colocated":
        names, refused_start = {"rayflow-rewards", "rayflow-devices"}, (ColocatedDevices, "__init__")
    else:
        names, refused_start = {"rollout-0", "rayflow-rewards", "rayflow-weight-sync", "rayflow-learner"}, (RolloutPool, "start")

    def refuse(*args, **kwargs):
        raise RuntimeError("no rollout today")

    # A start that fails part way (the reward workers started, no other role yet) leaves none of the placements
    # reserved: the reward pool removes the one it took, the Trainer those no role took.
    with monkeypatch.context() as patch:
        patch.setattr(*refused_start, refuse)
        with pytest.raises(RuntimeError, match="no rollout today"):
            Trainer(cfg)
    assert live_placement_groups() == before

    live_at_first_wait = []
    wait = Reservation.wait

    def recording_wait(self, timeout_s: float = 600.0):
        if not live_at_first_wait:
            live_at_first_wait.append(set(live_placement_groups().values()) - set(before.values()))
        return wait(self, timeout_s)

    monkeypatch.setattr(Reservation, "wait", recording_wait)
    trainer = Trainer(cfg)
    trainer.shutdown()
    assert live_at_first_wait == [names]
    assert live_placement_groups() == before


def test_asynchronous_run_stays_within_the_bound_and_queues_the_next_batch_except_before_eval_and_checkpoints(
        ray_session, tiny_model_dir, tmp_path):
    """With a learner slower than rollout, the next batch is sampled while the learner trains (every request under
    the newest version), and goes to the learners as soon as it is complete (trained at the next version, within the bound at that version), except
    behind a step that checkpoints (2), evaluates (3) or ends the run (4): those must find the learners at their
    own version."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=4", "trainer.eval_every=3", "trainer.save_every=2",
                    "logging.progress_bar=false", "async.max_staleness=1", "algorithm.prompts_per_step=2")
    trainer = Trainer(cfg)
    try:
        slow_learners(trainer, 1.0)
        handed = []  # (driver version when handed to the learners, version it is trained at)
        train = trainer._train
        trainer._train = lambda batch, version: handed.append((trainer.version, version)) or train(batch, version)
        submitted = []  # (driver version, min_version) of the training requests (evaluation's pass their weights)
        submit = trainer.rollout.submit

        def recording_submit(request, *evaluation):
            if not evaluation:
                submitted.append((trainer.version, request.min_version))
            return submit(request, *evaluation)
        trainer.rollout.submit = recording_submit
        history = trainer.run()
    finally:
        trainer.shutdown()
    assert [v for v, _ in handed] == [0, 0, 2, 3] and [v for _, v in handed] == [0, 1, 2, 3]
    assert all(h["staleness/max"] <= 1 for h in history)
    assert any(h["staleness/mean"] > 0 for h in history[1:])  # sampled one version behind the one trained
    # Every request starts under the driver's newest version, never under an older one it would be resampled for.
    assert submitted and all(version == min_version for version, min_version in submitted)
    assert history[-1]["rollout/regenerated"] == 0
    assert all(0 <= h["perf/learner_idle"] <= 1 and 0 <= h["perf/rollout_idle"] <= 1 for h in history)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(cfg.trainer.logdir))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(cfg.trainer.logdir, size_guidance={"scalars": 0})
    events.Reload()
    # eval_every=3 of 4 steps: step 3, and the last, whose policy is the run's result (it was left unevaluated)
    assert [e.step for e in events.Scalars("eval/reward_mean")] == [3, 4]
    root = checkpoint_root(cfg.trainer.run_dir)
    assert [load_checkpoint(step_dir(root, s)).version for s in (2, 4)] == [2, 4]


def test_time_limit_with_a_step_queued_stops_after_that_step_and_checkpoints_it(
        ray_session, tiny_model_dir, tmp_path):
    """Out of time after step 1 while step 2 is queued behind it: step 2 is trained, not lost, and the run ends there."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=50", "trainer.eval_every=0",
                    "trainer.save_every=25", "trainer.time_limit_s=0.5", "logging.progress_bar=false",
                    "async.max_staleness=1", "algorithm.prompts_per_step=2")
    trainer = Trainer(cfg)
    try:
        slow_learners(trainer, 1.0)
        history = trainer.run()
    finally:
        trainer.shutdown()
    assert len(history) == 2 and history[0]["perf/train_s"] >= 0.5
    assert load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), 2)).version == 2


def test_time_limit_stops_after_the_step_that_passes_it_evaluating_and_checkpointing_there(ray_session, tiny_model_dir, tmp_path):
    """A limit far below one step's time: the run ends after step 1 of 50, and evaluates and checkpoints there
    although neither eval_every nor save_every falls on step 1."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=50", "trainer.eval_every=25",
                    "trainer.save_every=25", "trainer.time_limit_s=0.001", "logging.progress_bar=false")
    history = run_trainer(cfg)
    assert len(history) == 1
    assert history[0]["perf/train_s"] == history[0]["perf/step_s"] >= 0.001
    assert load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), 1)).version == 1
    events = EventAccumulator(cfg.trainer.logdir)
    events.Reload()
    assert [e.step for e in events.Scalars("eval/reward_mean")] == [1]


def test_a_synchronous_batch_submitted_before_the_limit_passes_in_the_broadcast_is_trained(ray_session, tiny_model_dir,
                                                                                          tmp_path):
    """Synchronous mode submits the next batch before the step's weight broadcast, while in time. When
    trainer.time_limit_s passed during the broadcast, the run stopped after that step anyway: the batch rolled out for
    nothing, and the final evaluation's requests queued behind it. It is trained, and the run stops after it,
    evaluating and checkpointing there."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=50", "trainer.eval_every=25",
                    "trainer.save_every=25", "logging.progress_bar=false", "async.max_staleness=0")
    trainer = Trainer(cfg)
    try:
        wait_synced = trainer._wait_synced

        def limit_passes_during_the_broadcast() -> float:
            if trainer.version == 1:  # step 2's batch has just been submitted, in time
                trainer.cfg.trainer.time_limit_s = 1e-3
            return wait_synced()
        trainer._wait_synced = limit_passes_during_the_broadcast
        submitted = []  # the training requests (evaluation's pass their weights)
        submit = trainer.rollout.submit

        def recording_submit(request, *evaluation):
            if not evaluation:
                submitted.append(request.request_id)
            return submit(request, *evaluation)
        trainer.rollout.submit = recording_submit
        history = trainer.run()
    finally:
        trainer.shutdown()
    assert len(history) == 2 and submitted == ["g0-s0", "g1-s0"]  # every batch rolled out was trained
    assert load_checkpoint(step_dir(checkpoint_root(cfg.trainer.run_dir), 2)).version == 2
    events = EventAccumulator(cfg.trainer.logdir)
    events.Reload()
    assert [e.step for e in events.Scalars("eval/reward_mean")] == [2]


def test_a_checkpoint_saves_time_counts_in_the_next_steps_wall_time(ray_session, tiny_model_dir, tmp_path):
    """perf/step_s leaves out evaluation, not a checkpoint save: the next batch rolls out during the save (a synchronous
    run submits it before the step's broadcast, which comes before the save; asynchronous requests are in flight), so
    the save's time cannot be taken out of a step without that rollout's. It is in the next step's perf/step_s, and
    in perf/train_s (trainer.time_limit_s)."""
    save_s = 3.0
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=2", "trainer.eval_every=0",
                    "trainer.save_every=1", "logging.progress_bar=false", "async.max_staleness=0")
    trainer = Trainer(cfg)
    try:
        events = []  # (what, driver version)
        save, submit = trainer._save, trainer.rollout.submit

        def slow_save() -> None:
            events.append(("save", trainer.version))
            save()
            if trainer.version == 1:
                time.sleep(save_s)
        trainer._save = slow_save
        trainer.rollout.submit = lambda request, *rest: events.append(("submit", trainer.version)) or submit(request, *rest)
        history = trainer.run()
    finally:
        trainer.shutdown()
    assert events == [("submit", 0), ("submit", 1), ("save", 1), ("save", 2)]  # step 2's batch rolled out in the save
    assert history[1]["perf/step_s"] >= save_s and history[1]["perf/train_s"] >= save_s


def test_a_synchronous_step_after_an_evaluation_times_its_own_rollout(ray_session, tiny_model_dir, tmp_path):
    """perf/step_s is the step's wall time, evaluation excluded. A synchronous run submitted the next batch before it
    evaluated, so that batch rolled out behind the evaluation's requests, inside the excluded time: the step after
    every evaluation showed (and perf/train_s and trainer.time_limit_s counted) its training alone."""
    rollout_s = 1.5  # a step's training alone takes 0.1-0.5 s here: a step timed without its rollout fails
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=3", "trainer.eval_every=1",
                    "trainer.save_every=0", "logging.progress_bar=false", "async.max_staleness=0")
    trainer = Trainer(cfg)
    try:
        slow_rollouts(trainer, rollout_s)
        history = trainer.run()
    finally:
        trainer.shutdown()
    assert [h["perf/step_s"] >= rollout_s for h in history] == [True, True, True]
    assert history[-1]["perf/train_s"] >= 3 * rollout_s


# A synchronous run whose only replica is replaced stays equal to the reference: test_faults.py's chaos test.
@pytest.mark.parametrize("max_restarts, max_staleness", [(0, 0), (1, 1)])
def test_a_dead_rollout_replica_is_replaced_or_routed_around(ray_session, tiny_model_dir, tmp_path, max_restarts,
                                                             max_staleness):
    import ray

    overrides = ["trainer.eval_every=0", "logging.progress_bar=false", "rollout.num_replicas=2",
                 "rollout.micro_batch_size=2", f"rollout.max_restarts={max_restarts}", f"async.max_staleness={max_staleness}"]
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "distributed", "trainer.total_steps=1", *overrides)
    trainer = Trainer(cfg)
    try:
        trainer.run()
        dead = trainer.rollout.replicas[1]
        if max_staleness == 0:  # an evaluation meets the dead replica: its request goes to the other, same samples
            served = dead.timings()[0]["requests"]
            undisturbed = trainer._generate(trainer.evaluator.requests)
            assert dead.timings()[0]["requests"] > served  # both replicas sample evaluation requests
            ray.kill(dead.workers[0])
            again = trainer._generate(trainer.evaluator.requests)
            assert trainer.rollout.dead == [dead] and [t.seed for t in again] == [t.seed for t in undisturbed]
            assert all(torch.equal(a.latents, b.latents) and (a.image == b.image).all() for a, b in zip(again, undisturbed))
        else:  # asynchronous: with requests of the next batch in flight on it
            # No broadcast in flight may meet the rank while it dies: a receiver dying but not yet dead holds the send
            # until the collective timeout, 300 s (test_sync.py), which fits this test's one 368-s run in a suite.
            trainer.sync.wait(trainer.version, timeout_s=60)
            ray.kill(dead.workers[0])
            wait_until_dead(dead.workers[0])
        history, deadline = [], time.monotonic() + 180
        # Until the replacement (if any) finished loading, the live replica samples every request.
        while time.monotonic() < deadline and (len(history) < 2 or trainer.rollout.starting or trainer.rollout.placing):
            trainer.cfg.trainer.total_steps += 1
            history += trainer.run()[-1:]
        assert trainer.rollout.dead == [dead] and not dead.alive
        # The staleness bound held throughout (synchronous: every batch under the newest weights).
        assert all(h["staleness/max"] <= max_staleness for h in history)
        assert history[-1]["rollout/replica_restarts"] == max_restarts
        if max_restarts == 0:
            assert trainer.rollout.replicas[1] is dead and trainer.rollout.restarts == [0, 0]
        else:
            replacement = trainer.rollout.replicas[1]
            assert replacement is not dead and replacement.alive and trainer.rollout.restarts == [0, 1]
            # The replacement serves, within the staleness bound.
            before = replacement.timings()[0]["requests"]
            trainer.cfg.trainer.total_steps += 2
            assert all(h["staleness/max"] <= max_staleness for h in trainer.run()[-2:])
            assert replacement.timings()[0]["requests"] > before
            if max_staleness == 0:  # it holds the same weights as its peer, bit for bit
                ours, peer = replacement.adapter_weights()[0], trainer.rollout.replicas[0].adapter_weights()[0]
                assert ours.keys() == peer.keys() and all(torch.equal(ours[n], t) for n, t in peer.items())
    finally:
        trainer.shutdown()
    if max_staleness == 0:
        # Synchronous: step for step the reference trainer's numbers, the death and the replacement notwithstanding.
        ref_cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "reference", f"trainer.total_steps={trainer.version}", *overrides)
        _, ref_history = reference.train(ref_cfg, log=lambda *_: None)
        assert [h["reward/mean"] for h in trainer.history] == [r.reward_mean for r in ref_history]
        assert [h["loss/policy"] for h in trainer.history] == [r.metrics["loss/policy"] for r in ref_history]
        assert [h["train/grad_norm"] for h in trainer.history] == [r.grad_norm for r in ref_history]
