"""tools/bench.py gpu, its CPU-safe path: every phase on the tiny model on CPU (the harness, not the figures)."""

import json
import os
import subprocess
import sys

from tools.simulate import main as simulate_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_benchmark_harness_runs_on_cpu(tmp_path, capsys):
    out = tmp_path / "bench_gpu.json"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "gpu", "--device", "cpu", "--tiny", "--repeats", "1",
         "--batch", "1", "--learner-batch", "2", "--size", "32", "--json", str(out), "--overrides", "model.attention_backend=math"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"), check=True, timeout=600,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["setup"]["dtype"] == "float32" and result["setup"]["steps"] == 2
    assert result["setup"]["overrides"] == ["model.attention_backend=math"]  # the rayflow phases' config; not diffusers'
    rollout, learner = result["rollout"], result["learner"]
    assert rollout["pipeline"]["images_per_s"] > 0 and rollout["replica"]["images_per_s"] > 0
    assert rollout["ratio"] == rollout["replica"]["images_per_s"] / rollout["pipeline"]["images_per_s"]
    # The replica's rank in this process, without Ray: the split of the replica's gap to the pipeline.
    assert rollout["rank"]["images_per_s"] > 0
    # The warm-up calls are timed apart (with model.compile they hold the compile): what a run pays once.
    assert all(phase["warmup_s"] > 0 for phase in (rollout["pipeline"], rollout["rank"], rollout["replica"], learner))
    assert rollout["rank_ratio"] == rollout["rank"]["images_per_s"] / rollout["pipeline"]["images_per_s"]
    assert learner["train_step_s"] > 0 and learner["bare_forward_backward_s"] > 0
    assert learner["planned_bytes"] > 0 and learner["peak_bytes"] is None  # no CUDA allocator on CPU
    # In fp32 on one CPU the learner's replay is the rollout's computation: the log-probs agree exactly.
    for label in ("cfg_4.0", "no_cfg"):
        assert result["log_prob_mismatch"][label]["max"] == 0.0
    # The cost section is what the simulator reads (a cost file adds the reward's cost, which this bench does not run).
    costs = result["simulator_costs"]
    assert costs["rollout_request_s"] == rollout["replica"]["seconds_per_request"]
    assert costs["train_batch_s"] == learner["train_step_s"]
    cost_file = tmp_path / "costs.json"
    cost_file.write_text(json.dumps({**costs, "reward_request_s": 0.01}))
    assert simulate_main(["--costs", str(cost_file), "--config", os.path.join(ROOT, "recipes", "flowgrpo_tiny.yaml"),
                          "--gpus", "4", "--staleness", "0"]) == 0
    sizing = capsys.readouterr().out
    assert "4 GPUs: " in sizing and "x1 roll + " in sizing


def test_a_bad_override_is_refused_naming_the_key_before_any_model_is_built():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench.py"), "gpu", "--device", "cpu", "--tiny",
         "--overrides", "model.attention_backend=fastest"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "--overrides: model.attention_backend: got 'fastest'; allowed: one of ['auto', 'flash', 'efficient', 'cudnn', 'math']")
