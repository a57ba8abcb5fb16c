"""Evaluate a run's checkpoint, or its base, on the run's evaluation prompts with as many seeds as asked: the eval/*
means the run logs, each with the standard error its seeds leave on it, per prompt and per shapes category.

    python tools/evaluate.py RUN_DIR [--seeds 32] [--first-seed F] [--checkpoint PATH] [--base] [--adapter NAME]
                             [--json OUT]
    python tools/evaluate.py RECIPE.yaml [KEY=VALUE ...] [--seeds 32] [--json OUT]      # a recipe's base, untrained

One process, no Ray: the reference trainer's model and sampler (`rayflow.reference`), the run's evaluation
sampling (`evaluation_params`) and its reward. RUN_DIR's config.yaml says what the run was; the checkpoint is its
newest intact one unless --checkpoint names another; --base evaluates the run's model before training. The weights
are those the run evaluates (`evaluated_adapter`: the "ema" EMA with trainer.ema_decay > 0, else the rollout
adapter) unless --adapter names another. With --seeds at the run's data.eval_seeds (the default) the figures are the
run's own eval/* at the checkpoint's step, image for image (tests/test_evaluate.py); more seeds, a smaller error.
--first-seed F shifts every seed by F: a run's evaluation starts at 0, where a run with trainer.seed=0 starts drawing
its training seeds too, so its first steps trained on the evaluation's initial noises; a large F evaluates on noises
no training step drew.

The standard error is the one of a fixed prompt set's mean over random seeds: with P prompts, n seeds each and s_p²
the sample variance of prompt p's n values, SE = sqrt(Σ_p s_p² / n) / P. It leaves out which prompts were chosen.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import yaml

from rayflow import reference
from rayflow.checkpoint import checkpoint_root, find_checkpoint, latest_checkpoint
from rayflow.config import RayflowConfig, load_config, split_overrides
from rayflow.driver.evaluation import evaluation_params, evaluation_prompts, evaluation_requests, evaluation_scalars
from rayflow.learner.model import ema_copies
from rayflow.learner.spec import LearnerSpec
from rayflow.models.lora import EVAL_EMA_ADAPTER, TRAINED_ADAPTER, rollout_adapter_name
from rayflow.models.weight_sets import using_weights
from rayflow.paths import check_output_dirs, run_start_dir
from rayflow.rewards.validation import check_prompt_file
from rayflow.runs import CONFIG_FILE, USER_ERRORS
from rayflow.sampling.denoise import generate
from rayflow.worlds.shapes import CATEGORIES, category_of, parse_prompt


def evaluated_adapter(cfg: RayflowConfig) -> str:
    """The weights a run evaluates: the "ema" EMA with trainer.ema_decay > 0, else those its rollouts sample under
    (DiffusionNFT's "old", FlowGRPO's "default"), as the Trainer's evaluation does."""
    if cfg.trainer.ema_decay > 0:
        return EVAL_EMA_ADAPTER
    return rollout_adapter_name(cfg.algorithm.needs_ema_rollout)


def seed_standard_error(values: list[list[float]]) -> float | None:
    """SE of the mean over prompts of per-prompt means, from the seeds' spread alone: values[p] holds prompt p's n
    values (n the same for all, ≥ 2; None below). SE = sqrt(Σ_p s_p² / n) / P, s_p² the sample variance."""
    n = len(values[0])
    if n < 2:
        return None
    variances = [torch.tensor(v, dtype=torch.float64).var(correction=1).item() for v in values]
    return math.sqrt(sum(variances) / n) / len(values)


def shapes_category(prompt: str) -> str | None:
    """The prompt's category in the shapes world, or None when it is not a shapes prompt."""
    try:
        return category_of(parse_prompt(prompt))
    except ValueError:
        return None


def evaluate(cfg: RayflowConfig, checkpoint: str | None, seeds: int, adapter: str | None = None,
             first_seed: int = 0) -> dict:
    """The run's evaluation prompts × `seeds` seeds (from `first_seed`: evaluation_requests) sampled under `adapter`
    (None: `evaluated_adapter`) of `checkpoint` (None: the base), scored. Returns the report `main` prints and writes."""
    adapter = adapter or evaluated_adapter(cfg)
    allowed = (TRAINED_ADAPTER, *ema_copies(LearnerSpec.from_config(cfg)))
    if adapter not in allowed:  # before the model loads
        raise ValueError(f"--adapter: got {adapter!r}; allowed: one of {list(allowed)} (the weight sets this run keeps)")
    # Before the model loads, as the recipes do (preflight): a prompt a reward cannot score is named by file and line,
    # not by the reward after sampling. The prompts evaluated are data.eval_prompts', else data.prompts' first ones.
    key = "data.eval_prompts" if cfg.data.eval_prompts else "data.prompts"
    check_prompt_file([fn.name for fn in cfg.reward.functions], cfg.data.eval_prompts or cfg.data.prompts,
                      cfg.data.max_prompt_chars, key)
    run = reference.build_run(cfg)
    if checkpoint is not None:
        reference.resume(run, checkpoint)
    prompts = evaluation_prompts(cfg.data, run.sampler.prompts)
    requests = evaluation_requests(prompts, seeds, evaluation_params(cfg.sampling, cfg.trainer), first_seed)
    per_prompt = []
    with using_weights(run.model.transformer, adapter):
        for request in requests:
            sampled = generate(run.model, request, run.spec.policy, version=run.step)
            run.reward.score(sampled)
            per_prompt.append(sampled)
    trajectories = [t for group in per_prompt for t in group]
    scalars = evaluation_scalars(trajectories)
    per_image = [[evaluation_scalars([t]) for t in group] for group in per_prompt]  # each image's eval/* values
    rows = [{"prompt": prompt, "category": shapes_category(prompt), **evaluation_scalars(group)}
            for prompt, group in zip(prompts, per_prompt)]
    categories = {}
    if all(row["category"] is not None for row in rows):
        for category in CATEGORIES:
            members = [row for row in rows if row["category"] == category]
            if members:
                categories[category] = {"prompts": len(members),
                                        **{tag: sum(m[tag] for m in members) / len(members) for tag in scalars}}
    return {
        "checkpoint": checkpoint, "step": run.step, "adapter": adapter, "seeds": seeds, "first_seed": first_seed,
        "prompts": len(prompts),
        "images": len(trajectories),
        "metrics": {tag: {"mean": mean, "stderr": seed_standard_error([[v[tag] for v in images] for images in per_image])}
                    for tag, mean in scalars.items()},
        "categories": categories, "per_prompt": rows,
    }


def run_config(target: str, overrides: list[str], base: bool = False,
               checkpoint: str | None = None) -> tuple[RayflowConfig, str | None]:
    """The config and checkpoint `target` names: a recipe YAML (its base, with `overrides`), a run directory (its
    newest intact checkpoint) or a checkpoint directory (inside a run's checkpoints/). `checkpoint` names another
    checkpoint instead; `base`: none (the model before training)."""
    if base and checkpoint is not None:
        raise ValueError("--checkpoint and --base: give one of them")
    if os.path.isfile(target):
        if not target.endswith((".yaml", ".yml")):
            raise ValueError(f"{target!r}: a run directory, a checkpoint directory or a recipe YAML was expected")
        return load_config(target, overrides), None if checkpoint is None else find_checkpoint(checkpoint)
    if not os.path.isdir(target):
        raise FileNotFoundError(f"{target!r}: no such run directory, checkpoint directory or recipe YAML")
    is_run_dir = os.path.isfile(os.path.join(target, CONFIG_FILE))
    # <run>/checkpoints (its newest) or <run>/checkpoints/step_N
    up = 1 if os.path.isfile(os.path.join(os.path.dirname(os.path.abspath(target)), CONFIG_FILE)) else 2
    run_dir = target if is_run_dir else os.path.abspath(os.path.join(target, *[".."] * up))
    config = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{target!r}: no {CONFIG_FILE} in it or one or two levels up: not a run's directory or "
                                f"a checkpoint of one (tools/evaluate.py RECIPE.yaml evaluates a recipe's base)")
    try:
        with open(config) as f:
            saved = yaml.safe_load(f)
    except yaml.YAMLError:  # load_config names the file and what is wrong with it
        saved = None
    trainer = saved.get("trainer") if isinstance(saved, dict) else None
    # As written by the run's version, maybe an older one; a relative path in it (given so on the run's command line)
    # leads from where the run started, not from the run directory.
    cfg = load_config(config, overrides, saved_run=True,
                      paths_from=run_start_dir(run_dir, trainer if isinstance(trainer, dict) else {}))
    if base:
        return cfg, None
    if checkpoint is None:
        checkpoint = checkpoint_root(target) if is_run_dir else target
        if is_run_dir and latest_checkpoint(checkpoint) is None:
            raise FileNotFoundError(f"{target!r}: the run has no checkpoint yet (it saves every trainer.save_every "
                                    f"steps and at its end); --base evaluates its model before training")
    return cfg, find_checkpoint(checkpoint)


def print_report(report: dict) -> None:
    where = f"step {report['step']} ({report['checkpoint']})" if report["checkpoint"] else "the base (step 0)"
    first = f" from seed {report['first_seed']}" if report["first_seed"] else ""
    print(f"{where}, weights {report['adapter']!r}: {report['prompts']} prompts x {report['seeds']} seeds{first} = "
          f"{report['images']} images")
    for tag, m in report["metrics"].items():
        error = "" if m["stderr"] is None else f" ± {m['stderr']:.4f}"
        print(f"  {tag:<28} {m['mean']:.4f}{error}")
    accuracy = "eval/shapes_accuracy"
    if report["categories"] and accuracy in report["metrics"]:
        print("  " + "  ".join(f"{c} {100 * v[accuracy]:.1f}%" for c, v in report["categories"].items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="a run directory, one of its checkpoints, or a recipe YAML (its base)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides (e.g. data.eval_prompts=FILE)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per prompt (default: the run's data.eval_seeds)")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="prompt i gets seeds FIRST + i*n ... (default 0, as the run's evaluation; training with "
                             "trainer.seed=0 draws seeds 0, 1, 2, ..., so a large one evaluates on unseen noises)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the run's newest)")
    parser.add_argument("--base", action="store_true", help="evaluate the run's model before training")
    parser.add_argument("--adapter", default=None, help="the weight set to evaluate (default: the one the run evaluates)")
    parser.add_argument("--json", default=None, help="also write the report (with every prompt's means) here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    rest, overrides = split_overrides(sys.argv[1:] if argv is None else argv)  # after an option too
    args = parser.parse_args(rest)
    args.overrides = overrides
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads: got {args.threads}; allowed: an integer >= 1")
    check_output_dirs(parser, {"--json": args.json})
    try:
        cfg, checkpoint = run_config(args.target, args.overrides, args.base, args.checkpoint)
        seeds = cfg.data.eval_seeds if args.seeds is None else args.seeds
        if seeds < 1:
            raise ValueError(f"--seeds: got {seeds}; allowed: an integer >= 1")
        if not 0 <= args.first_seed < 2**62:  # torch generator seeds, with room for the prompts x seeds after it
            raise ValueError(f"--first-seed: got {args.first_seed}; allowed: an integer in [0, 2**62)")
        if args.threads:
            torch.set_num_threads(args.threads)
        report = evaluate(cfg, checkpoint, seeds, args.adapter, args.first_seed)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
