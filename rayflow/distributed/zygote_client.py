"""A local Ray's worker command: asks the zygote to fork the worker, then stands in for it until it ends.

Ray runs `python ENTRY ARGS...`, ENTRY being the script `Zygote.write_worker_entry` writes beside the zygote's socket,
which calls `main(SOCKET, [default_worker.py, ARGS...])`; by hand (tests/test_zygote.py):
`python -S -I zygote_client.py SOCKET WORKER_SCRIPT ARGS...`.

Standard library only: this process's own start must cost next to nothing (~20-40 ms), the point being that the
worker does not import torch and diffusers again. The forked worker gets this process's argv, environment, working
directory, niceness, signal mask and stdin/stdout/stderr (in a process group of its own); this process forwards
SIGTERM, SIGINT and SIGHUP to it and ends as it ends (same exit code, or the same signal). If this process is killed
outright, the zygote sees the connection close and kills the worker. With no zygote listening, or SWITCH_ENV=0 in
the worker's environment (an actor's runtime env), it runs the worker itself (exec): a plain process.
"""

import array
import json
import os
import signal
import socket
import struct
import sys
import time

SWITCH_ENV = "RAYFLOW_ZYGOTE"
"""0 turns zygotes off: a local Ray started with it in the environment has none (rayflow.distributed.worker_imports),
and an actor whose runtime env sets it gets a plain worker process."""
REFUSED = 0
"""The zygote's answer instead of a pid when it does not fork the worker (rayflow.distributed.zygote.RayEnvironment):
this process runs it."""


def main(socket_path: str, argv: list[str]) -> int:
    conn = None if os.environ.get(SWITCH_ENV) == "0" else connect(socket_path)
    if conn is None:  # no zygote, or none wanted: be the worker
        run_worker(argv)
    forward = SignalForwarder()
    sigmask = sorted(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "nice": os.nice(0),
                          "sigmask": sigmask}).encode()
    conn.sendmsg([struct.pack("!I", len(request)) + request],
                 [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]).tobytes())])
    worker = _read_int(conn)
    if worker is None:
        return 1
    if worker == REFUSED:
        run_worker(argv)
    forward.to(worker)
    status = _read_int(conn)
    if status is None:  # the zygote went away (it kills its workers as it stops)
        return 1
    if os.WIFSIGNALED(status):  # end by the same signal
        if os.WTERMSIG(status) in SignalForwarder.SIGNALS:
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1


def run_worker(argv: list[str]) -> None:
    """Become the worker: `python ARGV...` in this process."""
    os.execv(sys.executable, [sys.executable, *argv])


def connect(path: str, wait_s: float = 120.0) -> socket.socket | None:
    """A connection to the zygote at `path`; None if there is none. One still importing (its log file is there, its
    socket not yet) is waited for, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except OSError:
            conn.close()
        if os.path.exists(path) or not os.path.exists(path + ".log") or time.monotonic() > deadline:
            return None  # a socket nobody listens on (the zygote died), no zygote at all, or one that never came up
        time.sleep(0.02)


class SignalForwarder:
    """Passes SIGTERM, SIGINT and SIGHUP on to the worker; one that arrives before the zygote has said which process
    that is waits until it has."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.pid: int | None = None
        self.pending: list[int] = []
        for signum in self.SIGNALS:
            signal.signal(signum, self)

    def __call__(self, signum: int, frame) -> None:
        if self.pid is None:
            self.pending.append(signum)
            return
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self(signum, None)


def _read_int(conn: socket.socket) -> int | None:
    data = conn.recv(4, socket.MSG_WAITALL)  # resumed after a forwarded signal (PEP 475)
    return struct.unpack("!i", data)[0] if len(data) == 4 else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
