"""FlowGRPO on Stable Diffusion 3.5 (StableDiffusion3Pipeline); DiffusionNFT with --config recipes/diffusion_nft_sd3.yaml.

    python recipes/flowgrpo_sd3.py [--config YAML] [key=value ...]
    ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml -- \\
        python recipes/flowgrpo_sd3.py --config recipes/flowgrpo_sd3_8gpu.yaml model.path=/models/stable-diffusion-3.5-medium

Without model.path: the tiny offline Stable Diffusion 3.5 twin on CPU (a few minutes on 2 cores). Joins the cluster at
RAY_ADDRESS when set (as under `ray job submit`), else starts a local Ray on loopback.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for a working-dir upload without an install

from rayflow.driver.launch import run_recipe  # noqa: E402

if __name__ == "__main__":
    run_recipe(os.path.join(HERE, "flowgrpo_sd3.yaml"), sys.argv[1:])
