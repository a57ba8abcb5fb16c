"""Export a LoRA adapter of a rayflow checkpoint in diffusers' LoRA format.

    python tools/export_lora.py CKPT --out DIR [--adapter default|old|ema]

CKPT is a checkpoint directory (outputs/<run>/checkpoints/step_00000100) or a run's checkpoints
directory (its newest is taken). DIR then loads with the model family's own pipeline,
`<Pipeline>.from_pretrained(BASE).load_lora_weights(DIR)` (QwenImagePipeline, StableDiffusion3Pipeline,
FluxPipeline), and with `tools/generate.py --lora DIR`.
"""

from __future__ import annotations

import argparse

from rayflow.checkpoint import export_lora, find_checkpoint, read_meta
from rayflow.learner.lora import EMA_ADAPTER, EVAL_EMA_ADAPTER, TRAINED_ADAPTER


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a directory of them (the newest is used)")
    parser.add_argument("--out", required=True, help="output directory for the diffusers LoRA")
    parser.add_argument(
        "--adapter", default=TRAINED_ADAPTER, choices=(TRAINED_ADAPTER, EMA_ADAPTER, EVAL_EMA_ADAPTER),
        help='"default" (the trained policy), "old" (DiffusionNFT\'s EMA, what it rolls out under) or '
             '"ema" (the EMA of trainer.ema_decay, flow_grpo\'s train.ema)',
    )
    args = parser.parse_args(argv)
    try:
        path = find_checkpoint(args.checkpoint)
        meta = read_meta(path)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    if args.adapter not in meta["adapters"]:
        parser.error(f"--adapter {args.adapter}: {path} has adapters {meta['adapters']}")
    export_lora(path, args.out, args.adapter)
    print(f"wrote the {args.adapter!r} adapter of {path} (step {meta['step']}) to {args.out}")


if __name__ == "__main__":
    main()
