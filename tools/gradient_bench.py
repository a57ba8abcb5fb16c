"""bench.py gradients: how much of an algorithm's gradient is signal, on the shapes world, in minutes instead of
a 10-minute run per configuration.

The gradient noise scale of McCandlish, Kaplan, Amodei et al. ("An Empirical Model of Large-Batch Training", 2018):
with G the expected gradient of the loss and Σ the covariance of one sample's gradient,

    B_noise = tr(Σ) / |G|²

is the batch size at which a step's noise equals its signal. A step on a batch of n samples makes n / (n + B_noise) of
the progress of a noise-free step (at its best learning rate), so n / ((n + B_noise) · seconds per batch) compares
configurations that differ in batch size and cost per batch (`progress_per_s`). It is SGD's theory; Adam rescales
each weight, so read the figures as a ranking, not a forecast of steps.

Each configuration builds the reference trainer (rayflow.reference) from a recipe and, at the base weights, draws
--batches batches the way training does (rollout, rewards, advantages; each batch at its own policy version, so an
SDE window moves as in training), and takes each batch's gradient of the algorithm's loss without an optimizer step.
--recipe measures any recipe instead (B_noise is the batch beyond which more samples a step stop paying).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rayflow.paths import recipe

CONFIGS = {
    "flow_grpo": ("flowgrpo_qwen_image.yaml", ()),
    "flow_grpo_window2": ("flowgrpo_qwen_image.yaml", ("sampling.sde_window_size=2",)),
    "flow_grpo_same_noise": ("flowgrpo_qwen_image.yaml", ("sampling.same_initial_noise=true",)),
    "flow_grpo_full": ("flowgrpo_qwen_image.yaml", ("learner.train_mode=full", "sync.mode=merged")),
    "diffusion_nft": ("diffusion_nft_qwen_image.yaml", ()),
}
"""name -> (recipe, overrides): the learning benchmark's FlowGRPO, 2-step window and DiffusionNFT; FlowGRPO with each
group started from one initial noise (sampling.same_initial_noise); FlowGRPO training every weight, as the DiffusionNFT
recipe does (B_noise depends on which weights are trained: this pair compares the algorithms on the same ones)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--recipe", nargs="+", default=None,
                        help="measure these recipe YAMLs instead of --configs (e.g. your own, to size its batch)")
    parser.add_argument("--batches", type=int, default=16, help="batches per configuration (K >= 3)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("overrides", nargs="*", help="extra dotlist overrides for every configuration")


def noise_scale(grads: torch.Tensor, batch_size: int) -> dict[str, float]:
    """Unbiased estimates of |G|² and tr(Σ) from K batch gradients `grads` [K, P] of `batch_size` samples each.

    With g_k the mean gradient of batch k, E|g_k|² = |G|² + tr(Σ)/n and E|ḡ|² = |G|² + tr(Σ)/(nK) for ḡ the mean of
    the K, so with m1 = mean_k |g_k|² and m2 = |ḡ|²:

        |G|² ≈ (K·m2 − m1) / (K − 1),     tr(Σ) ≈ n·K·(m1 − m2) / (K − 1),     B_noise = tr(Σ) / |G|²

    `signal_sigmas`: |G|²'s estimate over its jackknife standard error (leaving out one batch at a time). Below 2 the
    signal is not told apart from noise, and `b_noise_lower` is tr(Σ) / (max(|G|², 0) + 2·SE): at least that many samples
    per batch before signal matches noise. `mean_cosine`: the mean cosine between two batches' gradients.
    """
    K, n = grads.shape[0], batch_size
    if K < 3:
        raise ValueError(f"noise_scale: got {K} batch gradients; allowed: at least 3 (the jackknife leaves one out)")
    g = grads.double()
    sq = (g * g).sum(dim=1)  # |g_k|²
    total = g.sum(dim=0)

    def signal(sum_vec: torch.Tensor, sq_k: torch.Tensor, k: int) -> tuple[float, float]:
        m1, m2 = float(sq_k.mean()), float((sum_vec / k).square().sum())
        return (k * m2 - m1) / (k - 1), n * k * (m1 - m2) / (k - 1)

    g2, trace = signal(total, sq, K)
    leave_one_out = torch.tensor([signal(total - g[k], torch.cat([sq[:k], sq[k + 1:]]), K - 1)[0] for k in range(K)],
                                 dtype=torch.float64)
    se = float(((K - 1) / K * (leave_one_out - leave_one_out.mean()).square().sum()).sqrt())
    unit = g / g.norm(dim=1, keepdim=True).clamp_min(1e-300)
    cos = unit @ unit.T
    return {
        "signal_sq": g2, "signal_sq_se": se, "signal_sigmas": g2 / se if se > 0 else float("inf"), "trace_sigma": trace,
        "b_noise": trace / g2 if g2 > 0 else float("inf"),
        "b_noise_lower": trace / (max(g2, 0.0) + 2 * se) if se > 0 or g2 > 0 else float("inf"),
        "mean_cosine": float((cos.sum() - cos.diagonal().sum()) / (K * (K - 1))),
    }


def batch_gradients(recipe_file: str, overrides: list[str], batches: int) -> tuple[torch.Tensor, int, list[float]]:
    """[K, P] gradients of the trained weights, one per batch, at the base weights; samples per batch; seconds per
    batch (rollout, rewards, backward)."""
    from rayflow import reference
    from rayflow.config import load_config
    from rayflow.learner.minibatches import backward, pass_index

    cfg = load_config(recipe_file, overrides)  # nothing is written: no checkpoint, no log
    run = reference.build_run(cfg)
    params = [p for group in run.optimizer.param_groups for p in group["params"]]  # the weights training steps
    grads, seconds, samples = [], [], 0
    for k in range(batches):
        run.step = k  # the version the batch is sampled at (an SDE window's place); the weights stay the base's
        start = time.perf_counter()
        trajectories, _ = reference.rollout(run)
        for p in params:
            p.grad = None
        backward(run.spec, run.model, run.spec.policy, trajectories, pass_index(k, 0, 1))
        seconds.append(time.perf_counter() - start)
        # The last block's text-stream layers do not reach the image and get no gradient: zeros keep the rows aligned.
        grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params]))
        samples = len(trajectories)
    return torch.stack(grads), samples, seconds


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    results = {}
    configs = {name: (recipe(file), overrides) for name, (file, overrides) in CONFIGS.items() if name in args.configs}
    if args.recipe:
        missing = [path for path in args.recipe if not os.path.isfile(path)]
        if missing:
            raise SystemExit(f"error: --recipe: got {missing}; allowed: recipe YAML files")
        configs = {path: (path, ()) for path in args.recipe}
    for name, (recipe_file, overrides) in configs.items():
        grads, n, seconds = batch_gradients(recipe_file, [*overrides, *args.overrides], args.batches)
        scale = noise_scale(grads, n)
        resolved = scale["signal_sigmas"] >= 2
        batch_s = statistics.median(seconds)
        results[name] = {
            "recipe": recipe_file, "overrides": list(overrides), "samples_per_batch": n, "weights": grads.shape[1],
            "batch_s": batch_s, **scale,
            # The share of a noise-free step each batch makes, per second; with no signal resolved, at most this.
            "progress_per_s": n / (n + (scale["b_noise"] if resolved else scale["b_noise_lower"])) / batch_s,
            "progress_is_upper_bound": not resolved,
        }
        print(f"{name}: B_noise {scale['b_noise']:.4g} (signal {scale['signal_sigmas']:.1f} SE), "
              f"cosine {scale['mean_cosine']:+.4f}, {n} samples in {batch_s:.2f} s", flush=True)
    return {"benchmark": "gradients", "batches": args.batches, "threads": args.threads, "overrides": args.overrides,
            "configs": results,
            "note": "at the base weights; b_noise = tr(Sigma)/|G|^2 (McCandlish et al. 2018); progress_per_s = n / (n + "
                    "b_noise) / batch_s, n = samples_per_batch (with b_noise_lower where signal_sigmas < 2: an upper bound)"}
