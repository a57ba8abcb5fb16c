"""What a run shows while it trains: TensorBoard scalars and image grids under trainer.logdir, the key
figures as Ray metrics (so the Ray dashboard's Metrics view and cluster/grafana/rayflow.json have them),
optionally Weights & Biases, and a progress bar.

Tags are stable: dashboards and the README's table rely on them.
"""

from __future__ import annotations

import math
import os

import torch

from rayflow.config import LoggingConfig

SCALAR_TAGS = (
    "reward/mean",
    "reward/std",
    "loss/policy",
    "loss/kl",
    "train/clip_frac",
    "train/approx_kl",
    "train/grad_norm",
    "train/skipped_steps",
    "train/zero_signal_groups",
    "train/filtered_samples",
    "staleness/mean",
    "staleness/max",
    "rollout/partial_ratio",
    "rollout/max_partial_span",
    "rollout/regenerated",
    "rollout/dropped",
    "rollout/queue_depth",
    "rollout/replica_restarts",
    "perf/images_per_s",
    "perf/step_s",
    "perf/train_s",
    "perf/sync_s",
    "perf/push_s",
    "perf/fetch_s",
    "perf/prefetched",
    "perf/rollout_idle",
    "perf/learner_idle",
)
"""Plus reward/<component> for every reward function and reward/<metric> for every metric a reward reports
(e.g. reward/shapes_accuracy), and eval/reward_mean and eval/<component or metric>."""

# Exported to Ray's metrics (Prometheus names): gauges of the latest value, counters of totals.
_GAUGES = ("reward/mean", "loss/policy", "staleness/mean", "staleness/max", "perf/images_per_s", "perf/step_s",
           "rollout/queue_depth")
_COUNTERS = ("rollout/regenerated", "rollout/dropped", "rollout/replica_restarts", "train/skipped_steps")


def _metric_name(tag: str) -> str:
    return "rayflow_" + tag.replace("/", "_").replace("#", "_")


def exported_metric_names() -> dict[str, str]:
    """Tag → the name Prometheus scrapes: Ray prefixes every application metric with "ray_", and
    OpenTelemetry suffixes counters with "_total"."""
    return {**{t: f"ray_{_metric_name(t)}" for t in _GAUGES}, **{t: f"ray_{_metric_name(t)}_total" for t in _COUNTERS}}


def image_grid(images: list[torch.Tensor], columns: int = 4) -> torch.Tensor:
    """[H, W, 3] uint8 images (same size) -> one [rows·H, min(columns, len)·W, 3] grid, row-major."""
    columns = min(columns, len(images))  # two images make a 1x2 grid, not half of a black 1x4 one
    h, w, c = images[0].shape
    rows = math.ceil(len(images) / columns)
    grid = torch.zeros(rows * h, columns * w, c, dtype=torch.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * h : (r + 1) * h, col * w : (col + 1) * w] = image
    return grid


WANDB_STEP = "trainer/step"
"""The x-axis of every W&B chart: the optimizer step the scalars belong to."""


class Monitor:
    """Writes one step's figures everywhere they are watched."""

    def __init__(self, logdir: str, cfg: LoggingConfig, total_steps: int, start_step: int = 0,
                 wandb_run: dict | None = None):
        """`wandb_run`: wandb.init's name, dir and config (used when cfg.wandb)."""
        self.cfg = cfg
        self.writer = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run trains again the steps after its checkpoint that the stopped run had logged:
            # TensorBoard drops those (step > start_step) instead of showing them twice. A run that starts over
            # (its first try died before a checkpoint) drops all of the first try's, its step-0 evaluation too.
            self.writer = SummaryWriter(logdir, purge_step=start_step + 1 if start_step else 0)
        self.logdir = logdir
        self.wandb = None
        if cfg.wandb:
            import wandb

            run = dict(wandb_run or {})
            if run.get("dir"):
                os.makedirs(run["dir"], exist_ok=True)
            # The run's name is its id, so a resumed run continues the same W&B run.
            self.wandb = wandb.init(project=cfg.wandb_project, entity=cfg.wandb_entity, id=run.get("name"),
                                    resume="allow", **run)
            # Logged against the run's own step, not W&B's: W&B's must grow, so it dropped every step trained again
            # after a rewind or a resume (their values are kept beside the abandoned ones; TensorBoard purges those).
            self.wandb.define_metric(WANDB_STEP)
            self.wandb.define_metric("*", step_metric=WANDB_STEP)
        self.gauges, self.counters, self._counted = {}, {}, {}
        if cfg.ray_metrics:
            from ray.util.metrics import Counter, Gauge

            self.gauges = {t: Gauge(_metric_name(t), description=t) for t in _GAUGES}
            self.counters = {t: Counter(_metric_name(t), description=t) for t in _COUNTERS}
        self.bar = None
        if cfg.progress_bar:
            from tqdm import tqdm

            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rayflow", dynamic_ncols=True)
            # Log lines are written above the bar instead of into it.
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

    def log(self, step: int, scalars: dict[str, float], advance: bool = True) -> None:
        """Write one step's scalars; `advance` moves the progress bar (once per training step). logging.log_every thins
        the training steps' scalars only: an evaluation's (advance=False) are always written, as its images are."""
        if not advance or step % self.cfg.log_every == 0:
            if self.writer is not None:
                for tag, value in scalars.items():
                    self.writer.add_scalar(tag, value, step)
            if self.wandb is not None:
                self.wandb.log({**scalars, WANDB_STEP: step})
        for tag, gauge in self.gauges.items():
            if tag in scalars:
                gauge.set(scalars[tag])
        for tag, counter in self.counters.items():
            # The scalars carry running totals; Ray counters take increments.
            if tag in scalars and scalars[tag] > self._counted.get(tag, 0):
                counter.inc(scalars[tag] - self._counted.get(tag, 0))
                self._counted[tag] = scalars[tag]
        if self.bar is not None and advance:
            # Postfix first: update() redraws, and must show this step's figures, not the previous ones.
            self.bar.set_postfix(
                reward=f"{scalars.get('reward/mean', float('nan')):.4f}",
                staleness=f"{scalars.get('staleness/mean', 0.0):.2f}",
                refresh=False,
            )
            self.bar.update(1)

    def rewind(self, step: int, totals: dict[str, float] | None = None) -> None:
        """The run went back to `step` (learners restarted from a checkpoint) and logs the later steps again:
        TensorBoard drops the ones it holds, as for a resumed run; the progress bar goes back. `totals`: the running
        totals the rewind set back to the checkpoint's (train/skipped_steps); their Ray counters count on from there,
        so the new timeline's increments are counted (they were not until it passed the voided timeline's total)."""
        for tag, value in (totals or {}).items():
            if tag in self.counters:  # min: a resumed run rewound before its first step counts the checkpoint's yet
                self._counted[tag] = min(self._counted.get(tag, 0), value)
        if self.writer is not None:
            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            # What purge_step writes, in the same file: a new writer's file could sort before this one (TensorBoard
            # orders a directory's files by name: the same second's files by a counter compared as text, "10" < "9").
            self.writer._get_file_writer().add_event(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def log_images(self, step: int, tag: str, grid: torch.Tensor) -> None:
        """grid [H, W, 3] uint8."""
        if self.writer is not None:
            self.writer.add_image(tag, grid.numpy(), step, dataformats="HWC")
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(grid.numpy()), WANDB_STEP: step})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self._redirect.__exit__(None, None, None)
            self.bar.close()
