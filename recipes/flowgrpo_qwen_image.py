"""FlowGRPO on Qwen-Image.

    python recipes/flowgrpo_qwen_image.py [--config YAML] [key=value ...]
    ray job submit --working-dir . -- python recipes/flowgrpo_qwen_image.py model.path=/models/Qwen-Image

Without model.path: the tiny offline Qwen-Image on CPU (a few minutes on 2 cores). Joins the cluster at
RAY_ADDRESS when set (as under `ray job submit`), else starts a local Ray on loopback.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for a working-dir upload without an install

from rayflow.driver.launch import run_recipe  # noqa: E402

if __name__ == "__main__":
    run_recipe(os.path.join(HERE, "flowgrpo_qwen_image.yaml"), sys.argv[1:])
