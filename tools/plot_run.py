"""Plot a run's TensorBoard scalars with matplotlib: reward, accuracy, KL, staleness and step time; and
its first and last evaluation grids side by side (the same prompts and seeds before and after).

    python tools/plot_run.py RUN_DIR --out fig.png [--grids grids.png]

RUN_DIR is a run directory (<trainer.output_dir>/<run_name>, whose tensorboard/ holds the events) or the
events directory itself. A panel whose tags the run did not log is left out. The grids' rows are labelled
with the evaluation prompts when RUN_DIR holds the run's config.yaml (one row per prompt when
data.eval_seeds > 1).
"""

import argparse
import io
import os
import sys

from rayflow.paths import check_output_dirs

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


def run_start_dir(run_dir: str, trainer) -> str:
    """The directory the run was started in, where its relative paths lead from: RUN_DIR less its relative
    <trainer.output_dir>/<trainer.run_name>; else (an absolute output_dir) this one's."""
    output_dir, run_name = trainer.get("output_dir"), trainer.get("run_name")
    here = os.path.abspath(run_dir)
    if isinstance(output_dir, str) and isinstance(run_name, str) and not os.path.isabs(output_dir):
        tail = os.path.normpath(os.path.join(output_dir, run_name))
        if here.endswith(os.sep + tail):
            return here[: -len(tail) - 1]
    return os.getcwd()


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
    return load_prompts(prompts)


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
    if not os.path.isdir(args.run_dir):
        sys.exit(f"error: run_dir {args.run_dir!r} is not a directory; allowed: a run directory (outputs/<run>) or its "
                 "tensorboard/ directory")
    events = os.path.join(args.run_dir, "tensorboard")
    events = events if os.path.isdir(events) else args.run_dir
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
