"""Every thread's stack, once, for a test still running `slow_test_stacks_s` seconds (pytest.ini) after it started:
where a rare long wait sits, in the output of the run that met it. The test goes on (pytest-timeout fails it later).

In place of pytest's `faulthandler_timeout`, whose watchdog thread reads the other threads' frames without holding
the GIL (python/cpython#116008): dumping ten times a second through the learning test's training loop, it crashed the
process in traceback.c's dump_frame after 40-330 dumps (CPython 3.11.7, 2026-12-02), and a CI worker died in that
test, the one that runs past 150 s on a slow machine. Here a timer thread reads `sys._current_frames()` holding the
GIL.
"""

import os
import sys
import threading
import traceback

import pytest

_stderr_fd = None  # the run's own stderr, not a test's captured one


def pytest_addoption(parser) -> None:
    parser.addini("slow_test_stacks_s", "print every thread's stack once for a test running this long (0: never)",
                  default="0")


def pytest_configure(config) -> None:
    global _stderr_fd
    _stderr_fd = os.dup(2)  # capture is suspended while plugins are configured: this is the terminal's stderr


def pytest_unconfigure(config) -> None:
    os.close(_stderr_fd)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    after_s = float(item.config.getini("slow_test_stacks_s"))
    timer = threading.Timer(after_s, write_stacks, args=(item.nodeid, after_s)) if after_s > 0 else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


def write_stacks(nodeid: str, after_s: float) -> None:
    """Every other thread's stack, as traceback prints it, to the run's stderr."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    text = f"\n{nodeid} still running after {after_s:g} s; every thread's stack, most recent call last:\n"
    for ident, frame in sys._current_frames().items():
        if ident != threading.get_ident():
            text += f"\nThread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
    os.write(_stderr_fd, text.encode(errors="replace"))
