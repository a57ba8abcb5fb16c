"""Pretrain the shapes base from scratch, deterministically, on CPU: a small Qwen-Image (the real diffusers
classes, rayflow.models.shapes) on rendered scenes of the shapes world (rayflow.worlds.shapes).

    python tools/pretrain_shapes.py --out models/shapes-qwen-image [--seed 0]

1. The VAE learns to reconstruct rendered scenes as a plain autoencoder (the posterior's mode: sampled
   latents drown a young decoder in noise), shape pixels weighted above the background.
2. Its latents of a pool of scenes are normalised per channel (written to the VAE config as
   latents_mean / latents_std, which the pipeline undoes before decoding).
3. The transformer learns the flow-matching velocity (noise − latents) at uniform sigmas, the prompt
   dropped to the negative prompt " " for 10% of samples so that CFG has an unconditional branch, on scenes
   drawn with two-object and relation prompts four times as often as single objects and positions (binding two
   objects is what a small model learns last), its learning rate decayed to 0 along a cosine after warm-up.
The text encoder keeps its random weights (frozen). Weights are saved in float16 (a few MB) with a
manifest of sha256 digests (rayflow_shapes.json) that rayflow checks before using the base.
"""

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayflow.checkpoint_integrity import sha256_file  # noqa: E402
from rayflow.models.base import PromptEmbeds  # noqa: E402
from rayflow.models.shapes import MANIFEST, SHAPES_SPEC, build_shapes_pipeline  # noqa: E402
from rayflow.worlds.shapes import BACKGROUND, CATEGORIES, render, sample_scene  # noqa: E402

BACKGROUND_PIXEL = (torch.tensor(BACKGROUND, dtype=torch.float32) / 127.5 - 1.0).view(1, 3, 1, 1, 1)
UNCONDITIONAL = " "
"""The recipes' negative prompt: the prompt of the unconditional branch."""


@dataclass(frozen=True)
class PretrainConfig:
    seed: int = 0
    """Weights, scenes, noise and sigmas all follow from it."""
    vae_steps: int = 1800
    vae_batch: int = 8
    vae_lr: float = 2e-3
    vae_shape_weight: float = 5.0
    """Weight of a shape's pixels in the reconstruction loss (the background's is 1)."""
    steps: int = 7000
    """Transformer steps."""
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 50
    pool: int = 8192
    """Scenes whose latents the transformer trains on (scene i comes from seed i)."""
    pool_categories: tuple[str, ...] = ("single", "colour", "counting", "counting", *("two_objects",) * 4, "position",
                                        *("relation",) * 4)
    """The pool's scene categories, drawn uniformly from this list (the VAE's scenes: every category alike)."""
    cfg_dropout: float = 0.1


def scene_batch(first: int, n: int, categories: tuple[str, ...] = CATEGORIES) -> tuple[torch.Tensor, list[str]]:
    """Scenes first .. first+n−1 of `categories` -> (images [n, 3, 1, 64, 64] in [−1, 1], their prompts)."""
    prompts, images = [], []
    for seed in range(first, first + n):
        prompt, scene = sample_scene(seed, categories)
        prompts.append(prompt)
        images.append(render(scene))
    pixels = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [n, 3, 64, 64]
    return pixels[:, :, None], prompts


def train_vae(vae, cfg: PretrainConfig, steps: int) -> list[float]:
    """Reconstruction training on fresh scenes (batch k is scenes k·B .. (k+1)·B−1); the loss of each step."""
    torch.manual_seed(cfg.seed)
    vae.train().requires_grad_(True)
    opt = torch.optim.Adam(vae.parameters(), lr=cfg.vae_lr)
    losses = []
    for step in range(steps):
        pixels, _ = scene_batch(step * cfg.vae_batch, cfg.vae_batch)
        recon = vae.decode(vae.encode(pixels).latent_dist.mode()).sample
        # Shapes cover under a tenth of the pixels: unweighted, predicting the background is a deep minimum.
        weight = 1.0 + (cfg.vae_shape_weight - 1.0) * (pixels - BACKGROUND_PIXEL).abs().amax(dim=1, keepdim=True).gt(0.1)
        loss = (weight * (recon - pixels).pow(2)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"vae step {step}: loss {loss.item():.5f}", flush=True)
    vae.eval().requires_grad_(False)
    return losses


@torch.no_grad()
def encode_pool(pipe, n: int, categories: tuple[str, ...]) -> tuple[torch.Tensor, list[str]]:
    """Scenes 0 .. n−1 of `categories` -> (normalised packed latents [n, N, 4·z], prompts); sets the VAE's
    latents_mean/std."""
    latents, prompts = [], []
    for first in range(0, n, 256):
        pixels, batch_prompts = scene_batch(first, min(256, n - first), categories)
        latents.append(pipe.vae.encode(pixels).latent_dist.mode()[:, :, 0])  # [b, z, 16, 16]
        prompts += batch_prompts
    z = torch.cat(latents)  # [n, z, 16, 16]
    mean, std = z.mean(dim=(0, 2, 3)), z.std(dim=(0, 2, 3))
    pipe.vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    z = (z - mean[:, None, None]) / std[:, None, None]
    return pipe._pack_latents(z, n, z.shape[1], z.shape[2], z.shape[3]), prompts


@torch.no_grad()
def prompt_embeddings(pipe, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Each distinct prompt (and the unconditional one) -> its unpadded text embedding [L, D]."""
    distinct = sorted(set(prompts) | {UNCONDITIONAL})
    return {p: pipe.encode_prompt(prompt=[p], device="cpu")[0][0] for p in distinct}


def train_transformer(pipe, latents: torch.Tensor, prompts: list[str], cfg: PretrainConfig, steps: int) -> list[float]:
    """Flow matching on the pool (batch k is pool items k·B .. (k+1)·B−1, cyclically); the loss of each step."""
    embeds = prompt_embeddings(pipe, prompts)
    transformer = pipe.transformer.train().requires_grad_(True)
    torch.manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(transformer.parameters(), lr=cfg.lr, weight_decay=0.0)
    # Decayed to 0: a constant rate left the base drawing two objects' colours and shapes mixed up far more often.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    n, tokens = latents.shape[0], latents.shape[1]
    side = int(tokens**0.5)
    losses = []
    for step in range(steps):
        index = torch.arange(step * cfg.batch, (step + 1) * cfg.batch) % n
        x0 = latents[index]  # [B, N, C]
        noise = torch.randn(x0.shape, generator=gen)
        sigma = torch.rand(cfg.batch, generator=gen)  # [B]
        dropped = torch.rand(cfg.batch, generator=gen) < cfg.cfg_dropout
        cond = PromptEmbeds.pad([embeds[UNCONDITIONAL if d else prompts[i]] for i, d in zip(index.tolist(), dropped)])
        xt = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
        velocity = transformer(
            hidden_states=xt, timestep=sigma, encoder_hidden_states=cond.embeds,
            encoder_hidden_states_mask=cond.mask, img_shapes=[[(1, side, side)]] * cfg.batch, return_dict=False,
        )[0]
        loss = (velocity - (noise - x0)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"transformer step {step}: loss {loss.item():.5f}", flush=True)
    transformer.eval().requires_grad_(False)
    return losses


def save(pipe, out: str, cfg: PretrainConfig, seconds: float, cpu_seconds: float) -> None:
    """Save in float16 to a temporary directory beside `out`, write the manifest, then rename into place."""
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.to(torch.float16).save_pretrained(tmp)
    files = [os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs]
    manifest = {
        "config": asdict(cfg), "spec": asdict(SHAPES_SPEC), "pretrain_seconds": round(seconds), "pretrain_cpu_seconds": round(cpu_seconds),
        "files": {name: sha256_file(os.path.join(tmp, name)) for name in sorted(files)},
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=PretrainConfig.seed)
    parser.add_argument("--vae-steps", type=int, default=PretrainConfig.vae_steps)
    parser.add_argument("--steps", type=int, default=PretrainConfig.steps, help="transformer steps")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # on a shared 2-core machine one thread each trains faster than two fighting
    cfg = PretrainConfig(seed=args.seed, vae_steps=args.vae_steps, steps=args.steps)
    start, cpu_start = time.perf_counter(), time.process_time()
    pipe = build_shapes_pipeline(cfg.seed)
    train_vae(pipe.vae, cfg, cfg.vae_steps)
    latents, prompts = encode_pool(pipe, cfg.pool, cfg.pool_categories)
    train_transformer(pipe, latents, prompts, cfg, cfg.steps)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    save(pipe, args.out, cfg, seconds, cpu_seconds)
    print(f"wrote the shapes base to {args.out} in {seconds:.0f} s ({cpu_seconds:.0f} CPU s)")


if __name__ == "__main__":
    main()
