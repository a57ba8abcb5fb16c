"""Plot a run's TensorBoard scalars with matplotlib: reward, accuracy, KL, staleness and step time; and
its first and last evaluation grids side by side (the same prompts and seeds before and after).

    python tools/plot_run.py RUN_DIR --out fig.png [--grids grids.png]

RUN_DIR is a run directory (<trainer.output_dir>/<run_name>: the events are in its tensorboard/, or where the
trainer.logdir of its config.yaml says) or the events directory itself. A panel whose tags the run did not log is
left out. The grids' rows are labelled with the evaluation prompts when RUN_DIR holds the run's config.yaml (one row
per prompt when data.eval_seeds > 1).
"""

from __future__ import annotations

import argparse
import io
import os
import sys

from rayflow.paths import check_output_dirs, run_start_dir

PANELS = (
    ("reward", ("reward/mean", "eval/reward_mean")),
    ("accuracy", ("reward/shapes_accuracy", "eval/shapes_accuracy")),
    ("KL", ("loss/kl", "train/approx_kl")),
    ("staleness", ("staleness/mean", "staleness/max")),
    ("step time (s)", ("perf/step_s",)),
)
"""(panel title, the tags drawn in it)."""


def read_scalars(events_dir: str) -> dict[str, tuple[list[int], list[float]]]:
    """tag -> (steps, values) of every scalar in the event files under `events_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


def read_grids(events_dir: str, tag: str = "eval/images") -> list[tuple[int, "numpy.ndarray"]]:
    """(step, [H, W, 3] uint8 image) of every logged `tag` image, in step order."""
    import numpy
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events_dir, size_guidance={"images": 0})
    acc.Reload()
    if tag not in acc.Tags()["images"]:
        return []
    # A step logged twice (a run restarted from the start keeps its first try's step-0 grid): the last one logged.
    latest = {e.step: e for e in acc.Images(tag)}
    return [(step, numpy.asarray(Image.open(io.BytesIO(latest[step].encoded_image_string)).convert("RGB")))
            for step in sorted(latest)]


def events_dir(run_dir: str) -> str:
    """Where RUN_DIR's TensorBoard events are: its tensorboard/ (the default trainer.logdir), else the trainer.logdir
    its config.yaml names (relative: to where the run started), else RUN_DIR itself (an events directory). SystemExit
    naming the key when the run wrote none there: logging.tensorboard=false, or a trainer.logdir that is not here."""
    from omegaconf import OmegaConf

    default = os.path.join(run_dir, "tensorboard")
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return default if os.path.isdir(default) else run_dir
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # malformed: the events are where they would be without it
        print(f"note: {path} is not readable as a run's config ({type(e).__name__}); its trainer.logdir is not looked at",
              file=sys.stderr)
        config = {}
    sections = {name: config.get(name) if isinstance(config, dict) else None for name in ("trainer", "logging")}
    trainer, logging_section = (s if isinstance(s, dict) else {} for s in sections.values())
    events, logdir = default, trainer.get("logdir")
    if not os.path.isdir(default) and isinstance(logdir, str):
        events = os.path.join(run_start_dir(run_dir, trainer), os.path.expanduser(logdir))
        if not os.path.isdir(events) and logging_section.get("tensorboard") is not False:
            sys.exit(f"error: {run_dir} has no tensorboard/, and the trainer.logdir of {path} is {events!r}, not a "
                     "directory here; give the events directory as RUN_DIR")
    if logging_section.get("tensorboard") is False and not (
            os.path.isdir(events) and any("tfevents" in name for name in os.listdir(events))):
        sys.exit(f"error: {path}: the run was started with logging.tensorboard=false and wrote no TensorBoard events")
    return events if os.path.isdir(events) else run_dir


def check_image_formats(parser: argparse.ArgumentParser, outputs: dict[str, str | None]) -> None:
    """Each output (flag -> path, None: not asked for) ends in an extension matplotlib writes, named before any work
    (parser.error): another was a traceback after the events were read, and none wrote PATH.png while saying PATH."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    for flag, path in outputs.items():
        if path and os.path.splitext(path)[1][1:].lower() not in formats:
            parser.error(f"{flag}: {path!r}; allowed: a file name ending in one of {', '.join('.' + f for f in formats)}")


def row_prompts(run_dir: str) -> list[str] | None:
    """The evaluation prompts of the run's config.yaml when its grids have one row per prompt (data.eval_seeds > 1:
    a row is a prompt's seeds; with one seed the grid runs four images to a row), else None. A relative
    data.eval_prompts (an override on the command line) is relative to the directory the run was started in."""
    from omegaconf import OmegaConf

    from rayflow.data.prompts import load_prompts

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return None
    config = OmegaConf.load(path)
    data = config.data
    prompts = data.get("eval_prompts")
    if data.get("eval_seeds", 1) <= 1 or not prompts:
        return None
    prompts = os.path.join(run_start_dir(run_dir, config.get("trainer", {})), os.path.expanduser(prompts))
    if not os.path.isfile(prompts):
        print(f"note: the grids' rows are not labelled: data.eval_prompts of {path} is {prompts!r}, not a file here",
              file=sys.stderr)
        return None
    return load_prompts(prompts, data.get("max_prompt_chars", 4096), key="data.eval_prompts")  # as the run read them


def plot_grids(before: tuple[int, "numpy.ndarray"], after: tuple[int, "numpy.ndarray"], out: str, title: str,
               prompts: list[str] | None = None) -> None:
    """The two grids side by side, titled with their steps; rows labelled with `prompts` when the grid has
    one row per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height, width = before[1].shape[:2]
    label = prompts is not None and len(prompts) > 0 and height % len(prompts) == 0
    fig, axes = plt.subplots(1, 2, figsize=(2 * width / 100 + (2.6 if label else 0.4), height / 100 + 0.6), squeeze=False)
    for i, (ax, (step, image)) in enumerate(zip(axes[0], (before, after))):
        ax.imshow(image, interpolation="nearest")
        ax.set_title(f"step {step}", fontsize=9)
        ax.set_xticks([])
        row = height / len(prompts) if label else 0
        ax.set_yticks([row * (k + 0.5) for k in range(len(prompts))] if label and i == 0 else [])
        if label and i == 0:
            ax.set_yticklabels(prompts, fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot(scalars: dict[str, tuple[list[int], list[float]]], out: str, title: str) -> int:
    """Write the panels that have data to `out`; returns how many were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, [t for t in tags if t in scalars]) for name, tags in PANELS]
    panels = [(name, tags) for name, tags in panels if tags]
    if not panels:
        return 0
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.0), squeeze=False)
    for ax, (name, tags) in zip(axes[0], panels):
        for tag in tags:
            steps, values = scalars[tag]
            ax.plot(steps, values, marker="o" if tag.startswith("eval/") else None, markersize=3, label=tag)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return len(panels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run directory (or its tensorboard/ directory)")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--grids", default=None, help="also write the first and last eval/images grids side by side here")
    args = parser.parse_args(argv)
    check_output_dirs(parser, {"--out": args.out, "--grids": args.grids})
    check_image_formats(parser, {"--out": args.out, "--grids": args.grids})
    if not os.path.isdir(args.run_dir):
        sys.exit(f"error: run_dir {args.run_dir!r} is not a directory; allowed: a run directory (outputs/<run>) or its "
                 "tensorboard/ directory")
    events = events_dir(args.run_dir)
    title = os.path.basename(os.path.normpath(args.run_dir))
    scalars = read_scalars(events)
    if not plot(scalars, args.out, title):
        sys.exit(f"error: {events} holds none of the plotted tags ({', '.join(t for _, ts in PANELS for t in ts)})")
    print(f"wrote {args.out}")
    if args.grids:
        grids = read_grids(events)
        if len(grids) < 2:
            sys.exit(f"error: --grids: {events} holds {len(grids)} eval/images grid(s); two evaluations are needed "
                     "(trainer.eval_at_start and trainer.eval_every)")
        plot_grids(grids[0], grids[-1], args.grids, title, row_prompts(args.run_dir))
        print(f"wrote {args.grids}")


if __name__ == "__main__":
    main()
