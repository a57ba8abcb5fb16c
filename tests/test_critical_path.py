"""tools/critical_path.py: a synchronous step's chain read off Ray's task events, which `bench.py pipeline` reports."""

import math
import time

import pytest

from rayflow.driver.trainer import Trainer
from tiny_run import GRPO, small_cfg
from tools import critical_path


def event(method: str, start_s: float, dur_s: float, ph: str = "X") -> dict:
    """One of ray.timeline()'s events: microseconds of the wall clock."""
    return {"cat": f"task::{method}", "name": method.split(".")[1], "ph": ph, "ts": start_s * 1e6, "dur": dur_s * 1e6}


def test_a_synchronous_step_is_read_as_its_chain_of_links():
    """Two learner ranks train at once (one span), two requests roll out, each is scored, the weights are received:
    the links are the gaps and spans written out by hand, and they sum to the step."""
    t = 1000.0
    events = [
        event("LearnerWorker.train_step", t + 0.0, 0.100), event("LearnerWorker.train_step", t + 0.001, 0.102),
        event("RolloutWorker.receive_weights", t + 0.106, 0.004),
        event("RolloutWorker.generate", t + 0.105, 0.050), event("RewardWorker.score", t + 0.157, 0.001),
        event("RolloutWorker.generate", t + 0.156, 0.050), event("RewardWorker.score", t + 0.208, 0.002),
        event("LearnerWorker.train_step", t + 0.213, 0.100), event("LearnerWorker.train_step", t + 0.212, 0.101),
        {"cat": "submit_task", "name": "submit_task", "ph": "X", "ts": (t + 0.12) * 1e6, "dur": 500.0},  # not a task
        event("RolloutWorker.generate", t + 0.15, 0.01, ph="B"),  # not a complete span
        event("RolloutWorker.generate", t + 5.0, 0.05),  # outside the window
    ]
    spans = critical_path.task_spans(events, t - 1, t + 1)
    assert len(spans["LearnerWorker.train_step"]) == 4 and len(spans["RolloutWorker.generate"]) == 2
    (step,) = critical_path.synchronous_steps(spans)
    expected = {"learner": 0.313 - 0.212, "learner_to_rollout": 0.105 - 0.103, "rollout": 0.206 - 0.105,
                "rollout_to_reward": 0.208 - 0.206, "reward": 0.002, "reward_to_learner": 0.212 - 0.210,
                "step": 0.313 - 0.103, "weights_staged": 0.110 - 0.103}
    assert step == pytest.approx(expected, abs=1e-6)
    assert sum(step[link] for link in critical_path.LINKS) == pytest.approx(step["step"], abs=1e-9)
    assert critical_path.summarize([step, step]) == {"steps": 2, **step}


def test_a_step_without_its_scoring_in_the_events_is_left_out():
    events = [event("LearnerWorker.train_step", 0.0, 0.1), event("RolloutWorker.generate", 0.11, 0.05),
              event("LearnerWorker.train_step", 0.2, 0.1)]
    assert critical_path.synchronous_steps(critical_path.task_spans(events, -1, 1)) == []
    assert critical_path.summarize([]) == {"steps": 0}


def test_a_synchronous_run_on_ray_reads_as_one_chain_a_step_matching_the_drivers_step_times(ray_session, tiny_model_dir,
                                                                                             tmp_path):
    """The method names the tool looks for are the actors' (a renamed method would leave it no step), and the chain
    it reads from Ray's clock matches the driver's own step times (StepClock, perf/step_s)."""
    steps = 4
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", f"trainer.total_steps={steps}", "trainer.eval_every=0",
                    "trainer.save_every=0", "logging.progress_bar=false", "async.max_staleness=0")
    trainer = Trainer(cfg)
    try:
        started = time.time()
        history = trainer.run()
        ended = time.time()
        # The workers report their task events about once a second: wait until every train step is in.
        deadline = time.monotonic() + 20
        while True:
            spans = critical_path.task_spans(ray_session.timeline(), started, ended)
            if len(spans.get(critical_path.TRAIN, [])) == steps or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        trainer.shutdown()
    chain = critical_path.synchronous_steps(spans)
    assert len(chain) == steps - 1, spans.keys()
    for link, driver_step in zip(chain, history[1:]):
        assert all(link[name] >= 0 for name in critical_path.LINKS) and not math.isnan(link["weights_staged"])
        # The driver laps its clock when it sees a step's metrics, a hop after the train step's end on the learner.
        assert link["step"] == pytest.approx(driver_step["perf/step_s"], rel=0.25, abs=0.05)
