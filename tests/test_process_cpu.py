"""tools/process_cpu.py: CPU seconds by process role, which `bench.py pipeline` reports per configuration."""

import os
import subprocess
import sys
import time

import pytest

from tools import process_cpu

BURN = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\ntime.sleep(30)"


@pytest.mark.parametrize("cmdline, role", [
    ("ray::LearnerWorker", "ray::LearnerWorker"),
    ("ray::RolloutWorker.sample()", "ray::RolloutWorker.sample()"),
    ("ray::IDLE", "ray (other)"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x", "raylet"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=x", "gcs_server"),
    ("/venv/bin/python -u /venv/lib/python3.11/site-packages/ray/_private/log_monitor.py", "ray (other)"),
    ("/usr/sbin/sshd -D", "other processes"),
])
def test_processes_are_named_by_their_ray_role(cmdline, role):
    assert process_cpu.role_of(cmdline, pid=2, driver_pid=1) == role
    assert process_cpu.role_of(cmdline, pid=1, driver_pid=1) == "driver"


def test_cpu_is_counted_by_each_processs_role_at_the_end_of_the_window():
    """An idle worker that became a learner actor counts under the actor; a process started in the window counts
    from 0; one that ended in it is not counted (its time is gone from /proc)."""
    before = process_cpu.Snapshot({1: (1.0, "driver"), 2: (0.5, "ray (other)"), 4: (3.0, "raylet")}, idle_s=10.0, total_s=20.0)
    after = process_cpu.Snapshot({1: (1.5, "driver"), 2: (2.0, "ray::LearnerWorker"), 3: (0.2, "raylet")},
                                 idle_s=11.0, total_s=24.0)
    assert process_cpu.cpu_by_role(before, after) == {"ray::LearnerWorker": 1.5, "driver": 0.5, "raylet": 0.2}
    assert list(process_cpu.cpu_by_role(before, after)) == ["ray::LearnerWorker", "driver", "raylet"]  # most first
    assert process_cpu.busy_fraction(before, after) == 1 - 1.0 / 4.0


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads Linux's /proc")
def test_a_process_that_burns_a_known_cpu_time_is_read_with_it():
    """A child spins 0.4 s of its own CPU time, then sleeps: the snapshots read at least that, and not much more
    (the interpreter's start-up), whatever else the machine runs meanwhile."""
    before = process_cpu.snapshot()
    child = subprocess.Popen([sys.executable, "-c", BURN.format(seconds=0.4)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process_cpu.snapshot().cpu_s.get(child.pid, (0.0,))[0] < 0.4:
            time.sleep(0.05)
        after = process_cpu.snapshot()
    finally:
        child.kill()
        child.wait()
    assert child.pid not in before.cpu_s
    spent, role = after.cpu_s[child.pid]
    assert 0.4 <= spent < 0.4 + 0.3 and role == "other processes"
    assert after.cpu_s[os.getpid()][1] == "driver"
    assert 0.0 < process_cpu.busy_fraction(before, after) <= 1.0
