"""A recipe cut to the size the learner and checkpoint tests train at."""

from rayflow.config import RayflowConfig, load_config

GRPO, NFT = "recipes/flowgrpo_qwen_image.yaml", "recipes/diffusion_nft_qwen_image.yaml"


def small_cfg(recipe: str, model_dir: str, out_dir, *overrides: str) -> RayflowConfig:
    """4 samples (1 prompt x 4), 4 denoising steps at 32x32, learner micro-batches of 2."""
    return load_config(recipe, [
        f"model.path={model_dir}", f"trainer.output_dir={out_dir}", "algorithm.prompts_per_step=1",
        "algorithm.group_size=4", "sampling.num_steps=4", "learner.micro_batch_size=2",
        "rollout.micro_batch_size=4", *overrides,
    ])
