"""Continue a shapes base with an order stage: teach it which object a relation prompt names first, and as little
else as it can.

    python tools/order_stage.py --base models/shapes-qwen-image-pretrained --out models/shapes-qwen-image \
        --exclude recipes/prompts/shapes_eval.txt [--steps 2000] [--seed 0] [--threads 2]

The pretrained base (tools/pretrain_shapes.py) is blind to a relation prompt's order: "a red triangle above a blue
circle" and "a blue circle above a red triangle" sample alike, and RL does not teach the difference in its budget
(README, Learning on the shapes world). This stage does, with supervised rows, and leaves the rest to RL. Each step
has `order_rows` order rows and `anchor_rows` anchor rows, AdamW at a constant learning rate:

- an order row: a relation prompt p of the world (none of --exclude's relation prompts' two objects on its axis, in
  either order or wording: held_out_arrangements), x₀ one of `scenes` scenes of p,
  σ ~ U(sigma_min, 1) (a quarter of the rows at σ = 1 exactly), x_t = (1 − σ)·x₀ + σ·ε, and the target velocity

      v* = v_base(x_t, p) + (x̄_q − x̄_p) / (2σ)

  where q is p with its two objects exchanged ("a blue circle above a red triangle"), and x̄_p is the stable target
  field over p's scenes (Xu, Tong and Jaakkola, 2023): x̄_p = Σ_j w_j·x₀_j, w = softmax_j(−‖x_t − (1 − σ)·x₀_j‖² / 2σ²);
  x̄_q likewise over q's. Since (x_t − x̄)/σ is the field's velocity, v* is the base's own velocity plus half the
  difference between the two orders' fields: what tells the orders apart, and none of what they share (drawing both
  objects), which stays as the base draws it;
- an anchor row: a scene of the pretraining pool at σ ~ U(0, 1) (half the rows at σ = 1), its target the base's
  velocity, so that prompts the stage does not teach keep what they had.

The loss is the order rows' mean squared error plus anchor_rows / order_rows times the anchor rows'. Every draw follows
from --seed. Run as a program, the script pins AVX2 kernels before torch loads (tools/cpu_kernels.py, as
tools/pretrain_shapes.py does); with the same --threads the result is then the same bit for bit (the shipped base is
this command's output from the shipped pretrained base, README: Learning on the shapes world). The base is read in
float32 and the result saved in float16 with a manifest (tools/pretrain_shapes.py's save), which records this stage's
config and the base's manifest digest.
"""

import argparse
import copy
import os
import random
import sys
import time
from dataclasses import dataclass, replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_kernels import pin_kernels, unpinned_warning  # noqa: E402

if __name__ == "__main__":
    pin_kernels()  # before torch loads, as tools/pretrain_shapes.py: the shipped base rebuilds bit for bit under them

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pretrain_shapes as ps  # noqa: E402
from rayflow.algorithms.diffusion_nft import noised  # noqa: E402
from rayflow.checkpoint_integrity import sha256_file  # noqa: E402
from rayflow.data.prompts import load_prompts  # noqa: E402
from rayflow.models.base import PromptEmbeds  # noqa: E402
from rayflow.models.shapes import MANIFEST, check_shapes_base  # noqa: E402
from rayflow.rewards.validation import check_prompt_file  # noqa: E402
from rayflow.worlds.shapes import RELATIONS, Requirements, parse_prompt, prompt_of, scene_for  # noqa: E402


@dataclass(frozen=True)
class OrderStageConfig:
    base: str
    """The base continued (its manifest's sha256 goes into the result's)."""
    base_manifest_sha256: str = ""
    exclude: tuple[str, ...] = ()
    """Relation prompts left out of the order rows: from the command line, every wording of each held-out evaluation
    prompt's two objects on its axis, in either order (held_out_arrangements)."""
    seed: int = 0
    steps: int = 2000
    order_rows: int = 32
    anchor_rows: int = 32
    lr: float = 3e-4
    sigma_min: float = 0.7
    """Order rows' σ ~ U(sigma_min, 1): where the layout of a sample is decided (at σ = 1 alone it does not reach the
    samples: docs/shapes_history.md, An order stage)."""
    scenes: int = 16
    """Scenes of each prompt (and of its swap) the target field weighs."""
    anchor_pool: int = 8192
    """Pretraining pool scenes the anchor rows draw from (tools/pretrain_shapes.py's pool)."""

    def __post_init__(self) -> None:
        for name in ("steps", "order_rows", "scenes", "anchor_pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"OrderStageConfig: {name}={getattr(self, name)} must be >= 1")
        if self.anchor_rows < 0 or self.lr <= 0 or not 0.0 <= self.sigma_min < 1.0:
            raise ValueError(f"OrderStageConfig: anchor_rows={self.anchor_rows}, lr={self.lr}, "
                             f"sigma_min={self.sigma_min}: allowed anchor_rows >= 0, lr > 0, 0 <= sigma_min < 1")


def swapped(req: Requirements) -> Requirements:
    """The relation prompt with its two objects exchanged: "a blue circle above a red triangle" for "a red triangle
    above a blue circle"."""
    return replace(req, objects=(req.objects[1], req.objects[0]))


def held_out_arrangements(req: Requirements) -> tuple[str, ...]:
    """Every relation prompt of `req`'s two objects along its axis, in either order and either wording: for "a red
    triangle above a blue circle", it, "a red triangle below a blue circle" and the two with the objects exchanged.
    Leaving these out holds the prompt out in the scenes it asks for (an order row's swap is its contrast, so the
    exchanged order would show them too), not only in its wording."""
    axis = RELATIONS[:2] if req.relation in RELATIONS[:2] else RELATIONS[2:]  # (above, below) or (left of, right of)
    return tuple(prompt_of(replace(r, relation=relation)) for r in (req, swapped(req)) for relation in axis)


def anchor_pool(pipe, n: int, chunk: int = 256) -> tuple[torch.Tensor, list[str]]:
    """Pretraining pool scenes 0 .. n−1 (tools/pretrain_shapes.py's) -> (latents [n, N, C], prompts)."""
    latents, prompts = [], []
    for first in range(0, n, chunk):
        pixels, batch_prompts = ps.scene_batch(first, min(chunk, n - first), ps.PretrainConfig.pool_categories)
        latents.append(ps.encode_scenes(pipe, pixels))
        prompts += batch_prompts
    return torch.cat(latents), prompts


def order_prompts(cfg: OrderStageConfig) -> list[tuple[str, list]]:
    """The order rows' relation prompts (every one of the world's but cfg.exclude's), each with `cfg.scenes` scenes."""
    layout = ps.layout_scenes(ps.PretrainConfig(seed=cfg.seed, layout_prompts=ps.RELATION_PROMPTS,
                                                layout_scenes=cfg.scenes))
    # By what the prompt asks, not its spelling: an --exclude line "A red triangle above a blue circle." holds out the
    # world's "a red triangle above a blue circle" (the same requirements to the reward, all but two tokens the same).
    exclude = {prompt_of(parse_prompt(p)) for p in cfg.exclude}
    return [(p, scenes) for p, scenes in layout if p not in exclude]


def order_scene_latents(pipe, cfg: OrderStageConfig) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The order rows' prompts and the latents of `cfg.scenes` scenes of each [P, S, N, C] and of its swap."""
    kept = order_prompts(cfg)
    rng = random.Random(f"order-swapped-{cfg.seed}")
    own = torch.stack([ps.encode_scenes(pipe, ps.scene_pixels(scenes)) for _, scenes in kept])
    other = torch.stack([ps.encode_scenes(pipe, ps.scene_pixels([scene_for(swapped(parse_prompt(p)), rng)
                                                                 for _ in range(cfg.scenes)]))
                         for p, _ in kept])
    return [p for p, _ in kept], own, other


def target_field(xt: torch.Tensor, sigma: torch.Tensor, scenes: torch.Tensor) -> torch.Tensor:
    """x̄ = Σ_j w_j·x₀_j with w = softmax_j(−‖x_t − (1 − σ)·x₀_j‖² / 2σ²): xt [B, N, C], sigma [B], scenes
    [B, S, N, C] -> [B, N, C]."""
    s = sigma[:, None, None, None]
    d2 = (xt[:, None] - (1 - s) * scenes).pow(2).flatten(2).sum(-1)  # [B, S]
    w = torch.softmax(-d2 / (2 * sigma[:, None] ** 2), dim=1)
    return (w[:, :, None, None] * scenes).sum(1)


def order_target(v_base: torch.Tensor, xt: torch.Tensor, sigma: torch.Tensor, own: torch.Tensor,
                 other: torch.Tensor) -> torch.Tensor:
    """v* = v_base + (x̄_other − x̄_own) / (2σ) [B, N, C]: the base's velocity plus half the difference between the
    prompt's field and its swap's."""
    diff = target_field(xt, sigma, other) - target_field(xt, sigma, own)
    return v_base + diff / (2 * sigma[:, None, None])


@dataclass
class StageScenes:
    """What the stage's rows are drawn from (stage_scenes): encoded once, before the first step."""

    prompts: list[str]
    """The order rows' relation prompts."""
    own: torch.Tensor
    """[P, S, N, C]: the latents of cfg.scenes scenes of each prompt."""
    other: torch.Tensor
    """[P, S, N, C]: those of its swap."""
    pool: torch.Tensor
    """[A, N, C]: the anchor rows' pretraining-pool scenes."""
    pool_prompts: list[str]
    embeds: dict
    """Prompt -> its text embedding, for every prompt above."""


def stage_scenes(pipe, cfg: OrderStageConfig) -> StageScenes:
    """Render and encode the scenes the stage trains on (its seed, scenes, exclude and anchor_pool settings): the
    order rows' of each relation prompt and its swap, the anchor rows' pool, and the prompts' embeddings."""
    prompts, own, other = order_scene_latents(pipe, cfg)
    pool, pool_prompts = anchor_pool(pipe, cfg.anchor_pool)
    return StageScenes(prompts, own, other, pool, pool_prompts, ps.prompt_embeddings(pipe, prompts + pool_prompts))


def order_stage(pipe, cfg: OrderStageConfig, scenes: StageScenes, log=print) -> list[float]:
    """Train pipe.transformer in place for cfg.steps steps on `scenes` (stage_scenes of the same cfg); the loss of
    each step."""
    prompts, own, other, pool, pool_prompts, embeds = (scenes.prompts, scenes.own, scenes.other, scenes.pool,
                                                        scenes.pool_prompts, scenes.embeds)
    base = copy.deepcopy(pipe.transformer).eval().requires_grad_(False)
    transformer = pipe.transformer.train().requires_grad_(True)
    opt = torch.optim.AdamW(list(transformer.parameters()), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed + 11)
    R, A = cfg.order_rows, cfg.anchor_rows
    losses = []
    for step in range(cfg.steps):
        index = torch.randint(len(prompts), (R,), generator=gen)
        eps = torch.randn((R, *own.shape[2:]), generator=gen)
        sigma = cfg.sigma_min + (1 - cfg.sigma_min) * torch.rand(R, generator=gen)
        sigma = torch.where(torch.rand(R, generator=gen) < 0.25, torch.ones(R), sigma)
        pick = torch.randint(cfg.scenes, (R,), generator=gen)
        x0 = own[index, pick]
        xt = noised(x0, eps, sigma)
        cond = PromptEmbeds.pad([embeds[prompts[i]] for i in index.tolist()])
        with torch.no_grad():
            target = order_target(ps.predict_velocity(base, xt, sigma, cond), xt, sigma, own[index], other[index])
        opt.zero_grad()
        loss = (ps.predict_velocity(transformer, xt, sigma, cond) - target).pow(2).mean()
        if A:
            a_index = torch.randint(len(pool_prompts), (A,), generator=gen)
            a_eps = torch.randn((A, *pool.shape[1:]), generator=gen)
            a_sigma = torch.rand(A, generator=gen)
            a_sigma = torch.where(torch.rand(A, generator=gen) < 0.5, torch.ones(A), a_sigma)
            a_xt = noised(pool[a_index], a_eps, a_sigma)
            a_cond = PromptEmbeds.pad([embeds[pool_prompts[i]] for i in a_index.tolist()])
            with torch.no_grad():
                a_target = ps.predict_velocity(base, a_xt, a_sigma, a_cond)
            loss = loss + (A / R) * (ps.predict_velocity(transformer, a_xt, a_sigma, a_cond) - a_target).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 100 == 0:
            log(f"order stage step {step}: loss {loss.item():.5f}")
    transformer.eval().requires_grad_(False)
    return losses


def parse_args(argv: list[str] | None = None) -> tuple[OrderStageConfig, argparse.Namespace]:
    """The stage's config from the command line (the base's manifest read and digested, --exclude parsed)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the shapes base to continue (a diffusers directory)")
    parser.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    parser.add_argument("--exclude", help="a prompts file whose relation prompts the order rows hold out, in the scenes "
                        "they ask for (held_out_arrangements)")
    parser.add_argument("--steps", type=int, default=OrderStageConfig.steps)
    parser.add_argument("--seed", type=int, default=OrderStageConfig.seed)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the result depends on it in rounding)")
    args = parser.parse_args(argv)
    check_shapes_base(args.base)  # a shipped base that is missing or corrupt: named, with the command that rebuilds it
    manifest = os.path.join(args.base, MANIFEST)
    if not os.path.isfile(manifest):
        raise SystemExit(f"--base: {manifest} is missing; a shapes base from tools/pretrain_shapes.py has one")
    exclude = ()
    if args.exclude:
        prompts = load_prompts(args.exclude, key="--exclude")  # a missing file named as --exclude's
        check_prompt_file(["shapes"], args.exclude)  # a prompt the world cannot read: named with its file and line
        held_out = [req for req in map(parse_prompt, prompts) if req.relation]
        exclude = tuple(dict.fromkeys(p for req in held_out for p in held_out_arrangements(req)))
    cfg = OrderStageConfig(base=args.base, base_manifest_sha256=sha256_file(manifest), exclude=exclude,
                           seed=args.seed, steps=args.steps)
    return cfg, args


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse_args(argv)
    from diffusers import QwenImagePipeline

    torch.set_num_threads(args.threads)
    warning = unpinned_warning("order_stage")
    if warning:
        print(warning, flush=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    pipe = QwenImagePipeline.from_pretrained(args.base, torch_dtype=torch.float32)
    order_stage(pipe, cfg, stage_scenes(pipe, cfg), log=lambda line: print(line, flush=True))
    seconds = time.perf_counter() - start
    ps.save(pipe, args.out, cfg, seconds, time.process_time() - cpu_start)
    print(f"wrote the order-staged base to {args.out} in {seconds:.0f} s")


if __name__ == "__main__":
    main()
