"""DiffusionNFT on Qwen-Image.

    python recipes/diffusion_nft_qwen_image.py [--config YAML] [key=value ...]
    python recipes/diffusion_nft_qwen_image.py --config recipes/diffusion_nft_tiny.yaml  the tiny random-weight model
    ray job submit --working-dir . -- python recipes/diffusion_nft_qwen_image.py \
        --config recipes/diffusion_nft_qwen_image_8gpu.yaml model.path=/models/Qwen-Image

Without --config: the shapes base shipped in models/shapes-qwen-image trains on GenEval-style prompts against
the `shapes` reward on CPU (about 15 minutes on 2 cores for 200 steps; eval/shapes_accuracy on held-out prompts is
logged before the first step and every trainer.eval_every steps). Joins the cluster at RAY_ADDRESS when set
(as under `ray job submit`), else starts a local Ray on loopback.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for a working-dir upload without an install

from rayflow.driver.launch import run_recipe  # noqa: E402

if __name__ == "__main__":
    run_recipe(os.path.join(HERE, "diffusion_nft_qwen_image.yaml"), sys.argv[1:])
