"""tools/plot_run.py draws the panels whose tags a run logged, from its TensorBoard events."""

import os
import subprocess
import sys

from PIL import Image
from torch.utils.tensorboard import SummaryWriter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plot_run_draws_the_logged_panels(tmp_path):
    run = tmp_path / "run"
    writer = SummaryWriter(str(run / "tensorboard"))
    for step in range(1, 4):
        writer.add_scalar("reward/mean", 0.1 * step, step)
        writer.add_scalar("eval/shapes_accuracy", 0.2 * step, step)
    writer.close()
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from plot_run import plot, read_scalars

    scalars = read_scalars(str(run / "tensorboard"))
    assert scalars["reward/mean"][0] == [1, 2, 3]
    assert plot(scalars, str(tmp_path / "two.png"), "run") == 2  # reward and accuracy; no KL, staleness, step time
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(run), "--out", str(tmp_path / "fig.png")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Image.open(tmp_path / "fig.png").size == Image.open(tmp_path / "two.png").size
    empty = tmp_path / "empty"
    SummaryWriter(str(empty)).close()
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(empty), "--out", str(tmp_path / "x.png")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "holds none of the plotted tags" in done.stderr
    missing = str(tmp_path / "no_such_run")
    done = subprocess.run([sys.executable, "tools/plot_run.py", missing, "--out", str(tmp_path / "x.png")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and f"run_dir {missing!r} is not a directory" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    nowhere = str(tmp_path / "no_such_dir" / "x.png")  # named before the events are read
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(run), "--out", nowhere], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode == 2 and f"--out: {nowhere!r} is in no existing directory" in done.stderr, done.stderr


def test_plot_run_grids_before_and_after(tmp_path):
    """--grids reads back the first and last eval/images exactly (PNG is lossless) and labels rows with the
    run's evaluation prompts."""
    import numpy as np

    sys.path.insert(0, os.path.join(REPO, "tools"))
    from plot_run import read_grids, row_prompts

    run = tmp_path / "run"
    prompts = tmp_path / "eval.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    (run).mkdir()
    (run / "config.yaml").write_text(f"data:\n  eval_prompts: {prompts}\n  eval_seeds: 3\n")
    rng = np.random.default_rng(0)
    grids = {step: rng.integers(0, 256, (2 * 8, 3 * 8, 3), dtype=np.uint8) for step in (0, 20, 40)}
    restarted = rng.integers(0, 256, (2 * 8, 3 * 8, 3), dtype=np.uint8)
    writer = SummaryWriter(str(run / "tensorboard"))
    # A run whose first try died after its step-0 grid, started again from the start: step 0 is logged twice.
    for step, grid in ((0, restarted), (20, grids[20]), (0, grids[0]), (40, grids[40])):
        writer.add_image("eval/images", grid, step, dataformats="HWC")
        writer.add_scalar("eval/shapes_accuracy", step / 100, step)
    writer.close()
    read = read_grids(str(run / "tensorboard"))
    assert [s for s, _ in read] == [0, 20, 40]  # the last grid logged at each step (sorting them compared arrays)
    assert all(np.array_equal(image, grids[s]) for s, image in read)
    assert row_prompts(str(run)) == ["a red circle", "two blue squares"]  # a row per prompt: its 3 seeds
    (run / "config.yaml").write_text(f"data:\n  eval_prompts: {prompts}\n  eval_seeds: 1\n")
    assert row_prompts(str(run)) is None  # one seed: four images to a row, rows are not prompts
    (run / "config.yaml").write_text(f"data:\n  eval_prompts: {prompts}\n  eval_seeds: 3\n")
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(run), "--out", str(tmp_path / "fig.png"),
                           "--grids", str(tmp_path / "grids.png")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Image.open(tmp_path / "grids.png").size[0] > 2 * 3 * 8  # both grids, with the prompts beside
    one = tmp_path / "one"
    writer = SummaryWriter(str(one / "tensorboard"))
    writer.add_image("eval/images", grids[0], 0, dataformats="HWC")
    writer.add_scalar("eval/shapes_accuracy", 0.1, 0)
    writer.close()
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(one), "--out", str(tmp_path / "f.png"),
                           "--grids", str(tmp_path / "g.png")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0 and "holds 1 eval/images grid(s)" in done.stderr


def test_grid_rows_take_a_relative_eval_prompts_from_where_the_run_started(tmp_path, monkeypatch, capsys):
    """`data.eval_prompts=prompts/eval.txt` on the command line stays relative in config.yaml, relative to the directory
    the run started in: plot_run.py run from another directory lost the row labels without a word."""
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from plot_run import row_prompts

    start, elsewhere = tmp_path / "start", tmp_path / "elsewhere"
    (start / "prompts").mkdir(parents=True)
    (start / "prompts" / "eval.txt").write_text("a red circle\ntwo blue squares\n")
    run = start / "outputs" / "run1"
    run.mkdir(parents=True)
    elsewhere.mkdir()
    (run / "config.yaml").write_text("data:\n  eval_prompts: prompts/eval.txt\n  eval_seeds: 3\n"
                                     "trainer:\n  output_dir: outputs\n  run_name: run1\n")
    for cwd, run_dir in ((start, "outputs/run1"), (elsewhere, "../start/outputs/run1"), (tmp_path, str(run))):
        monkeypatch.chdir(cwd)
        assert row_prompts(run_dir) == ["a red circle", "two blue squares"], cwd
    (run / "config.yaml").write_text("data:\n  eval_prompts: prompts/gone.txt\n  eval_seeds: 3\n"
                                     "trainer:\n  output_dir: outputs\n  run_name: run1\n")
    assert row_prompts(str(run)) is None
    assert f"data.eval_prompts of {run / 'config.yaml'} is {str(start / 'prompts' / 'gone.txt')!r}" in capsys.readouterr().err


def test_plot_run_reads_a_rewound_run_as_tensorboard_shows_it(tmp_path):
    """After a rewind (learners restarted from a checkpoint) the run logs the later steps again: plot_run's reader
    (EventAccumulator, which honours the purge Monitor.rewind writes) has only the values trained again."""
    import torch

    from rayflow.config import LoggingConfig
    from rayflow.logging.monitor import Monitor

    sys.path.insert(0, os.path.join(REPO, "tools"))
    from plot_run import read_grids, read_scalars

    def grid(value: int) -> torch.Tensor:
        return torch.full((8, 8, 3), value, dtype=torch.uint8)

    events = str(tmp_path / "run" / "tensorboard")
    monitor = Monitor(events, LoggingConfig(ray_metrics=False, progress_bar=False), total_steps=4)
    for step in (1, 2, 3):  # abandoned after step 3: the learners go back to step 1's checkpoint
        monitor.log(step, {"reward/mean": float(step)})
        monitor.log_images(step, "eval/images", grid(step))
    monitor.rewind(1)
    for step in (2, 3, 4):
        monitor.log(step, {"reward/mean": 10.0 * step})
        monitor.log_images(step, "eval/images", grid(10 * step))
    monitor.close()
    assert read_scalars(events)["reward/mean"] == ([1, 2, 3, 4], [1.0, 20.0, 30.0, 40.0])
    assert [(step, int(image[0, 0, 0])) for step, image in read_grids(events)] == [(1, 1), (2, 20), (3, 30), (4, 40)]


def test_plot_run_finds_the_events_where_the_runs_trainer_logdir_put_them(tmp_path, monkeypatch):
    """A run started with trainer.logdir elsewhere keeps it in its config.yaml (relative to where it started, when given
    so): plot_run.py RUN_DIR read RUN_DIR itself and said it "holds none of the plotted tags"."""
    start = tmp_path / "start"
    run = start / "outputs" / "run1"
    run.mkdir(parents=True)
    writer = SummaryWriter(str(start / "tb" / "run1"))
    writer.add_scalar("reward/mean", 0.5, 1)
    writer.close()
    monkeypatch.chdir(tmp_path)  # not where the run started
    for logdir in (str(start / "tb" / "run1"), "tb/run1"):
        (run / "config.yaml").write_text(f"trainer:\n  output_dir: outputs\n  run_name: run1\n  logdir: {logdir}\n")
        done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_run.py"), str(run), "--out",
                               str(tmp_path / "fig.png")], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
        assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    (run / "config.yaml").write_text("trainer:\n  logdir: /no/such/tb\nlogging:\n  tensorboard: false\n")
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(run), "--out", str(tmp_path / "fig.png")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "logging.tensorboard=false" in done.stderr and "Traceback" not in done.stderr, done.stderr
    (run / "config.yaml").write_text("trainer:\n  logdir: /no/such/tb\n")
    done = subprocess.run([sys.executable, "tools/plot_run.py", str(run), "--out", str(tmp_path / "fig.png")], cwd=REPO,
                          capture_output=True, text=True)
    assert done.returncode != 0 and "trainer.logdir" in done.stderr and "'/no/such/tb'" in done.stderr, done.stderr


def test_plot_run_names_an_output_format_matplotlib_cannot_write_before_reading_the_run(tmp_path):
    """--out fig.txt was a ValueError traceback once the events were read (--grids g.txt: after --out was written), and
    --out fig (no extension) wrote fig.png while saying "wrote fig"."""
    run = tmp_path / "run"
    writer = SummaryWriter(str(run / "tensorboard"))
    writer.add_scalar("reward/mean", 0.5, 1)
    writer.close()
    for args, flag, value in ((["--out", str(tmp_path / "fig.txt")], "--out", str(tmp_path / "fig.txt")),
                              (["--out", str(tmp_path / "fig")], "--out", str(tmp_path / "fig")),
                              (["--out", str(tmp_path / "fig.png"), "--grids", str(tmp_path / "g.txt")], "--grids",
                               str(tmp_path / "g.txt"))):
        done = subprocess.run([sys.executable, "tools/plot_run.py", str(run), *args], cwd=REPO, capture_output=True,
                              text=True)
        assert done.returncode == 2 and f"{flag}: {value!r}" in done.stderr and ".png" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not os.path.exists(tmp_path / "fig.png") and not os.path.exists(tmp_path / "fig")
