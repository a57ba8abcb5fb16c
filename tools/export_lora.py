"""Export the trained weights of a rayflow checkpoint for diffusers: a LoRA adapter in diffusers' LoRA format
(learner.train_mode=lora), or the whole transformer as a diffusers model directory (learner.train_mode=full).

    python tools/export_lora.py CKPT --out DIR [--adapter default|old|ema]

Without --adapter it writes what flow_grpo and DiffusionNFT save as a checkpoint: the EMA of trainer.ema_decay
("ema", their train.ema) when the checkpoint holds one, else the trained weights ("default").

CKPT is a checkpoint directory (outputs/<run>/checkpoints/step_00000100) or a run's checkpoints
directory (its newest is taken). A LoRA DIR then loads with the model family's own pipeline,
`<Pipeline>.from_pretrained(BASE).load_lora_weights(DIR)` (QwenImagePipeline, StableDiffusion3Pipeline,
FluxPipeline), and with `tools/generate.py --lora DIR`. A transformer DIR (what `save_pretrained` writes)
replaces the base model's transformer:

    pipe = QwenImagePipeline.from_pretrained(BASE, transformer=QwenImageTransformer2DModel.from_pretrained(DIR))
"""

from __future__ import annotations

import argparse

from rayflow.checkpoint import find_checkpoint, read_meta
from rayflow.export import export_lora, export_transformer, saved_adapter
from rayflow.models.lora import EMA_ADAPTER, EVAL_EMA_ADAPTER, TRAINED_ADAPTER


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a directory of them (the newest is used)")
    parser.add_argument("--out", required=True, help="output directory for the diffusers LoRA (or transformer)")
    parser.add_argument(
        "--adapter", default=None, choices=(TRAINED_ADAPTER, EMA_ADAPTER, EVAL_EMA_ADAPTER),
        help='"default" (the trained policy), "old" (DiffusionNFT\'s EMA, what it rolls out under) or '
             '"ema" (the EMA of trainer.ema_decay, flow_grpo\'s and DiffusionNFT\'s train.ema); of a full fine-tuning '
             'checkpoint, those weights. Default: "ema" when the checkpoint holds it, else "default"',
    )
    args = parser.parse_args(argv)
    try:
        path = find_checkpoint(args.checkpoint)
        meta = read_meta(path)
        args.adapter = args.adapter or saved_adapter(meta["adapters"])
        if args.adapter not in meta["adapters"]:
            raise ValueError(f"--adapter {args.adapter}: {path} has adapters {meta['adapters']}")
        export = export_transformer if meta.get("sharded") else export_lora
        export(path, args.out, args.adapter)
    except (OSError, ValueError) as e:  # OSError: also an --out that is a file
        parser.error(str(e))
    what = "transformer" if meta.get("sharded") else "adapter"
    print(f"wrote the {args.adapter!r} {what} of {path} (step {meta['step']}) to {args.out}")


if __name__ == "__main__":
    main()
