"""Estimate GPU memory per role and per device for a config, without a GPU and without weights.

    python tools/plan.py --config recipes/flowgrpo_qwen_image_8gpu.yaml [key=value ...] [--gpu-memory-gib 80]

The plan is checked against --gpu-memory-gib, else the config's trainer.gpu_memory_gib (what the run's start-up check
takes), else an H100 80 GB's 79.6 GiB.

Exits 1 when a device does not fit (the message names the figure and the config key to change).
When model.path is not on this machine, the published configs of --arch (default: the recipe's model.tiny_arch) are
planned: Qwen-Image, Stable Diffusion 3.5 Medium or FLUX.1-dev (rayflow/models/published.py).
"""

import argparse
import sys

from rayflow.config import load_config
from rayflow.errors import ConfigError
from rayflow.models.published import PUBLISHED
from rayflow.planning.memory import GiB, check_fits, format_plan, plan_config

DEFAULT_GPU_MEMORY_GIB = 79.6
"""One H100 80 GB's memory, when neither --gpu-memory-gib nor trainer.gpu_memory_gib says."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a recipe YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help=f"memory of one GPU (default: the config's trainer.gpu_memory_gib, else an H100 80 GB's "
                             f"{DEFAULT_GPU_MEMORY_GIB} GiB)")
    parser.add_argument("--arch", default=None, choices=sorted(PUBLISHED),
                        help="published architecture when model.path is not here (default: model.tiny_arch)")
    parser.add_argument("--math-attention", action="store_true", help="plan unfused attention (score matrices kept)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.gpu_memory_gib is not None and not 0 < args.gpu_memory_gib < float("inf"):
        parser.error(f"--gpu-memory-gib: got {args.gpu_memory_gib}; allowed: a number of GiB > 0")
    # The config's figure is the one the run's start-up check takes: checked against 79.6 instead, a config made for
    # a 40 GiB card passed here and was refused at start.
    device_bytes = int((args.gpu_memory_gib or cfg.trainer.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB) * GiB)
    try:
        plan, source = plan_config(cfg, args.arch, math_attention=args.math_attention)
    except ValueError as e:  # model.path not a pipeline; planning.sizes.NoPublishedConfigs
        sys.exit(f"error: {e}")
    print(format_plan(plan, device_bytes, source))
    try:
        check_fits(cfg, plan, device_bytes)
    except ConfigError as e:
        print(f"\nerror: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
