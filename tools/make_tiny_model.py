"""Build a tiny, randomly initialised pipeline from the real diffusers classes, offline.

    python tools/make_tiny_model.py --arch qwen_image --out /tmp/tiny-qwen-image [--seed 0] [--size tiny]

The result loads with `diffusers.QwenImagePipeline.from_pretrained(OUT)`.
"""

import argparse
import os
import sys

from rayflow.models.tiny import SPECS, save_tiny_model

ARCHS = ("qwen_image",)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen_image", choices=ARCHS)
    parser.add_argument("--out", required=True, help="directory to write (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; the same seed gives the same weights")
    parser.add_argument("--size", default="tiny", choices=sorted(SPECS))
    args = parser.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        sys.exit(f"--out: {args.out!r} exists and is not empty; choose a new directory")
    if os.path.isdir(args.out):
        os.rmdir(args.out)
    save_tiny_model(args.out, size=args.size, seed=args.seed)
    print(f"wrote {args.arch} ({args.size}, seed {args.seed}) to {args.out}")


if __name__ == "__main__":
    main()
