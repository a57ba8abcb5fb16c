"""Last words for a crashed pytest-xdist worker, in the run's summary (tests/conftest.py loads this plugin).

A worker that dies mid-test (a segfault, an abort in Ray's C++ core worker, a SIGKILL) is reported as "worker 'gw1'
crashed while running ..." and no more: what it printed as it died went to its own stderr, in the middle of the
run's output, of which CI keeps the end. With this plugin the crash's report, among the failures at the end, also
holds:
- the worker's exit status (a negative one is the signal that ended it);
- faulthandler's dump of every thread's Python stack on a fatal signal: each worker writes it to a file of its own;
- the end of the Ray core driver's log of that process, if it ran a Ray driver: a failed Ray CHECK or a lost raylet
  ends a driver there, with no Python traceback.
"""

import faulthandler
import glob
import os
import shutil
import subprocess
import tempfile

import pytest

DIRECTORY_VARIABLE = "RAYFLOW_TEST_LAST_WORDS"
"""The directory, made by the controller, where each worker writes WORKER_ID.log: its pid, then faulthandler's dump."""
RAY_DRIVER_LOG_LINES = 20

_last_words_file = None  # open for faulthandler while the worker runs


def pytest_configure(config) -> None:
    # In the controller, before it starts the workers (at session start): they inherit the variable.
    if os.environ.get("PYTEST_XDIST_WORKER") is None and getattr(config.option, "numprocesses", None):
        os.environ[DIRECTORY_VARIABLE] = tempfile.mkdtemp(prefix="rayflow-last-words-")


def pytest_sessionstart(session) -> None:
    # In a worker, once every plugin is configured: pytest's faulthandler plugin enables it, to stderr, then.
    global _last_words_file
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is not None and DIRECTORY_VARIABLE in os.environ:
        _last_words_file = open(os.path.join(os.environ[DIRECTORY_VARIABLE], f"{worker}.log"), "w")
        _last_words_file.write(f"{os.getpid()}\n")
        _last_words_file.flush()
        faulthandler.enable(_last_words_file, all_threads=True)  # in place of pytest's


def pytest_unconfigure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None and DIRECTORY_VARIABLE in os.environ:
        shutil.rmtree(os.environ.pop(DIRECTORY_VARIABLE), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; the GPU machine runs pytest without xdist
def pytest_handlecrashitem(crashitem: str, report, sched) -> None:
    report.longrepr = f"{report.longrepr}\n{last_words(report.node)}"


def last_words(worker) -> str:
    """The crashed `worker`'s exit status, faulthandler's dump and the end of its Ray core driver log."""
    popen = getattr(getattr(worker.gateway, "_io", None), "popen", None)  # the process of execnet's popen gateway
    try:
        status = f"exit status {popen.wait(timeout=10)}" if popen is not None else "exit status unknown"
    except subprocess.TimeoutExpired:
        status = "still running 10 s after its connection closed"
    path = os.path.join(os.environ.get(DIRECTORY_VARIABLE, ""), f"{worker.gateway.id}.log")
    if not os.path.exists(path):
        return f"{status}; no last-words file ({path})"
    with open(path, errors="replace") as f:
        pid, dump = f.readline().strip(), f.read().strip()
    parts = [f"{status}, pid {pid}", "faulthandler: " + (dump or "nothing (no fatal signal that it catches)")]
    ray_temp = os.path.join(os.environ.get("RAY_TMPDIR", tempfile.gettempdir()), "ray")
    for log in sorted(glob.glob(os.path.join(ray_temp, "session_*", "logs", f"python-core-driver-*_{pid}.log"))):
        with open(log, errors="replace") as f:
            parts.append(f"the end of {log}:\n" + "\n".join(f.read().splitlines()[-RAY_DRIVER_LOG_LINES:]))
    return "\n".join(parts)
