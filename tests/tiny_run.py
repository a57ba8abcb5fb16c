"""A recipe cut to the size the learner and checkpoint tests train at."""

import os

from rayflow.checkpoint import checkpoint_root, load_checkpoint, step_dir
from rayflow.config import RayflowConfig, load_config
from rayflow.learner.sharded import read_weights
from rayflow.paths import recipe as recipe_path

GRPO, NFT = recipe_path("flowgrpo_tiny.yaml"), recipe_path("diffusion_nft_tiny.yaml")  # the tiny random-weight model


def small_cfg(recipe: str, model_dir: str, out_dir, *overrides: str) -> RayflowConfig:
    """4 samples (1 prompt x 4), 4 denoising steps at 32x32, learner micro-batches of 2. The run's directory
    (trainer.run_dir) is `out_dir`."""
    out_dir = os.path.abspath(str(out_dir))
    return load_config(recipe, [
        f"model.path={model_dir}", f"trainer.output_dir={os.path.dirname(out_dir)}", f"trainer.run_name={os.path.basename(out_dir)}", "algorithm.prompts_per_step=1",
        "algorithm.group_size=4", "sampling.num_steps=4", "learner.micro_batch_size=2",
        "rollout.micro_batch_size=4", *overrides,
    ])


def final_adapters(run_dir: str, step: int) -> dict:
    """{weight set: {name: full tensor}} of a checkpoint: its adapters, or its sharded full weights."""
    ckpt = load_checkpoint(step_dir(checkpoint_root(run_dir), step))
    if ckpt.sharded is None:
        return ckpt.adapters
    return {name: read_weights(ckpt.sharded.directory, name) for name in ckpt.sharded.names}
