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
