"""The recipes as users run them: a subprocess smoke run (its own local Ray), and bad input that fails
before anything starts, with a message naming the key or the file and line."""

import os
import subprocess
import sys

from rayflow.checkpoint import checkpoint_root, latest_checkpoint, load_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_recipe(recipe: str, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, f"recipes/{recipe}.py", *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_nft_recipe_runs_end_to_end_on_a_local_ray(tiny_model_dir, tmp_path):
    out = tmp_path / "nft"
    result = run_recipe(
        "diffusion_nft_qwen_image", f"model.path={tiny_model_dir}", f"trainer.output_dir={out}",
        "trainer.total_steps=2", "trainer.eval_every=1", "algorithm.prompts_per_step=1", "algorithm.group_size=2",
        "learner.micro_batch_size=2", "rollout.micro_batch_size=2", "logging.progress_bar=false",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = result.stdout + result.stderr
    assert "step 1 " in log and "step 2 " in log and "dashboard at http://127.0.0.1" in log
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
