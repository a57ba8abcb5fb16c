"""Build a randomly initialised pipeline from the real diffusers / transformers classes, offline.

    python tools/make_tiny_model.py --arch qwen_image --out /tmp/tiny-qwen-image [--seed 0] [--size tiny]
    python tools/make_tiny_model.py --arch sd3 --out /tmp/tiny-sd3
    python tools/make_tiny_model.py --arch flux --out /tmp/tiny-flux

The result loads with diffusers' `QwenImagePipeline`, `StableDiffusion3Pipeline` or
`FluxPipeline.from_pretrained(OUT)`.
`--size full --random-init` builds the published architecture (rayflow/models/published.py, sources
named there) with random weights: parameters are created on the meta device and allocated directly
on --device in --dtype, so a 20B model never passes through CPU memory on its way to a GPU.

    python tools/make_tiny_model.py --arch qwen_image --size full --random-init --dtype bfloat16 --device cuda --out DIR
    python tools/make_tiny_model.py --arch qwen_image --size full --random-init --weights-at-load --out DIR
    python tools/make_tiny_model.py --arch sd3 --size full --random-init --weights-at-load --out DIR   # SD3.5 Medium

--weights-at-load writes configs and tokenizer only (kilobytes): rayflow's loader (model.path=DIR)
then builds the weights on each rank's own device. --depth N sets every layer count (quick looks).
"""

import argparse
import os
import sys

import torch

from rayflow.models.published import PUBLISHED
from rayflow.models.random_init import save_random_pipeline, write_random_init_dir
from rayflow.models.tiny import ARCHS, SPECS, save_tiny_model, tiny_sizes

FULL = "full"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen_image", choices=sorted(set(ARCHS) | set(PUBLISHED)))
    parser.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; the same seed gives the same weights")
    parser.add_argument("--size", default="tiny", choices=sorted(SPECS) + [FULL], help="small: qwen_image and sd3 only; full: the published architecture (sd3: SD3.5 Medium, flux: FLUX.1-dev)")
    parser.add_argument("--random-init", action="store_true", help="required with --size full: its weights are random")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="--size full only")
    parser.add_argument("--device", default="cpu", help="--size full only: where the weights are built (cpu, cuda, cuda:1)")
    parser.add_argument("--depth", type=int, default=None, help="--size full only: every layer count (default: published)")
    parser.add_argument("--weights-at-load", action="store_true", help="--size full only: write no weights; build them at load")
    args = parser.parse_args(argv)
    if args.size != FULL and args.size not in tiny_sizes(args.arch):
        parser.error(f"--size {args.size}: allowed for --arch {args.arch}: {tiny_sizes(args.arch)}")
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"--out: {args.out!r} exists and is not empty; choose a new directory")
    if args.size != FULL:
        if args.random_init or args.depth is not None or args.weights_at_load:
            sys.exit(f"--random-init, --depth, --weights-at-load: only with --size full (got --size {args.size})")
        if os.path.isdir(args.out):
            os.rmdir(args.out)
        save_tiny_model(args.out, size=args.size, seed=args.seed, arch=args.arch)
        print(f"wrote {args.arch} ({args.size}, seed {args.seed}) to {args.out}")
        return
    if not args.random_init:
        sys.exit("--size full: pass --random-init (no weights can be downloaded here; the full size is the published "
                 "architecture with random weights)")
    if args.depth is not None and args.depth < 1:
        sys.exit(f"--depth: got {args.depth}; allowed: an integer >= 1")
    if os.path.isdir(args.out):
        os.rmdir(args.out)
    if args.weights_at_load:
        write_random_init_dir(args.arch, args.out, seed=args.seed, depth=args.depth)
    else:
        save_random_pipeline(args.arch, args.out, device=args.device, dtype=getattr(torch, args.dtype),
                             seed=args.seed, depth=args.depth)
    print(f"wrote {args.arch} (full, random init, seed {args.seed}, depth {args.depth or 'published'}) to {args.out}")


if __name__ == "__main__":
    main()
