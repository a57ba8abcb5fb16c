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


def test_overrides_may_follow_an_option_that_takes_several_values():
    """README: `--recipe FILE [FILE …]` "with any overrides after them"; argparse gave them to the list option."""
    args = bench.parse_args(["learning", "--staleness", "0", "1", "trainer.seed=1", "--configs", "flow_grpo", "sampling.num_steps=4"])
    assert args.staleness == [0, 1] and args.configs == ["flow_grpo"]
    assert args.overrides == ["trainer.seed=1", "sampling.num_steps=4"]
    assert bench.parse_args(["pipeline", "--colocated-devices", "1", "2", "trainer.seed=1"]).overrides == ["trainer.seed=1"]
    # bench.py gpu takes its KEY=VALUE pairs as --overrides' values (it has no positional overrides).
    assert bench.parse_args(["gpu", "--overrides", "model.compile=true", "--repeats", "1"]).overrides == ["model.compile=true"]
    with pytest.raises(SystemExit):  # a benchmark without overrides still refuses one
        bench.parse_args(["trajectories", "trainer.seed=1"])


@pytest.mark.parametrize("argv, message", [
    # An odd count gives one W = 1 replica a request more than the other: the pair's time is the busier one's, and the
    # throughput ratio came out 1.33x for replicas of equal throughput at 3 requests (2.0x at 1).
    (["rollout", "--throughput-requests", "3"], "--throughput-requests: got 3; allowed: an even integer >= 2"),
    (["rollout", "--throughput-requests", "1"], "--throughput-requests: got 1; allowed: integers >= 2"),
    (["trajectories", "--json", "/no/such/dir/out.json"], "--json: '/no/such/dir/out.json' is in no existing directory"),
])
def test_inputs_that_would_give_a_wrong_figure_or_lose_it_are_named_before_any_work(monkeypatch, capsys, argv, message):
    monkeypatch.setitem(bench.BENCHMARKS, argv[0], lambda args: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as stopped:
        bench.main(argv)
    assert message in str(stopped.value.code) + capsys.readouterr().err  # SystemExit's message, or parser.error's


def test_a_target_accuracy_outside_0_to_1_is_refused_before_any_run(monkeypatch):
    """--target 60 (meaning 60%) was never reached: every configuration read "never"."""
    import learning_bench

    monkeypatch.setattr(learning_bench, "run_one", lambda *a: pytest.fail("no run should start"))
    with pytest.raises(SystemExit, match=re.escape("--target: got 60.0; allowed: an accuracy in (0, 1], e.g. 0.6 for 60%")):
        learning_bench.bench_learning(bench.parse_args(["learning", "--target", "60"]), lambda num_cpus: pytest.fail("no Ray"))


def test_startup_records_the_load_average_before_its_runs(monkeypatch):
    """Its JSON's load_average_before was read after the runs, which load the machine themselves."""
    import subprocess

    load = [0.25]  # the machine's 1-minute load average: each run raises it

    class FakeRun:
        returncode = 0

        def __init__(self, *args, **kwargs):
            load[0] += 1.5
            self.stdout = iter(["rayflow INFO startup: ray 5.1s, actors 2.0s\n", "rayflow INFO step 1  reward 0.5\n",
                                "rayflow INFO done: 1 steps in 9s; reward 0.5000 (mean of the last 1 steps)\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakeRun)
    monkeypatch.setattr(os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    result = bench.bench_startup(bench.parse_args(["startup", "--repeats", "1"]))
    assert result["load_average_before"] == 0.25
    assert result["runs"][0]["phases"] == {"ray": 5.1, "actors": 2.0}
    assert result["end_s"]["median"] == result["runs"][0]["end_s"] >= 0  # from the "done:" line to the exit


def test_pipeline_runs_do_not_evaluate_at_start_and_split_their_steps_into_phases(monkeypatch):
    """A recipe's trainer.eval_at_start (the shapes recipes') evaluated before the first step, inside the window of
    the bench's `cpu` figures (CPU per step), though outside the step times: trainer.eval_every=0 alone left it on.
    The phases come from the runs' own logs: the reference's rollout seconds, the driver's idle shares."""
    import types

    import rayflow.driver.trainer
    from rayflow import reference
    from rayflow.paths import recipe

    configs = []

    class FakeTrainer:
        def __init__(self, cfg):
            configs.append(cfg)
            self.cfg = cfg

        def run(self):
            step = {"perf/step_s": 0.1, "perf/fetch_s": 0.0, "perf/prefetched": 1.0, "perf/rollout_idle": 0.55,
                    "perf/learner_idle": 0.5, "staleness/mean": 0.0}
            return [dict(step) for _ in range(self.cfg.trainer.total_steps)]

        def shutdown(self):
            pass

    def fake_train(cfg, log=None):
        configs.append(cfg)
        return None, [types.SimpleNamespace(seconds=0.1, rollout_seconds=0.04) for _ in range(cfg.trainer.total_steps)]

    monkeypatch.setattr(rayflow.driver.trainer, "Trainer", FakeTrainer)
    monkeypatch.setattr(reference, "train", fake_train)
    monkeypatch.setattr(bench, "start_local_ray", lambda num_cpus: types.SimpleNamespace(shutdown=lambda: None, __version__="x",
                                                                                   timeline=lambda: []))
    monkeypatch.setattr(bench, "idle_penalty", lambda cfg: {})
    result = bench.bench_pipeline(bench.parse_args(["pipeline", "--recipe", recipe("flowgrpo_qwen_image.yaml"),
                                                    "--steps", "2", "--warmup", "0"]))
    assert len(configs) == 4 and result["step_s"]["max_staleness_0"] == 0.1
    assert [c.trainer.eval_at_start for c in configs] == [False] * 4
    # Steps of 0.1 s: the reference's 0.04 s rollout and 0.06 s learning; the roles busy 45% and 50% of a step, so
    # neither is busy 5% of it.
    assert result["phases"]["reference"] == pytest.approx({"rollout_s": 0.04, "learn_s": 0.06})
    assert result["phases"]["max_staleness_0"] == pytest.approx(
        {"rollout_busy_s": 0.045, "learner_busy_s": 0.05, "neither_busy_s": 0.005})
    assert "neither_busy_s" not in result["phases"]["max_staleness_1"]  # the roles overlap there
    # The critical path is read for the synchronous runs only; these fake runs left Ray no task events to read.
    assert result["critical_path"] == {"max_staleness_0": {"steps": 0}, "max_staleness_0_no_prefetch": {"steps": 0}}


@pytest.mark.parametrize("flag", ["--images", "--threads"])
def test_reward_cost_names_a_count_below_one(monkeypatch, capsys, flag):
    """tools/reward_cost.py --images 0 ended in numpy's "need at least one array to stack"; --threads 0 in torch's."""
    import reward_cost

    monkeypatch.setattr(sys, "argv", ["reward_cost.py", flag, "0"])
    with pytest.raises(SystemExit):
        reward_cost.main()
    assert f"{flag}: got 0; allowed: an integer >= 1" in capsys.readouterr().err
