"""Plot a run's TensorBoard scalars with matplotlib: reward, accuracy, KL, staleness and step time.

    python tools/plot_run.py RUN_DIR --out fig.png

RUN_DIR is a run directory (<trainer.output_dir>/<run_name>, whose tensorboard/ holds the events) or the
events directory itself. A panel whose tags the run did not log is left out.
"""

import argparse
import os
import sys

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
    args = parser.parse_args(argv)
    events = os.path.join(args.run_dir, "tensorboard")
    events = events if os.path.isdir(events) else args.run_dir
    scalars = read_scalars(events)
    if not plot(scalars, args.out, os.path.basename(os.path.normpath(args.run_dir))):
        sys.exit(f"error: {events} holds none of the plotted tags ({', '.join(t for _, ts in PANELS for t in ts)})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
