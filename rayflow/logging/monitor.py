"""What a run shows while it trains: TensorBoard scalars and image grids under trainer.logdir, the key
figures as Ray metrics (so the Ray dashboard's Metrics view has them), and a progress bar.

Tags are stable: dashboards and the README's table rely on them.
"""

from __future__ import annotations

import math

import torch

from rayflow.config import LoggingConfig

SCALAR_TAGS = (
    "reward/mean",
    "reward/std",
    "loss/policy",
    "loss/kl",
    "train/clip_frac",
    "train/grad_norm",
    "train/skipped_steps",
    "train/zero_signal_groups",
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
    "perf/sync_s",
    "perf/rollout_idle",
    "perf/learner_idle",
)
"""Plus reward/<component> for every reward function, and eval/reward_mean."""

# Exported to Ray's metrics (Prometheus names): gauges of the latest value, counters of totals.
_GAUGES = ("reward/mean", "loss/policy", "staleness/mean", "staleness/max", "perf/images_per_s", "perf/step_s",
           "rollout/queue_depth")
_COUNTERS = ("rollout/regenerated", "rollout/dropped", "rollout/replica_restarts", "train/skipped_steps")


def _metric_name(tag: str) -> str:
    return "rayflow_" + tag.replace("/", "_").replace("#", "_")


def image_grid(images: list[torch.Tensor], columns: int = 4) -> torch.Tensor:
    """[H, W, 3] uint8 images (same size) -> one [rows·H, columns·W, 3] grid, row-major."""
    h, w, c = images[0].shape
    rows = math.ceil(len(images) / columns)
    grid = torch.zeros(rows * h, columns * w, c, dtype=torch.uint8)
    for i, image in enumerate(images):
        r, col = divmod(i, columns)
        grid[r * h : (r + 1) * h, col * w : (col + 1) * w] = image
    return grid


class Monitor:
    """Writes one step's figures everywhere they are watched."""

    def __init__(self, logdir: str, cfg: LoggingConfig, total_steps: int, start_step: int = 0, use_ray: bool = True):
        self.cfg = cfg
        self.writer = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(logdir)
        self.gauges, self.counters, self._counted = {}, {}, {}
        if cfg.ray_metrics and use_ray:
            from ray.util.metrics import Counter, Gauge

            self.gauges = {t: Gauge(_metric_name(t), description=t) for t in _GAUGES}
            self.counters = {t: Counter(_metric_name(t), description=t) for t in _COUNTERS}
        self.bar = None
        if cfg.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="rayflow", dynamic_ncols=True)

    def log(self, step: int, scalars: dict[str, float], advance: bool = True) -> None:
        """Write one step's scalars; `advance` moves the progress bar (once per training step)."""
        if self.writer is not None and step % self.cfg.log_every == 0:
            for tag, value in scalars.items():
                self.writer.add_scalar(tag, value, step)
        for tag, gauge in self.gauges.items():
            if tag in scalars:
                gauge.set(scalars[tag])
        for tag, counter in self.counters.items():
            # The scalars carry running totals; Ray counters take increments.
            if tag in scalars and scalars[tag] > self._counted.get(tag, 0):
                counter.inc(scalars[tag] - self._counted.get(tag, 0))
                self._counted[tag] = scalars[tag]
        if self.bar is not None and advance:
            self.bar.update(1)
            self.bar.set_postfix(
                reward=f"{scalars.get('reward/mean', float('nan')):.4f}",
                staleness=f"{scalars.get('staleness/mean', 0.0):.2f}",
                refresh=False,
            )

    def log_images(self, step: int, tag: str, grid: torch.Tensor) -> None:
        """grid [H, W, 3] uint8."""
        if self.writer is not None:
            self.writer.add_image(tag, grid.numpy(), step, dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()
