"""The recipes as users run them: a subprocess smoke run (its own local Ray), and bad input that fails
before anything starts, with a message naming the key or the file and line."""

import json
import os
import re
import subprocess
import sys
import time

import psutil

from rayflow.checkpoint import checkpoint_root, latest_checkpoint, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_recipe(recipe: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, os.path.join(REPO, "recipes", f"{recipe}.py"), *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def listening_addresses(pid: int, until: subprocess.Popen) -> set[str]:
    """Every address a process tree listens on (TCP: only TCP sockets listen), polled until `until` exits.

    One system-wide table per poll, filtered to the tree: asking each of the run's ~25 processes for its own
    connections parses the kernel's tables once per process, 180 ms of CPU a poll against 17 ms, and took half a
    core from the run it watches."""
    seen = set()
    while until.poll() is None:
        try:
            tree = {pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            break
        seen |= {c.laddr.ip for c in psutil.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN and c.pid in tree}
        time.sleep(0.2)
    return seen


def test_nft_recipe_runs_end_to_end_from_any_directory_on_loopback_only(tiny_model_dir, tmp_path):
    """From outside the repository, with CFG-parallel ranks and two FSDP2 learner ranks: every rendezvous,
    collective and Ray server the run starts listens on loopback only."""
    out = tmp_path / "nft"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.Popen([
        sys.executable, os.path.join(REPO, "recipes", "diffusion_nft_qwen_image.py"), "--config", os.path.join(REPO, "recipes", "diffusion_nft_tiny.yaml"),
        f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.run_name=nft",
        "trainer.total_steps=2", "trainer.eval_every=1", "algorithm.prompts_per_step=1", "algorithm.group_size=2",
        "learner.micro_batch_size=1", "learner.world_size=2", "rollout.cfg_parallel_size=2", "rollout.micro_batch_size=2",
        "trainer.eval_guidance_scale=4.0",  # CFG-free rollouts: the two CFG ranks split the evaluation's two branches
        "logging.progress_bar=false",
    ], cwd=tmp_path, env=env, stdout=open(tmp_path / "run.log", "w"), stderr=subprocess.STDOUT)
    try:
        addresses = listening_addresses(run.pid, until=run)
        run.wait(timeout=600)
    finally:
        run.kill()
    log = (tmp_path / "run.log").read_text()
    assert run.returncode == 0, log[-6000:]
    assert addresses and addresses <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, addresses
    # The end-of-run summary says where everything is and how to continue.
    assert "done: 2 steps" in log and f"run dir     {out}" in log and "trainer.run_name=nft trainer.total_steps=<more>" in log
    assert "step 1 " in log and "step 2 " in log and "dashboard at http://127.0.0.1" in log
    # Where learner rank 0's start-up went, for a start-up that is slow (README, Measured on one H200).
    assert re.search(r"startup of learner rank 0: process age [0-9.]+s, device [0-9.]+s, process group [0-9.]+s, "
                     r"model [0-9.]+s\n", log), log[-3000:]
    ckpt = load_checkpoint(latest_checkpoint(checkpoint_root(str(out))))
    assert ckpt.step == 2 and sorted(ckpt.adapters) == ["default", "old"]  # NFT's EMA adapter is kept too
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out / "tensorboard"))


def test_bad_config_and_prompt_files_fail_before_anything_starts(tmp_path):
    result = run_recipe("flowgrpo_qwen_image", "rollout.cfg_parallel_size=0", timeout=120)
    assert result.returncode != 0
    assert "rollout.cfg_parallel_size: got 0; allowed: an integer >= 1" in result.stderr
    assert "Started a local Ray" not in result.stderr

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red apple"}\n{"prompt": "a blue car"\n')
    result = run_recipe("flowgrpo_qwen_image", f"data.prompts={prompts}", "model.path=/nonexistent", timeout=120)
    assert result.returncode != 0
    assert f"{prompts}:2: not valid JSON" in result.stderr
    assert "Started a local Ray" not in result.stderr


def test_a_benchmark_runs_from_outside_the_repository(tiny_model_dir, tmp_path):
    """tools/bench.py finds its recipe through the package, not the working directory (the cheapest benchmark:
    the simulator's costs, two steps in one process)."""
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "bench.py"), "costs", "--steps", "2", "--warmup", "1", "--json", str(out),
         f"model.path={tiny_model_dir}", "algorithm.prompts_per_step=1", "algorithm.group_size=2", "sampling.num_steps=2",
         "learner.micro_batch_size=2", "rollout.micro_batch_size=2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["setup"]["recipe"] == os.path.join(REPO, "recipes", "flowgrpo_tiny.yaml")
    assert report["rollout_request_s"] > 0 and report["train_batch_s"] > 0


def test_the_startup_benchmark_says_why_its_run_failed(tmp_path):
    """bench.py startup reads the recipe's output for its timings; when the run fails, its last lines are the error
    (a GPU machine's failure once showed only "failed (exit 1)"). A bad value fails at config checks, before Ray."""
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "bench.py"), "startup", "--repeats", "1", "trainer.total_steps=0"],
        cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 1
    error = result.stderr[result.stderr.index("RuntimeError: "):]
    assert "failed (exit 1); its last lines:" in error and "trainer.total_steps: got 0" in error, error
