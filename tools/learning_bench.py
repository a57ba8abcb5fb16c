"""bench.py learning: the algorithms on the shapes world for a fixed wall-clock budget each -- the toy-scale
analogue of the papers' headline tables.

FlowGRPO, FlowGRPO with a 2-step SDE window (FlowGRPO-Fast: sampling.sde_window_size=2, the learner trains
on the window's steps only) and DiffusionNFT, each synchronous (async.max_staleness=0) and asynchronous
(max_staleness=1), from the default recipes (the shipped shapes base, the `shapes` reward). Each run trains
for --budget-s seconds of training time (trainer.time_limit_s: evaluations excluded, so a configuration
that takes more steps is not charged for evaluating more often) and evaluates the held-out prompts every
--eval-every steps and at the end. Reported per configuration: steps taken, eval/shapes_accuracy at the
start, at the end and at best, and the training time at which it first reached --target (null: never).
Configurations run one after another on one local Ray; the machine's load average is recorded beside.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

from plot_run import read_scalars  # a sibling in tools/, on sys.path under bench.py

from rayflow.config import load_config
from rayflow.paths import recipe

CONFIGS = {
    "flow_grpo": ("flowgrpo_qwen_image.yaml", ()),
    "flow_grpo_window2": ("flowgrpo_qwen_image.yaml", ("sampling.sde_window_size=2",)),
    "diffusion_nft": ("diffusion_nft_qwen_image.yaml", ()),
}
"""name -> (recipe, overrides); each runs with async.max_staleness 0 and 1."""
STALENESS = (0, 1)
METRIC = "eval/shapes_accuracy"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget-s", type=float, default=180.0, help="training seconds per configuration")
    parser.add_argument("--target", type=float, default=0.6, help="the eval/shapes_accuracy whose time to reach is reported (the base: 0.481)")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--staleness", nargs="+", type=int, default=list(STALENESS), help="async.max_staleness values")
    parser.add_argument("--out-dir", default="/tmp/rayflow-bench-learning", help="the runs' directories (replaced)")
    parser.add_argument("overrides", nargs="*", help="extra dotlist overrides for every run")


def eval_curve(logdir: str, train_s: dict[int, float]) -> list[dict[str, float]]:
    """[{step, train_s, accuracy}] of every evaluation the run logged (train_s 0 at step 0)."""
    scalars = read_scalars(logdir)
    if METRIC not in scalars:
        raise SystemExit(f"error: bench learning: {logdir} logged no {METRIC} (is the `shapes` reward configured?)")
    return [{"step": step, "train_s": train_s.get(step, 0.0), "accuracy": value} for step, value in zip(*scalars[METRIC])]


def summarize(curve: list[dict[str, float]], target: float) -> dict:
    """Start, end and best accuracy of an eval curve, and the training time it first reached `target` at."""
    reached = [point["train_s"] for point in curve if point["accuracy"] >= target]
    best = max(curve, key=lambda point: point["accuracy"])
    return {
        "start_accuracy": curve[0]["accuracy"], "end_accuracy": curve[-1]["accuracy"],
        "best_accuracy": best["accuracy"], "best_at_step": best["step"],
        "gain_points": 100 * (curve[-1]["accuracy"] - curve[0]["accuracy"]),
        "time_to_target_s": reached[0] if reached else None,
    }


def run_one(name: str, staleness: int, args: argparse.Namespace) -> dict:
    from rayflow.driver.trainer import Trainer

    yaml, overrides = CONFIGS[name]
    run = f"{name}-staleness{staleness}"
    shutil.rmtree(os.path.join(args.out_dir, run), ignore_errors=True)
    cfg = load_config(recipe(yaml), [
        *overrides, f"async.max_staleness={staleness}", "trainer.total_steps=100000", f"trainer.time_limit_s={args.budget_s}",
        f"trainer.eval_every={args.eval_every}", "trainer.eval_at_start=true", "trainer.save_every=0", "trainer.resume=never",
        f"trainer.output_dir={args.out_dir}", f"trainer.run_name={run}", "logging.progress_bar=false", *args.overrides,
    ])
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        history = trainer.run()
    finally:
        trainer.shutdown()
    curve = eval_curve(cfg.trainer.logdir, {i + 1: h["perf/train_s"] for i, h in enumerate(history)})
    return {
        "config": name, "max_staleness": staleness, "overrides": [*overrides, *args.overrides],
        "steps": len(history), "train_s": history[-1]["perf/train_s"], "wall_s": time.perf_counter() - start,
        "step_s_median": statistics.median_high(h["perf/step_s"] for h in history),
        "staleness_mean": sum(h["staleness/mean"] for h in history) / len(history),
        "load_average_before": load_before, **summarize(curve, args.target), "curve": curve,
    }


def bench_learning(args: argparse.Namespace, start_local_ray) -> dict:
    import torch

    if args.budget_s <= 0:
        raise SystemExit(f"error: --budget-s: got {args.budget_s}; allowed: seconds > 0")
    if not 0 < args.target <= 1:  # an accuracy, the share of images correct: 60 for 60% is never reached
        raise SystemExit(f"error: --target: got {args.target}; allowed: an accuracy in (0, 1], e.g. 0.6 for 60%")
    if any(s < 0 for s in args.staleness):
        raise SystemExit(f"error: --staleness: got {args.staleness}; allowed: integers >= 0")
    ray = start_local_ray(num_cpus=2)
    try:
        runs = [run_one(name, staleness, args) for name in args.configs for staleness in args.staleness]
    finally:
        ray.shutdown()
    return {
        "benchmark": "learning",
        "command": " ".join(["python", *sys.argv]),
        "setup": {
            "world": "shapes (models/shapes-qwen-image, reward `shapes`, held-out recipes/prompts/shapes_eval.txt)",
            "budget_s": args.budget_s, "target_accuracy": args.target, "eval_every": args.eval_every,
            "cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__,
        },
        "runs": runs,
        "note": "train_s and time_to_target_s count training time only (trainer.time_limit_s's clock: evaluations "
                "excluded, steps a learner rewind trained again included); accuracy is the share of the held-out prompts x data.eval_seeds images whose every "
                "requirement is met (GenEval's per-prompt 'correct')",
    }
