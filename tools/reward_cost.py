"""CPU cost per image of the built-in rewards, on 64×64 images (the size the tiny recipes train at or above).

    python tools/reward_cost.py [--images 16] [--threads 1]

Model-based rewards run their real architecture: `ocr` the PP-OCRv4 models of rapidocr-onnxruntime;
`clip_score` and `aesthetic` a CLIP ViT-L/14 built from its config with random weights (the cost of
openai/clip-vit-large-patch14, which is not downloaded here). Server rewards (http, vlm_judge) cost
what their server does and are not measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayflow.rewards import make_reward  # noqa: E402
from rayflow.rewards.clip import AESTHETIC_WEIGHTS, aesthetic_mlp  # noqa: E402


def text_images(n: int, size: int = 64) -> torch.Tensor:
    out = []
    for i in range(n):
        image = Image.new("RGB", (size, size), (255, 255 - 10 * i % 255, 255))
        ImageDraw.Draw(image).text((size // 2, size // 2), "OPEN", fill="black",
                                   font=ImageFont.load_default(size=size // 4), anchor="mm")
        out.append(np.asarray(image))
    return torch.from_numpy(np.stack(out))


def vit_l14_dir(root: str) -> str:
    """openai/clip-vit-large-patch14's architecture, random weights, its processor, an aesthetic head."""
    from safetensors.torch import save_file
    from tokenizers import pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    import json

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    with open(f"{root}/vocab.json", "w") as f:
        json.dump(vocab, f)
    with open(f"{root}/merges.txt", "w") as f:
        f.write("#version: 0.2\n")
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=CLIPTokenizer(f"{root}/vocab.json", f"{root}/merges.txt"))
    processor.save_pretrained(root)
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, eos_token_id=len(vocab) - 1),
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                           image_size=224, patch_size=14),
        projection_dim=768,
    )
    CLIPModel(config).save_pretrained(root)
    save_file({f"layers.{k}": v for k, v in aesthetic_mlp(768).state_dict().items()}, f"{root}/{AESTHETIC_WEIGHTS}")
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for flag, value in (("--images", args.images), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag}: got {value}; allowed: an integer >= 1")
    torch.set_num_threads(args.threads)
    images = text_images(args.images)
    prompts = ['a sign that says "OPEN" in red'] * args.images
    with tempfile.TemporaryDirectory() as root:
        clip_dir = vit_l14_dir(root)
        rewards = {
            "color": make_reward("color"),
            "jpeg_compressibility": make_reward("jpeg_compressibility"),
            "ocr": make_reward("ocr"),
            "clip_score": make_reward("clip_score", path=clip_dir),
            "aesthetic": make_reward("aesthetic", path=clip_dir),
        }
        print(f"| reward | ms per image ({args.images} images of 64×64, {args.threads} thread(s), best of 3) |")
        print("|---|---|")
        for name, reward in rewards.items():
            reward(images[:2], prompts[:2])  # warm-up
            best = min(_timed(reward, images, prompts) for _ in range(3))
            print(f"| `{name}` | {1000 * best / args.images:.1f} |", flush=True)


def _timed(reward, images, prompts) -> float:
    start = time.perf_counter()
    reward(images, prompts)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
