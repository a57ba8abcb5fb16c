"""Monitor: TensorBoard scalars and images read back from the event files, Ray metrics, the progress bar."""

import glob
import io
import json
import os
import re
import time
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rayflow.config import LoggingConfig
from rayflow.logging.monitor import Monitor, exported_metric_names, image_grid
from rayflow.paths import REPO_ROOT

GRAFANA = os.path.join(REPO_ROOT, "cluster", "grafana", "rayflow.json")

QUIET = dict(ray_metrics=False, progress_bar=False)


def events(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0})  # 0: keep everything
    acc.Reload()
    return acc


def scalars_at(step: int) -> dict[str, float]:
    return {"reward/mean": 0.25 * step, "loss/policy": -1.5 + step, "reward/color#1": 0.125 * step,
            "rollout/regenerated": float(step // 2)}


def test_scalars_are_written_with_exactly_the_given_tags_and_values(tmp_path):
    monitor = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=4)
    for step in range(4):
        monitor.log(step, scalars_at(step))
    monitor.close()
    acc = events(tmp_path)
    assert set(acc.Tags()["scalars"]) == set(scalars_at(0))
    for tag in scalars_at(0):
        logged = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert logged == [(step, pytest.approx(scalars_at(step)[tag])) for step in range(4)], tag


def test_a_resumed_run_replaces_the_steps_it_trains_again(tmp_path):
    first = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=6)
    for step in range(1, 6):  # the stopped run logged steps 1..5; its last checkpoint is step 3
        first.log(step, {"reward/mean": float(step)})
    first.close()
    next_second()
    resumed = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=6, start_step=3)
    for step in range(4, 7):
        resumed.log(step, {"reward/mean": 10.0 * step})
    resumed.close()
    logged = [(e.step, e.value) for e in events(tmp_path).Scalars("reward/mean")]
    assert logged == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def next_second() -> None:
    """Sleep into the next second: a later process's event file is named with a later time (within one second
    TensorBoard orders the files by a per-process counter compared as text, which a test process's many writers
    carry past a digit: "10" sorts before "9")."""
    time.sleep(1.01 - time.time() % 1)


def test_a_rewind_replaces_the_steps_trained_again_in_the_same_file(tmp_path):
    monitor = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=6)
    for step in (1, 2, 3):
        monitor.log(step, {"reward/mean": float(step)})
    monitor.rewind(1)  # learners restarted from step 1's checkpoint: steps 2 and 3 are trained again
    for step in (2, 3, 4):
        monitor.log(step, {"reward/mean": 10.0 * step})
    monitor.close()
    assert len(os.listdir(tmp_path)) == 1
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("reward/mean")] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_a_run_that_starts_over_replaces_its_first_tries_steps(tmp_path):
    # The first try evaluated at step 0 and logged steps 1..3, then died before its first checkpoint; the same command
    # starts over at step 0 in the same directory. Its steps showed twice, the step-0 evaluation too.
    first = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=6)
    first.log(0, {"eval/reward_mean": 0.5}, advance=False)
    for step in (1, 2, 3):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    next_second()
    again = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=6, start_step=0)
    again.log(0, {"eval/reward_mean": 0.25}, advance=False)
    for step in (1, 2):
        again.log(step, {"reward/mean": 10.0 * step})
    again.close()
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("reward/mean")] == [(1, 10.0), (2, 20.0)]
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("eval/reward_mean")] == [(0, 0.25)]


def test_log_every_writes_only_every_nth_step(tmp_path):
    monitor = Monitor(str(tmp_path), LoggingConfig(log_every=3, **QUIET), total_steps=8)
    for step in range(8):
        monitor.log(step, {"reward/mean": float(step)})
    monitor.close()
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("reward/mean")] == [(0, 0.0), (3, 3.0), (6, 6.0)]


def test_log_every_does_not_thin_evaluations(tmp_path):
    """An evaluation at a step log_every skips (the time limit's last one, or eval_every not a multiple) is written."""
    monitor = Monitor(str(tmp_path), LoggingConfig(log_every=5, **QUIET), total_steps=13)
    for step in (2, 10, 13):
        monitor.log(step, {"eval/reward_mean": float(step)}, advance=False)
    monitor.close()
    assert [(e.step, e.value) for e in events(tmp_path).Scalars("eval/reward_mean")] == [(2, 2.0), (10, 10.0), (13, 13.0)]


def test_tensorboard_off_writes_no_event_files(tmp_path):
    monitor = Monitor(str(tmp_path / "run"), LoggingConfig(tensorboard=False, **QUIET), total_steps=2)
    monitor.log(0, {"reward/mean": 1.0})
    monitor.log_images(0, "samples", torch.zeros(4, 4, 3, dtype=torch.uint8))
    monitor.close()
    assert not (tmp_path / "run").exists()


def test_image_grid_is_written_and_reads_back_exactly(tmp_path):
    grid = torch.randint(0, 256, (12, 20, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    monitor = Monitor(str(tmp_path), LoggingConfig(**QUIET), total_steps=1)
    monitor.log_images(5, "samples/train", grid)
    monitor.close()
    acc = events(tmp_path)
    assert acc.Tags()["images"] == ["samples/train"]
    (image,) = acc.Images("samples/train")
    assert (image.step, image.height, image.width) == (5, 12, 20)
    decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(decoded, grid.numpy())  # PNG: lossless


def test_image_grid_layout():
    # Five 2x3 images, each filled with its own index + 1: three rows of two, the last cell black.
    tiles = [torch.full((2, 3, 3), i + 1, dtype=torch.uint8) for i in range(5)]
    tiles[0][0, 0] = torch.tensor([200, 100, 50], dtype=torch.uint8)  # orientation: top-left pixel of the first
    grid = image_grid(tiles, columns=2)
    assert grid.shape == (6, 6, 3) and grid.dtype == torch.uint8
    expected = torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.uint8)  # [rows, columns] tile values
    expected = expected.repeat_interleave(2, dim=0).repeat_interleave(3, dim=1)[..., None].expand(6, 6, 3).clone()
    expected[0, 0] = torch.tensor([200, 100, 50])
    torch.testing.assert_close(grid, expected)
    assert image_grid(tiles[:3], columns=4).shape == (2, 9, 3)  # fewer images than columns: no black cells


class FakeMetric:
    made: dict[str, "FakeMetric"] = {}

    def __init__(self, name: str, description: str = ""):
        self.name, self.description, self.values, self.increments = name, description, [], []
        FakeMetric.made[name] = self

    def set(self, value):
        self.values.append(value)

    def inc(self, value=1.0):
        assert value > 0  # Ray's Counter refuses non-positive increments
        self.increments.append(value)


def test_ray_metrics_get_latest_values_and_counter_increments(tmp_path, monkeypatch):
    import ray.util.metrics

    FakeMetric.made = {}
    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeMetric)
    monkeypatch.setattr(ray.util.metrics, "Counter", FakeMetric)
    monitor = Monitor(str(tmp_path), LoggingConfig(tensorboard=False, progress_bar=False), total_steps=4)
    totals = [0, 2, 2, 5]  # running totals, as the driver reports them
    for step, total in enumerate(totals):
        monitor.log(step, {"reward/mean": 0.1 * step, "rollout/regenerated": total, "rollout/dropped": 0})
    monitor.close()
    made = FakeMetric.made
    assert made["rayflow_reward_mean"].values == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert made["rayflow_rollout_regenerated"].increments == [2, 3]
    assert made["rayflow_rollout_dropped"].increments == []
    assert made["rayflow_staleness_max"].values == []  # not reported: not set
    assert made["rayflow_rollout_regenerated"].description == "rollout/regenerated"


def test_a_rewind_sets_the_skipped_steps_counter_back_so_the_new_timelines_skips_are_counted(tmp_path, monkeypatch):
    """train/skipped_steps is the timeline's running total: a learner rewind sets it back to the checkpoint's. The Ray
    counter kept the voided timeline's total as its baseline, so the new timeline's skips went uncounted (and the
    dashboard's skips per minute showed none) until they passed it. It counts every skipped step trained."""
    import ray.util.metrics

    FakeMetric.made = {}
    monkeypatch.setattr(ray.util.metrics, "Gauge", FakeMetric)
    monkeypatch.setattr(ray.util.metrics, "Counter", FakeMetric)
    monitor = Monitor(str(tmp_path), LoggingConfig(tensorboard=False, progress_bar=False), total_steps=5)
    for step, total in [(1, 0), (2, 1), (3, 2)]:  # steps 2 and 3 skipped; the checkpoint at step 1 holds 0
        monitor.log(step, {"train/skipped_steps": total, "rollout/regenerated": 1})
    monitor.rewind(1, {"train/skipped_steps": 0})
    for step, total in [(2, 0), (3, 1), (4, 2)]:  # the new timeline skips steps 3 and 4
        monitor.log(step, {"train/skipped_steps": total, "rollout/regenerated": 1})
    monitor.close()
    assert FakeMetric.made["rayflow_train_skipped_steps"].increments == [1, 1, 1, 1]
    assert FakeMetric.made["rayflow_rollout_regenerated"].increments == [1]  # kept across a rewind: not set back


def scrape(port: int, names: set[str], timeout_s: float = 60) -> dict[str, float]:
    """Values of `names` on a node's Prometheus endpoint, polled until all are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                 if line.split("{")[0] in names}
        if set(found) == names or time.monotonic() > deadline:
            return found
        time.sleep(1)


def test_ray_metrics_on_a_live_ray_are_scraped_under_the_documented_names(ray_session, tmp_path):
    monitor = Monitor(str(tmp_path), LoggingConfig(tensorboard=False, progress_bar=False), total_steps=3)
    assert set(monitor.gauges) >= {"reward/mean", "staleness/mean"} and "train/skipped_steps" in monitor.counters
    for step, total in enumerate([1, 1, 4]):
        monitor.log(step, {"reward/mean": 0.5, "staleness/max": 2, "train/skipped_steps": total})
    monitor.close()
    assert monitor._counted == {"train/skipped_steps": 4}
    names = exported_metric_names()
    assert (names["reward/mean"], names["train/skipped_steps"]) == ("ray_rayflow_reward_mean", "ray_rayflow_train_skipped_steps_total")
    port = next(n["MetricsExportPort"] for n in ray_session.nodes() if n["Alive"])
    wanted = {names["reward/mean"], names["staleness/max"], names["train/skipped_steps"]}
    assert scrape(port, wanted) == {names["reward/mean"]: 0.5, names["staleness/max"]: 2.0, names["train/skipped_steps"]: 4.0}


def test_the_grafana_dashboard_queries_only_exported_metrics():
    with open(GRAFANA) as f:
        dashboard = json.load(f)
    queried = {m for panel in dashboard["panels"] for t in panel["targets"] for m in re.findall(r"ray_rayflow_\w+", t["expr"])}
    assert queried and queried <= set(exported_metric_names().values())
    assert {"ray_rayflow_reward_mean", "ray_rayflow_staleness_max"} <= queried


def test_wandb_offline_logs_every_scalar_under_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monitor = Monitor(str(tmp_path / "tb"), LoggingConfig(wandb=True, **QUIET), total_steps=3,
                      wandb_run={"name": "run-a", "dir": str(tmp_path / "run-a"), "config": {"algorithm": {"name": "flow_grpo"}}})
    for step in range(1, 4):
        monitor.log(step, {"reward/mean": 0.125 * step, "loss/policy": -0.5})
    # A rewind to step 1 trains step 2 again: W&B's own step must grow, and dropped it ("less than the current step").
    monitor.rewind(1)
    monitor.log(2, {"reward/mean": 0.8125, "loss/policy": -0.5})
    monitor.close()
    (run_dir,) = glob.glob(str(tmp_path / "run-a" / "wandb" / "offline-run-*-run-a"))
    (records,) = glob.glob(os.path.join(run_dir, "run-run-a.wandb"))
    expected = (b"reward/mean", b"loss/policy", b"0.375", b"flow_grpo", b"trainer/step", b"0.8125")
    # wandb.finish() can return before wandb-core's writer has flushed the records (seen under CPU load: the file
    # held its 7-byte header, and all of them 3 s later), so wait for them, up to a deadline.
    deadline = time.monotonic() + 30
    while True:
        data = open(records, "rb").read()  # protobuf records: keys and JSON values are stored as text
        if all(key in data for key in expected) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(key in data for key in expected), data[:200]


def test_progress_bar_on_and_off(tmp_path, capsys):
    quiet = Monitor(str(tmp_path / "a"), LoggingConfig(tensorboard=False, ray_metrics=False, progress_bar=False),
                    total_steps=3)
    quiet.log(0, {"reward/mean": 0.5})
    quiet.close()
    assert quiet.bar is None
    assert capsys.readouterr().err == ""

    shown = Monitor(str(tmp_path / "b"), LoggingConfig(tensorboard=False, ray_metrics=False), total_steps=10,
                    start_step=4)
    shown.bar.mininterval, shown.bar.miniters = 0, 1  # draw at every update, so every frame can be checked
    shown.log(4, {"reward/mean": 0.5})
    shown.log(5, {"reward/mean": 0.75, "staleness/mean": 1.5})
    assert (shown.bar.n, shown.bar.total) == (6, 10)  # resumed at step 4, two more steps
    shown.log(5, {"eval/reward_mean": 0.5}, advance=False)  # extra figures of a step: the bar stays
    assert shown.bar.n == 6
    shown.close()
    err = capsys.readouterr().err
    assert "rayflow" in err and "reward=0.7500" in err and "staleness=1.50" in err
    # Each redraw shows its own step's reward: "5/10" is drawn with step 4's 0.5000, "6/10" with 0.7500.
    frames = err.split("\r")
    assert any("5/10" in f and "reward=0.5000" in f for f in frames) and not any("6/10" in f and "reward=0.5000" in f for f in frames)
