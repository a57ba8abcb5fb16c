"""`ray job stop` of a submitted recipe leaves its last complete checkpoint intact.

(That a submitted recipe SUCCEEDS and writes TensorBoard logs and a checkpoint is checked on the fake
autoscaling cluster in tests/test_cluster.py.) The head here has CPUs of its own, so the job runs on it.
"""

import os
import subprocess
import time

from cluster_fake import REPO, FakeAutoscalingCluster
from rayflow.checkpoint import checkpoint_root, list_checkpoints, load_checkpoint

SMALL = [
    "algorithm.prompts_per_step=1", "algorithm.group_size=2", "sampling.num_steps=2", "learner.micro_batch_size=2",
    "rollout.micro_batch_size=2", "trainer.eval_every=0", "logging.progress_bar=false",
]


def job(cluster: FakeAutoscalingCluster, command: str, *args: str) -> str:
    result = subprocess.run(["ray", "job", command, "--address", cluster.dashboard_url, *args], env=cluster.env,
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, f"ray job {command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def test_a_stopped_job_leaves_its_last_complete_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "stopped"
    root = checkpoint_root(str(out))
    with FakeAutoscalingCluster(head_cpus=6) as cluster:
        job(cluster, "submit", "--no-wait", "--submission-id", "rayflow-stop-test", "--working-dir", ".",
            "--runtime-env", "cluster/runtime_env.yaml", "--", "python", "recipes/flowgrpo_qwen_image.py", "--config", "recipes/flowgrpo_tiny.yaml",
            f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.run_name=stopped", "trainer.total_steps=1000",
            "trainer.save_every=1", "trainer.keep_checkpoints=3", *SMALL)
        wait_for(lambda: len(list_checkpoints(root)) >= 2, 300, "two checkpoints")
        job(cluster, "stop", "rayflow-stop-test")
        wait_for(lambda: "was stopped" in job(cluster, "status", "rayflow-stop-test"), 120, "the job to stop")
        logs = job(cluster, "logs", "rayflow-stop-test")
    steps = [load_checkpoint(path).step for path in list_checkpoints(root)]  # each one complete and readable
    assert len(steps) >= 2 and steps == sorted(steps) and max(steps) < 1000
    # At most an unfinished write, re-save or rotation under a temporary name (.tmp-, .old-, .del-: the next start
    # clears them, rayflow.checkpoint.remove_leftovers); never a partial step_* directory.
    names = os.listdir(root)
    assert all(name.startswith(("step_", ".tmp-", ".old-", ".del-")) for name in names), names
    # The driver says where it stopped and how to continue, without a traceback of the interrupt.
    assert "interrupted at step" in logs and "continue with the same command and trainer.run_name=stopped" in logs
    assert "KeyboardInterrupt" not in logs
