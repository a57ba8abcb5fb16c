"""The suite's own diagnostics, each run in a pytest of its own: a crashed pytest-xdist worker's last words in the
summary (tests/crash_reports.py) and a slow test's stacks (tests/slow_test_stacks.py)."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

DYING_TEST = """
import faulthandler, os, pathlib

def test_dies():
    logs = pathlib.Path(os.environ["RAY_TMPDIR"], "ray", "session_1", "logs")
    logs.mkdir(parents=True)
    (logs / f"python-core-driver-01000000_{os.getpid()}.log").write_text("earlier line\\nCheck failed: as Ray's\\n")
    faulthandler._sigsegv()
"""

SLOW_TEST = """
import threading, time

def test_slow():
    threading.Thread(target=time.sleep, args=(30,), name="a-sleeper", daemon=True).start()
    for _ in range(25):
        time.sleep(0.1)
"""


def run_pytest(tmp_path, test_source: str, *options: str) -> subprocess.CompletedProcess:
    """`pytest OPTIONS test_it.py` over `test_source`, in `tmp_path`, the plugins importable, none of this run's
    pytest variables."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_it.py").write_text(test_source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "RAYFLOW_TEST_"))}
    env.update(PYTHONPATH=TESTS, RAY_TMPDIR=str(tmp_path / "ray-tmp"))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *options, "test_it.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_crashed_workers_report_holds_its_exit_status_fatal_traceback_and_ray_driver_log(tmp_path):
    run = run_pytest(tmp_path, DYING_TEST, "-n", "1", "-p", "crash_reports")
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.stdout[run.stdout.index("= FAILURES ="):]  # the part of the output CI keeps
    assert "worker 'gw0' crashed while running 'test_it.py::test_dies'" in summary
    assert "exit status -11" in summary  # SIGSEGV
    assert "Fatal Python error: Segmentation fault" in summary
    assert 'test_it.py", line 8 in test_dies' in summary  # faulthandler's frame: the line that crashed
    assert "earlier line\nCheck failed: as Ray's" in summary  # the end of the Ray core driver's log of that process


def test_a_test_running_past_the_limit_prints_every_threads_stack_once_and_goes_on(tmp_path):
    run = run_pytest(tmp_path, SLOW_TEST, "-p", "slow_test_stacks", "-o", "slow_test_stacks_s=0.5")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr.count("test_it.py::test_slow still running after 0.5 s") == 1, run.stderr
    stacks = run.stderr[run.stderr.index("still running"):]
    assert 'test_it.py", line 7, in test_slow' in stacks  # the test's own thread, in its sleep loop
    assert "Thread a-sleeper:" in stacks
