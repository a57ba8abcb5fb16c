"""tools/bench.py learning: its summary of an eval curve, and the inputs it refuses (the runs themselves are
the benchmark; tests/test_trainer.py covers the time limit they stop on)."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import bench  # noqa: E402
from learning_bench import summarize  # noqa: E402


def test_summary_reports_start_end_best_and_the_training_time_the_target_was_first_reached():
    curve = [{"step": 0, "train_s": 0.0, "accuracy": 0.10}, {"step": 10, "train_s": 31.0, "accuracy": 0.25},
             {"step": 20, "train_s": 60.5, "accuracy": 0.35}, {"step": 30, "train_s": 92.0, "accuracy": 0.30}]
    assert summarize(curve, target=0.3) == {
        "start_accuracy": 0.10, "end_accuracy": 0.30, "best_accuracy": 0.35, "best_at_step": 20,
        "gain_points": pytest.approx(20.0), "time_to_target_s": 60.5,
    }
    assert summarize(curve, target=0.5)["time_to_target_s"] is None


@pytest.mark.parametrize("argv, message", [
    (["learning", "--budget-s", "0"], "--budget-s: got 0.0; allowed: seconds > 0"),
    (["learning", "--staleness", "-1"], "--staleness: got [-1]; allowed: integers >= 0"),
    (["pipeline", "--rounds", "0"], "--rounds: got 0; allowed: integers >= 1"),
    (["rollout", "--decode-batch-size", "-1"], "--decode-batch-size: got -1; allowed: integers >= 0"),
    (["trajectories", "--repeats", "0"], "--repeats: got 0; allowed: integers >= 1"),
    (["startup", "--repeats", "0"], "--repeats: got 0; allowed: integers >= 1"),
    (["rollout", "--batch", "0"], "--batch: got 0; allowed: integers >= 1"),
    (["gpu", "--learner-batch", "1"], "--learner-batch: got 1; allowed: integers >= 2"),
    (["sync", "--repeats", "0"], "--repeats: got 0; allowed: integers >= 1"),
    (["costs", "--warmup", "-1"], "--warmup: got -1; allowed: integers >= 0"),
    (["costs", "--steps", "1", "--warmup", "1"], "--warmup: got 1; allowed: fewer than --steps (1)"),
    (["pipeline", "--steps", "2", "--warmup", "4"], "--warmup: got 4; allowed: fewer than --steps (2)"),
    (["sync", "--bucket-mb", "0"], "--bucket-mb: got 0.0; allowed: numbers > 0"),
    (["rollout", "--height", "0"], "--height: got 0; allowed: integers >= 1"),
    (["pipeline", "--colocated-devices", "0"], "--colocated-devices: got [0]; allowed: integers >= 1"),
    (["gpu", "--depth", "0"], "--depth: got 0; allowed: integers >= 1"),
    # A recipe that is not there is named by its flag, before any work.
    (["pipeline", "--recipe", "/nope.yaml"], "error: --recipe: got '/nope.yaml'; allowed: an existing recipe YAML file"),
    (["costs", "--recipe", "/nope.yaml"], "error: --recipe: got '/nope.yaml'; allowed: an existing recipe YAML file"),
    (["simulator", "--recipe", "/nope.yaml"], "error: --recipe: got '/nope.yaml'; allowed: an existing recipe YAML file"),
    (["startup", "--config", "/nope.yaml"], "error: --config: got '/nope.yaml'; allowed: an existing recipe YAML file"),
    # A config key to fix is one line, as the recipes' launchers print it.
    (["costs", "trainer.bogus=1"], "error: trainer.bogus: got 1; allowed: a known key"),
])
def test_inputs_that_cannot_be_met_are_named(argv, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        bench.main(argv)
