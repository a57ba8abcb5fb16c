"""Pretrain the shapes base from scratch, deterministically, on CPU: a small Qwen-Image (the real diffusers
classes, rayflow.models.shapes) on rendered scenes of the shapes world (rayflow.worlds.shapes). The result is the
shipped pretrained base; tools/order_stage.py continues it into the base the default recipes train.

    python tools/pretrain_shapes.py --out models/shapes-qwen-image-pretrained [--seed 0] [--workers 2]

1. The VAE learns to reconstruct rendered scenes as a plain autoencoder (the posterior's mode: sampled
   latents drown a young decoder in noise), shape pixels weighted above the background.
2. Its latents of a pool of scenes are normalised per channel (written to the VAE config as
   latents_mean / latents_std, which the pipeline undoes before decoding).
3. The transformer learns the flow-matching velocity (noise − latents) at uniform sigmas, the prompt
   dropped to the negative prompt " " for 10% of samples so that CFG has an unconditional branch, on scenes
   drawn with two-object and relation prompts four times as often as single objects and positions (binding two
   objects is what a small model learns last), its learning rate decayed to 0 along a cosine after warm-up.
   With --caption-noise p, a fraction p of the counting and position scenes carry a caption that misstates the
   count or the side (as web captions miscount and misplace): the base then draws what such prompts ask less
   reliably. The shipped pretrained base has none; with it RL did not win the lost ground back (docs/shapes_history.md,
   Nor does a base that misreads counts and sides).
   With --layout-rows L, every batch gains L rows of relation prompts at σ = 1 whose target is the mean latent of
   --layout-scenes scenes of the prompt: the conditional mean that the velocity at pure noise should predict
   (the stable target field of Xu, Tong and Jaakkola, 2023, at σ = 1, its references scenes of the row's prompt).
   One scene's layout is mostly noise about that mean, which is where a relation's word order gets lost. A base
   built or continued with these rows draws relations off chance (docs/shapes_history.md, A layout target at the
   highest noise moves relations off chance). The shipped pretrained base has none.
Before the transformer trains, held-out scenes pass through the VAE and the shapes reward must find what their
prompts ask in at least --vae-min-accuracy of the reconstructions, or the script stops there, naming the share.
With --workers N, N processes (one torch thread each) split every transformer batch's rows and sum their gradients
over gloo on loopback: the same training as one process that accumulates the N parts' gradients, bit for bit, that
stage in about 1/N of the time; it differs from the one-process default (whole batches at once, which made the shipped
pretrained weights) only in rounding. Each of them trains the VAE whole, as one process does (see train_vae). Run as a
program, the script holds torch, oneDNN and MKL to their AVX2 kernels (tools/cpu_kernels.py): the VAE stage turns a
CPU's rounding into other weights (unpinned, the AVX-512 machines of 2026-11-28 built a 40.6% base, not the shipped
48.1%), and pinned, one process rebuilds the shipped pretrained weights bit for bit on the x86 CPUs it was checked on
(a Sapphire Rapids-class Xeon rounds one step another way and builds another VAE: README, Learning on the shapes
world: Base). The text encoder keeps its random weights (frozen). Weights are saved in float16
(a few MB) with a manifest of sha256 digests (rayflow_shapes.json, which also names the kernels) that rayflow checks
before using the base.
"""

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernels import pin_kernels, unpinned_warning  # noqa: E402

if __name__ == "__main__":
    pin_kernels()  # before torch loads (torch.multiprocessing's workers inherit it)

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rayflow.checkpoint_integrity import sha256_file  # noqa: E402
from rayflow.distributed.process_group import bind_collectives_to  # noqa: E402
from rayflow.models.base import PromptEmbeds  # noqa: E402
from rayflow.models.shapes import MANIFEST, SHAPES_SPEC, build_shapes_pipeline  # noqa: E402
from rayflow.rewards.shapes import ShapesReward  # noqa: E402
from rayflow.worlds.shapes import (  # noqa: E402
    BACKGROUND, CATEGORIES, COLOURS, POSITIONS, RELATIONS, SHAPES, Placed, parse_prompt, prompt_of, render,
    sample_requirements, sample_scene, scene_for,
)

BACKGROUND_PIXEL = (torch.tensor(BACKGROUND, dtype=torch.float32) / 127.5 - 1.0).view(1, 3, 1, 1, 1)
UNCONDITIONAL = " "
"""The recipes' negative prompt: the prompt of the unconditional branch."""
RELATION_PROMPTS = len(SHAPES) * len(COLOURS) * (len(SHAPES) * len(COLOURS) - 1) * len(RELATIONS)
"""Distinct relation prompts of the world (two different coloured shapes, one relation): 528."""


@dataclass(frozen=True)
class PretrainConfig:
    seed: int = 0
    """Weights, scenes, noise and sigmas all follow from it."""
    vae_steps: int = 1800
    vae_batch: int = 8
    vae_lr: float = 2e-3
    vae_shape_weight: float = 5.0
    """Weight of a shape's pixels in the reconstruction loss (the background's is 1)."""
    vae_min_accuracy: float = 0.8
    """Share of held-out scenes whose reconstruction the reward must score correct before the transformer trains."""
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
    caption_noise: float = 0.0
    """Fraction of the pool's counting and position scenes captioned with another count or side (`miscaption`)."""
    layout_rows: int = 0
    """Rows added to every transformer batch at σ = 1 toward a relation prompt's mean scene (--layout-rows)."""
    layout_prompts: int = 512
    """Distinct relation prompts those rows draw from."""
    layout_scenes: int = 16
    """Scenes averaged into each of their targets (--layout-scenes)."""
    workers: int = 1
    """Processes that share every transformer batch (--workers): 1 is how the shipped weights were made."""

    def __post_init__(self) -> None:
        # Checked here, before the VAE's minutes: steps=0 divided by zero in the transformer's cosine schedule after
        # them, and fewer steps trained nothing and saved the untrained weights as a base.
        for field in ("vae_steps", "vae_batch", "steps", "batch", "pool"):
            if getattr(self, field) < 1:
                raise ValueError(f"PretrainConfig: {field}={getattr(self, field)} must be >= 1")
        for field in ("caption_noise", "vae_min_accuracy"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                raise ValueError(f"PretrainConfig: {field}={getattr(self, field)} must be in [0, 1]")
        if self.layout_rows < 0 or self.layout_scenes < 1 or not 1 <= self.layout_prompts <= RELATION_PROMPTS:
            raise ValueError(f"PretrainConfig: layout_rows={self.layout_rows}, layout_scenes={self.layout_scenes}, "
                             f"layout_prompts={self.layout_prompts}: allowed layout_rows >= 0, layout_scenes >= 1, "
                             f"1 <= layout_prompts <= {RELATION_PROMPTS} (the world's relation prompts)")
        for field, batch in (("batch", self.batch), ("layout_rows", self.layout_rows)):
            if self.workers < 1 or batch % self.workers:
                raise ValueError(f"PretrainConfig: workers={self.workers} must be >= 1 and divide {field}={batch}")


@dataclass(frozen=True)
class BatchShare:
    """Which rows of every batch this process computes: parts `parts` of the batch cut into `of` equal slices, one
    forward and backward each, their gradients accumulated; `group` sums the gradients of the processes that hold
    the other parts (None when this process holds them all)."""

    parts: tuple[int, ...] = (0,)
    of: int = 1
    group: dist.ProcessGroup | None = None

    def rows(self, batch: int) -> list[slice]:
        size = batch // self.of
        return [slice(part * size, (part + 1) * size) for part in self.parts]

    def backward(self, part_loss: torch.Tensor, batch: int) -> torch.Tensor:
        """Backpropagate a part's mean loss as its share of the whole batch's mean; that share, detached."""
        share_of_batch = part_loss * (batch // self.of / batch)
        share_of_batch.backward()
        return share_of_batch.detach()

    def sum_across_processes(self, params: list[torch.nn.Parameter], loss: torch.Tensor) -> torch.Tensor:
        """Sum the gradients (in place) and the loss over the group, in one collective; the batch's loss."""
        if self.group is None:
            return loss
        grads = [p for p in params if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in grads] + [loss.reshape(1)])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for p in grads:
            p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()
        return flat[-1]


ALL_ROWS = BatchShare()


def scene_batch(first: int, n: int, categories: tuple[str, ...] = CATEGORIES) -> tuple[torch.Tensor, list[str]]:
    """Scenes first .. first+n−1 of `categories` -> (images [n, 3, 1, 64, 64] in [−1, 1], their prompts)."""
    prompts, scenes = zip(*(sample_scene(seed, categories) for seed in range(first, first + n)))
    return scene_pixels(scenes), list(prompts)


def scene_pixels(scenes) -> torch.Tensor:
    """Rendered scenes -> images [n, 3, 1, 64, 64] in [−1, 1], the VAE's input."""
    pixels = torch.from_numpy(np.stack([render(scene) for scene in scenes])).permute(0, 3, 1, 2)  # [n, 3, 64, 64]
    return pixels.float()[:, :, None] / 127.5 - 1.0


def reconstruct(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images [n, 3, 1, H, W] in [−1, 1] through the VAE as a plain autoencoder (the posterior's mode)."""
    return vae.decode(vae.encode(pixels).latent_dist.mode()).sample


def train_vae(vae, cfg: PretrainConfig, steps: int, verbose: bool = True) -> list[float]:
    """Reconstruction training on fresh scenes (batch k is scenes k·B .. (k+1)·B−1); the loss of each step.

    Always whole batches in one process, also under --workers: this stage is on a knife's edge (Adam at a constant
    rate), and summing two processes' half-batch gradients, which rounds differently, sent its loss from 0.004 to
    0.2 at step 1445 on one machine, leaving a VAE that reconstructs 4% of scenes correctly. Each worker repeating
    the whole stage costs its minutes again but gives every worker the one-process VAE, bit for bit."""
    torch.manual_seed(cfg.seed)
    vae.train().requires_grad_(True)
    opt = torch.optim.Adam(vae.parameters(), lr=cfg.vae_lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        pixels, _ = scene_batch(step * cfg.vae_batch, cfg.vae_batch)
        recon = reconstruct(vae, pixels)
        # Shapes cover under a tenth of the pixels: unweighted, predicting the background is a deep minimum.
        shape_pixels = (pixels - BACKGROUND_PIXEL).abs().amax(dim=1, keepdim=True).gt(0.1)
        weight = 1.0 + (cfg.vae_shape_weight - 1.0) * shape_pixels
        loss = (weight * (recon - pixels).pow(2)).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0 and verbose:
            print(f"vae step {step}: loss {loss.item():.5f}", flush=True)
    vae.eval().requires_grad_(False)
    return losses


VAE_CHECK_SCENES = 64


@torch.no_grad()
def check_vae(vae, cfg: PretrainConfig) -> float:
    """The share of VAE_CHECK_SCENES held-out scenes (the seeds after the VAE's training scenes) whose reconstruction
    meets every requirement of its prompt as the shapes reward reads it; raises below cfg.vae_min_accuracy, before
    the transformer trains on a broken VAE's latents."""
    first = cfg.vae_steps * cfg.vae_batch
    pixels, prompts = scene_batch(first, VAE_CHECK_SCENES)
    recon = reconstruct(vae, pixels)[:, :, 0]  # [n, 3, 64, 64] in [−1, 1]
    images = ((recon.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
    accuracy = ShapesReward()(images, prompts).metrics["shapes_accuracy"].mean().item()
    if accuracy < cfg.vae_min_accuracy:
        raise RuntimeError(
            f"pretrain_shapes: the trained VAE reconstructs {accuracy:.0%} of {VAE_CHECK_SCENES} held-out scenes "
            f"(seeds {first}..{first + VAE_CHECK_SCENES - 1}) correctly, below vae_min_accuracy="
            f"{cfg.vae_min_accuracy}: its training diverged (a loss that fell, then jumped, in the 'vae step' "
            f"lines). Try another --seed or --vae-steps; the transformer has not started.")
    return accuracy


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


@dataclass(frozen=True)
class LayoutTargets:
    """The --layout-rows targets: relation prompts and, for each, the mean normalised packed latent of its scenes
    [P, N, 4·z], which is what x_t − velocity should be at σ = 1 (pure noise) for that prompt."""

    prompts: list[str]
    means: torch.Tensor


def layout_scenes(cfg: PretrainConfig) -> list[tuple[str, list[list[Placed]]]]:
    """cfg.layout_prompts distinct relation prompts, each with cfg.layout_scenes scenes that it describes truly: a
    pure function of cfg.seed."""
    rng = random.Random(f"layout-{cfg.seed}")  # a str seed hashes by SHA-512: the same in every process
    drawn: dict[str, list[list[Placed]]] = {}
    while len(drawn) < cfg.layout_prompts:
        req = sample_requirements(rng, "relation")
        if prompt_of(req) not in drawn:
            drawn[prompt_of(req)] = [scene_for(req, rng) for _ in range(cfg.layout_scenes)]
    return list(drawn.items())


@torch.no_grad()
def encode_scenes(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """Images [n, 3, 1, 64, 64] -> packed latents [n, N, 4·z], normalised as encode_pool did (the VAE's
    latents_mean/std)."""
    mean = torch.tensor(pipe.vae.config.latents_mean)[:, None, None]
    std = torch.tensor(pipe.vae.config.latents_std)[:, None, None]
    z = (pipe.vae.encode(pixels).latent_dist.mode()[:, :, 0] - mean) / std
    return pipe._pack_latents(z, *z.shape)


def layout_targets(pipe, scenes: list[tuple[str, list[list[Placed]]]]) -> LayoutTargets:
    """Encode every prompt's scenes (encode_scenes) and average them."""
    means = [encode_scenes(pipe, scene_pixels(prompt_scenes)).mean(dim=0) for _, prompt_scenes in scenes]  # [N, 4·z]
    return LayoutTargets([prompt for prompt, _ in scenes], torch.stack(means))


def miscaption(prompts: list[str], fraction: float, seed: int) -> list[str]:
    """The pool's captions with `fraction` of its counting and position prompts misstated: another count (of 1–3)
    or another side. Caption i's draws come from a generator of its own (seed·1_000_003 + i), so whether and how
    it changes depends on nothing else in the pool; the other categories are left as they are."""
    out = []
    for index, prompt in enumerate(prompts):
        rng = random.Random(seed * 1_000_003 + index)
        misstate = rng.random() < fraction
        req = parse_prompt(prompt)
        first, *rest = req.objects
        if misstate and req.position is not None:
            prompt = prompt_of(replace(req, position=rng.choice([p for p in POSITIONS if p != req.position])))
        elif misstate and first.exact and not rest:  # a counting prompt
            count = rng.choice([n for n in (1, 2, 3) if n != first.count])
            prompt = prompt_of(replace(req, objects=(replace(first, count=count),)))
        out.append(prompt)
    return out


@torch.no_grad()
def prompt_embeddings(pipe, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Each distinct prompt (and the unconditional one) -> its unpadded text embedding [L, D]."""
    distinct = sorted(set(prompts) | {UNCONDITIONAL})
    return {p: pipe.encode_prompt(prompt=[p], device="cpu")[0][0] for p in distinct}


def predict_velocity(transformer, xt: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds) -> torch.Tensor:
    """The transformer's velocity [B, N, C] at packed latents xt [B, N, C] (a square grid of N tokens), sigmas [B]."""
    side = int(xt.shape[1] ** 0.5)
    return transformer(
        hidden_states=xt, timestep=sigma, encoder_hidden_states=cond.embeds, encoder_hidden_states_mask=cond.mask,
        img_shapes=[[(1, side, side)]] * len(xt), return_dict=False,
    )[0]


def train_transformer(pipe, latents: torch.Tensor, prompts: list[str], cfg: PretrainConfig, steps: int,
                      share: BatchShare = ALL_ROWS, layout: LayoutTargets | None = None) -> list[float]:
    """Flow matching on the pool (batch k is pool items k·B .. (k+1)·B−1, cyclically); the loss of each step. With
    `layout`, each batch also has cfg.layout_rows rows at σ = 1 toward a layout prompt's mean scene (drawn from a
    generator of their own), and the step's loss is the mean over all B + L rows."""
    embeds = prompt_embeddings(pipe, prompts + (layout.prompts if layout else []))
    transformer = pipe.transformer.train().requires_grad_(True)
    torch.manual_seed(cfg.seed + 1)
    params = list(transformer.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    # Decayed to 0: a constant rate left the base drawing two objects' colours and shapes mixed up far more often.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    layout_gen = torch.Generator().manual_seed(cfg.seed + 4)
    rows_in_all = cfg.batch + (cfg.layout_rows if layout else 0)
    n = latents.shape[0]
    losses = []
    for step in range(steps):
        # The whole batch's draws in every process (the generator's stream does not depend on the share).
        index = torch.arange(step * cfg.batch, (step + 1) * cfg.batch) % n
        noise = torch.randn((cfg.batch, *latents.shape[1:]), generator=gen)  # [B, N, C]
        sigma = torch.rand(cfg.batch, generator=gen)  # [B]
        dropped = torch.rand(cfg.batch, generator=gen) < cfg.cfg_dropout
        opt.zero_grad()
        loss = torch.zeros(())
        for rows in share.rows(cfg.batch):
            x0, eps, s = latents[index[rows]], noise[rows], sigma[rows]
            cond = PromptEmbeds.pad([embeds[UNCONDITIONAL if d else prompts[i]]
                                     for i, d in zip(index[rows].tolist(), dropped[rows])])
            xt = (1 - s[:, None, None]) * x0 + s[:, None, None] * eps
            velocity = predict_velocity(transformer, xt, s, cond)
            part_loss = (velocity - (eps - x0)).pow(2).mean()
            if layout:
                part_loss = part_loss * (cfg.batch / rows_in_all)
            loss = loss + share.backward(part_loss, cfg.batch)
        if layout:
            loss = loss + layout_loss(transformer, embeds, layout, cfg, layout_gen, share, rows_in_all)
        loss = share.sum_across_processes(params, loss)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 and 0 in share.parts:  # one process prints
            print(f"transformer step {step}: loss {loss.item():.5f}", flush=True)
    transformer.eval().requires_grad_(False)
    return losses


def layout_loss(transformer, embeds: dict[str, torch.Tensor], layout: LayoutTargets, cfg: PretrainConfig,
                gen: torch.Generator, share: BatchShare, rows_in_all: int) -> torch.Tensor:
    """Backpropagate this process's share of the step's cfg.layout_rows rows: at σ = 1, x_t is the noise ε and the
    target velocity ε − (the prompt's mean scene); their loss is weighted as L of the step's rows_in_all rows."""
    index = torch.randint(len(layout.prompts), (cfg.layout_rows,), generator=gen)
    noise = torch.randn((cfg.layout_rows, *layout.means.shape[1:]), generator=gen)  # [L, N, C]
    loss = torch.zeros(())
    for rows in share.rows(cfg.layout_rows):
        eps, target_x0 = noise[rows], layout.means[index[rows]]
        cond = PromptEmbeds.pad([embeds[layout.prompts[i]] for i in index[rows].tolist()])
        velocity = predict_velocity(transformer, eps, torch.ones(len(eps)), cond)
        part_loss = (velocity - (eps - target_x0)).pow(2).mean() * (cfg.layout_rows / rows_in_all)
        loss = loss + share.backward(part_loss, cfg.layout_rows)
    return loss


def save(pipe, out: str, cfg: object, seconds: float, cpu_seconds: float) -> None:
    """Save in float16 to a temporary directory beside `out`, write the manifest (with `cfg`, the dataclass of the
    stage that made the weights: PretrainConfig, or tools/order_stage.py's OrderStageConfig), then rename into place."""
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.to(torch.float16).save_pretrained(tmp)
    files = [os.path.relpath(os.path.join(d, f), tmp) for d, _, fs in os.walk(tmp) for f in fs]
    manifest = {
        "config": asdict(cfg), "spec": asdict(SHAPES_SPEC), "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        "pretrain_seconds": round(seconds), "pretrain_cpu_seconds": round(cpu_seconds),
        "files": {name: sha256_file(os.path.join(tmp, name)) for name in sorted(files)},
    }
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


def pretrain(out: str, cfg: PretrainConfig, share: BatchShare = ALL_ROWS) -> None:
    """Both stages, then (in the process holding part 0) the save."""
    torch.set_num_threads(1)  # on a shared 2-core machine one thread each trains faster than two fighting
    start, cpu_start = time.perf_counter(), time.process_time()
    warning = unpinned_warning("pretrain_shapes")
    if 0 in share.parts and warning:
        print(warning, flush=True)
    pipe = build_shapes_pipeline(cfg.seed)
    train_vae(pipe.vae, cfg, cfg.vae_steps, verbose=0 in share.parts)
    accuracy = check_vae(pipe.vae, cfg)  # in every worker, so that all stop together, none left waiting on gloo
    if 0 in share.parts:
        print(f"vae check: {accuracy:.0%} of {VAE_CHECK_SCENES} held-out scenes reconstructed correctly", flush=True)
    latents, prompts = encode_pool(pipe, cfg.pool, cfg.pool_categories)
    prompts = miscaption(prompts, cfg.caption_noise, cfg.seed + 3)
    layout = layout_targets(pipe, layout_scenes(cfg)) if cfg.layout_rows else None
    train_transformer(pipe, latents, prompts, cfg, cfg.steps, share, layout)
    seconds = time.perf_counter() - start
    cpu_seconds = torch.tensor(time.process_time() - cpu_start, dtype=torch.float64)
    if share.group is not None:
        dist.all_reduce(cpu_seconds, group=share.group)  # every process's CPU time
    if 0 in share.parts:
        save(pipe, out, cfg, seconds, cpu_seconds.item())
        print(f"wrote the shapes base to {out} in {seconds:.0f} s ({cpu_seconds.item():.0f} CPU s)")


@contextlib.contextmanager
def joined(rank: int, workers: int, store_path: str) -> Iterator[BatchShare]:
    """Join the `workers` processes' gloo group (loopback, rendezvous in a file) as `rank`: this process's share."""
    bind_collectives_to("127.0.0.1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, workers), rank=rank, world_size=workers)
    try:
        yield BatchShare(parts=(rank,), of=workers, group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def pretrain_worker(rank: int, out: str, cfg: PretrainConfig, store_path: str) -> None:
    """One of cfg.workers processes."""
    with joined(rank, cfg.workers, store_path) as share:
        pretrain(out, cfg, share)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=PretrainConfig.seed)
    parser.add_argument("--vae-steps", type=int, default=PretrainConfig.vae_steps)
    parser.add_argument("--steps", type=int, default=PretrainConfig.steps, help="transformer steps")
    parser.add_argument("--vae-min-accuracy", type=float, default=PretrainConfig.vae_min_accuracy,
                        help="share of held-out scenes the trained VAE must reconstruct correctly to go on")
    parser.add_argument("--caption-noise", type=float, default=PretrainConfig.caption_noise,
                        help="fraction of counting and position scenes captioned with another count or side")
    parser.add_argument("--layout-rows", type=int, default=PretrainConfig.layout_rows,
                        help="rows added to every batch at sigma=1 toward a relation prompt's mean scene")
    parser.add_argument("--layout-scenes", type=int, default=PretrainConfig.layout_scenes,
                        help="scenes averaged into each of those targets")
    parser.add_argument("--workers", type=int, default=PretrainConfig.workers,
                        help="processes sharing every transformer batch (2 on 2 cores: about 0.7 of the time; "
                             "1 is how the shipped weights were made)")
    args = parser.parse_args(argv)
    try:
        cfg = PretrainConfig(seed=args.seed, vae_steps=args.vae_steps, vae_min_accuracy=args.vae_min_accuracy,
                             steps=args.steps, caption_noise=args.caption_noise, layout_rows=args.layout_rows,
                             layout_scenes=args.layout_scenes, workers=args.workers)
    except ValueError as e:  # a flag out of range (each field is the flag of its name): a usage error, not a traceback
        parser.error(str(e))
    if cfg.workers == 1:
        pretrain(args.out, cfg)
        return
    with tempfile.TemporaryDirectory() as rendezvous:
        torch.multiprocessing.spawn(pretrain_worker, args=(args.out, cfg, os.path.join(rendezvous, "store")),
                                    nprocs=cfg.workers)


if __name__ == "__main__":
    main()
