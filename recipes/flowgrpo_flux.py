"""FlowGRPO on FLUX.1-dev (FluxPipeline); DiffusionNFT with --config recipes/diffusion_nft_flux.yaml.

    python recipes/flowgrpo_flux.py [--config YAML] [key=value ...]
    ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml -- \\
        python recipes/flowgrpo_flux.py --config recipes/flowgrpo_flux_8gpu.yaml model.path=/models/FLUX.1-dev

Without model.path: the tiny offline FLUX.1-dev twin on CPU (a few minutes on 2 cores). Joins the cluster at
RAY_ADDRESS when set (as under `ray job submit`), else starts a local Ray on loopback.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for a working-dir upload without an install

from rayflow.driver.launch import run_recipe  # noqa: E402

if __name__ == "__main__":
    run_recipe(os.path.join(HERE, "flowgrpo_flux.yaml"), sys.argv[1:])
