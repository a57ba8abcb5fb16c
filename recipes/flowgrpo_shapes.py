"""FlowGRPO on the shapes world: the pretrained shapes base (models/shapes-qwen-image) against the `shapes` reward.

    python recipes/flowgrpo_shapes.py [--config YAML] [key=value ...]

About ten minutes on 2 CPU cores; eval/shapes_accuracy (held-out prompts, fixed seeds) is logged before the
first step and every trainer.eval_every steps. Joins the cluster at RAY_ADDRESS when set (as under
`ray job submit`), else starts a local Ray on loopback.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for a working-dir upload without an install

from rayflow.driver.launch import run_recipe  # noqa: E402

if __name__ == "__main__":
    run_recipe(os.path.join(HERE, "flowgrpo_shapes.yaml"), sys.argv[1:])
