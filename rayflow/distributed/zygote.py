"""A zygote: a process that imports the heavy modules once and forks a local Ray's worker processes from itself.

A Ray worker is a fresh Python process, and on a laptop its first seconds are imports: torch, diffusers,
transformers, peft, about 3 s of CPU per actor, paid again by every actor a run or the test suite starts. Forked
from a process that already holds them, a worker starts with them imported (shared copy-on-write), and with Ray and
rayflow's actor code too once the zygote holds those, for a few tenths of a second of CPU: Ray's worker set-up.

    server   `python -m rayflow.distributed.zygote SOCKET MODULE... [ray MODULE...]`: imports the modules ("pkg.mod"
             or "pkg:Attr") before "ray", then listens; on each connection forks a child that becomes the worker
             (`become_worker`) and reports its pid and, later, its exit status. "ray" and the modules after it are
             imported when the first worker asks, under its RAY_* variables (`RayEnvironment`).
    client   rayflow/distributed/zygote_client.py: what Ray runs for a worker (through `write_worker_entry`'s script).
    owner    `Zygote.launch`, `wait_ready`, `stop` (or `start`: both first two): the process that starts the local
             Ray (rayflow.distributed.worker_imports).

Linux only (fork, SCM_RIGHTS, prctl). The socket lives in a directory only this user can enter, and the server
serves only this user's processes.
"""

from __future__ import annotations

import array
import importlib
import json
import os
import random
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback

from rayflow.distributed.zygote_client import REFUSED

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote_client.py")
READY = b"ready\n"


class Zygote:
    """A zygote server started by this process; it ends with this process (prctl PDEATHSIG) if not stopped."""

    def __init__(self, process: subprocess.Popen, socket_path: str, modules: list[str]):
        self.process, self.socket_path, self.modules = process, socket_path, modules

    @classmethod
    def launch(cls, socket_path: str, modules: list[str]) -> "Zygote":
        """Start a server that preloads `modules` and then listens on `socket_path`, without waiting for it (its
        imports overlap what this process does next; `wait_ready`). Its own errors go to `socket_path`.log, which
        exists from now on: a client that finds it but no socket yet waits for the socket."""
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": pythonpath}
        # torch reads its thread count as it is imported, here, before any worker sets OMP_NUM_THREADS: Ray's
        # default for an actor (one thread) unless this process sets another (rayflow's actors set theirs).
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(socket_path + ".log", "wb") as log:
            process = subprocess.Popen([sys.executable, "-m", __name__, socket_path, *modules], env=env,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
        return cls(process, socket_path, modules)

    @classmethod
    def start(cls, socket_path: str, modules: list[str], timeout_s: float = 120.0) -> "Zygote":
        """`launch`, then `wait_ready`."""
        zygote = cls.launch(socket_path, modules)
        zygote.wait_ready(timeout_s)
        return zygote

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Return once the server listens. Raises RuntimeError, with its log's end, if it exits or is not ready
        within `timeout_s` (the server is then killed)."""
        if self.process.stdout.closed:
            return
        selector = selectors.DefaultSelector()
        selector.register(self.process.stdout, selectors.EVENT_READ)
        ready = bool(selector.select(timeout_s)) and self.process.stdout.readline() == READY
        selector.close()
        self.process.stdout.close()  # the server writes nothing more there
        if not ready:
            self.process.kill()
            self.process.wait()
            with open(self.socket_path + ".log", errors="replace") as log:
                raise RuntimeError(f"the zygote preloading {self.modules} did not start within {timeout_s:.0f}s "
                                   f"(exit code {self.process.returncode}): {log.read()[-2000:]}")

    def write_worker_entry(self, worker_script: str) -> str:
        """Write the script a local Ray runs for each worker, `python ENTRY ARGS...` in place of `python WORKER_SCRIPT
        ARGS...`: the client, told this zygote's socket and WORKER_SCRIPT. Beside the socket; returns its path."""
        path = self.socket_path + "-worker.py"
        with open(path, "w") as f:
            f.write(f"import sys\nsys.path[0] = {os.path.dirname(CLIENT)!r}\nfrom zygote_client import main\n"
                    f"sys.exit(main({self.socket_path!r}, [{worker_script!r}, *sys.argv[1:]]))\n")
        return path

    def stop(self) -> None:
        """End the server; workers it forked that are still running are killed."""
        if not self.process.stdout.closed:
            self.process.stdout.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# -- the server ------------------------------------------------------------------------------------

def serve(socket_path: str, modules: list[str]) -> None:
    modules, ray_modules = _split_at_ray(modules)
    _preload(modules)
    if "ray" in sys.modules:
        raise RuntimeError(f"preloading {modules} imported ray: a forked worker would keep this process's Ray config")
    ray_env = RayEnvironment(ray_modules)
    _die_with_parent()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".bound")
    listener.listen(128)
    # The socket appears under its name only once it listens: a client that finds it and cannot connect knows this
    # server is gone (zygote_client.connect), where between bind and listen it would be refused as well.
    os.rename(socket_path + ".bound", socket_path)
    # Started in its owner's process group, it gets a terminal's Ctrl-C meant for the driver: dying of it would end
    # every worker's client (the raylet then reports each worker as crashed). Its owner stops it (stop, PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wake-up pipe
    workers: dict[int, socket.socket] = {}  # pid -> its client's connection
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    os.write(1, READY)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the starter closes its end of the pipe
    while not stopping:
        for key, _ in selector.select(timeout=1.0):  # SIGCHLD wakes it; the timeout reaps even if a wake-up were lost
            if key.fileobj is listener:
                _accept(listener, selector, workers, ray_env)
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
            else:  # a client closed its connection (it was killed): its worker goes too
                _kill(key.data)
                selector.unregister(key.fileobj)
        _reap(workers, selector)
    for pid in list(workers):
        _kill(pid)
    deadline = time.monotonic() + 5
    while workers and time.monotonic() < deadline:
        _reap(workers, selector)
        time.sleep(0.01)


def _preload(modules: list[str]) -> None:
    for name in modules:
        module, _, attribute = name.partition(":")
        imported = importlib.import_module(module)
        if attribute:
            getattr(imported, attribute)


def _split_at_ray(modules: list[str]) -> tuple[list[str], list[str]]:
    """The modules before "ray" (imported at start) and "ray" with those after it (imported with the first worker's
    Ray environment: `RayEnvironment`)."""
    if "ray" not in modules:
        return modules, []
    at = modules.index("ray")
    return modules[:at], modules[at:]


class RayEnvironment:
    """Ray and the modules after it, imported once the workers' environment is known.

    Ray's C++ side reads its configuration from the RAY_* variables as `ray._raylet` is imported, and some of it for
    good: the job id and the raylet's pid are internal flags that `ray._raylet.Config.initialize` does not read again
    (a worker forked from a zygote that imported Ray at start, before the driver's `ray.init`, failed Ray's check for
    its job id; with the first driver's own variables, the token-auth mode among them, it is what the raylet would
    have started). So they are imported with the first worker's RAY_* variables in place of this process's, and a
    worker whose RAY_* variables differ from those (another job's, or a runtime env that sets one) is refused: its
    client runs it as a fresh process. The modules must not define Ray remote classes (`worker_imports`)."""

    def __init__(self, modules: list[str]):
        self.modules = modules
        self.variables: dict[str, str] | None = None
        """The RAY_* variables Ray was imported with; None until then."""
        self.failed = False
        """The import failed (its traceback is in this zygote's log): every worker runs as a fresh process."""

    def admits(self, env: dict[str, str]) -> bool:
        """Whether a worker of environment `env` may be forked (importing Ray with it if it is the first)."""
        if not self.modules:
            return True
        variables = {k: v for k, v in env.items() if k.startswith("RAY_")}
        if self.variables is None:  # the first worker (set before the import, so a failed one is not tried again)
            for name in [k for k in os.environ if k.startswith("RAY_")]:
                del os.environ[name]
            os.environ.update(variables)
            self.variables = variables
            try:
                _preload(self.modules)
            except Exception:
                traceback.print_exc()
                self.failed = True
        return not self.failed and variables == self.variables


def _accept(listener: socket.socket, selector: selectors.BaseSelector, workers: dict[int, socket.socket],
            ray_env: RayEnvironment) -> None:
    conn, _ = listener.accept()
    try:
        conn.settimeout(10)
        _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        request, fds = _receive_request(conn) if uid == os.getuid() else (None, [])
    except OSError:
        request, fds = None, []
    refused = request is not None and len(fds) == 3 and not ray_env.admits(request["env"])
    if request is None or len(fds) != 3 or refused:
        for fd in fds:
            os.close(fd)
        if refused:
            _send_int(conn, REFUSED)
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            become_worker(request, fds)
        finally:
            os._exit(70)  # become_worker never returns; reached only if it raised before running the worker
    for fd in fds:
        os.close(fd)
    _send_int(conn, pid)  # a client gone is reported below, as its connection closing
    conn.setblocking(False)
    workers[pid] = conn
    selector.register(conn, selectors.EVENT_READ, pid)


def _send_int(conn: socket.socket, value: int) -> None:
    try:
        conn.sendall(struct.pack("!i", value))
    except OSError:
        pass  # the client is gone


def _receive_request(conn: socket.socket) -> tuple[dict | None, list[int]]:
    """One request: a 4-byte length and that many bytes of JSON, with the client's fds 0, 1, 2 attached."""
    fds = array.array("i")
    head, ancillary, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if len(head) < 4:
        return None, list(fds)
    size, = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            return None, list(fds)
        body += chunk
    return json.loads(body), list(fds)


def _reap(workers: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Collect every ended worker and send its wait status to its client."""
    while workers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = workers.pop(pid, None)
        if conn is None:
            continue
        try:
            selector.unregister(conn)
        except KeyError:
            pass  # already unregistered: its client had gone
        conn.setblocking(True)
        _send_int(conn, status)
        conn.close()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _die_with_parent() -> None:
    """The server ends when the process that started it does (Linux prctl(PR_SET_PDEATHSIG))."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the parent was already gone
        raise SystemExit(1)


# -- a forked worker -------------------------------------------------------------------------------

def become_worker(request: dict, fds: list[int]) -> None:
    """In a freshly forked child: take on the client's stdio, environment, working directory, niceness and signal
    mask, in a process group of its own (as Ray starts a worker), then
    run its command (`script.py ARGS...`) as `python script.py ARGS...` would, and exit with its code."""
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    # As Ray starts a worker: Python's SIGINT handler (ray.cancel interrupts a running task through it), the client's
    # signal mask (the raylet's: SIGINT blocked) and a process group of its own, not the zygote's starter's, to
    # which a terminal sends its Ctrl-C (it killed every forked actor before the driver could shut them down).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["sigmask"])
    os.setpgrp()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the listener, other clients' connections, the received copies
    old_pythonpath = _split_path(os.environ.get("PYTHONPATH"))
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    extra_nice = request["nice"] - os.nice(0)
    if extra_nice > 0:
        os.nice(extra_nice)
    argv = request["argv"]
    script = os.path.abspath(argv[0])
    # sys.path as a fresh interpreter would have it: the script's directory first, then the client's PYTHONPATH.
    site_paths = [p for p in sys.path[1:] if p not in old_pythonpath]
    sys.path[:] = [os.path.dirname(script), *_split_path(os.environ.get("PYTHONPATH")), *site_paths]
    sys.argv = list(argv)
    _fresh_process_state()
    code = 0
    try:
        import runpy

        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()  # as the interpreter does at exit (os._exit below skips it)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _split_path(value: str | None) -> list[str]:
    return [os.path.abspath(p) for p in value.split(os.pathsep) if p] if value else []


def _fresh_process_state() -> None:
    """What a forked worker must not share with its siblings or keep from the zygote: the random generators' state
    (seeded from the OS in every fresh process: `random`'s, numpy's and torch's default generator) and the torch
    thread count (read from OMP_NUM_THREADS at start)."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if "torch" in sys.modules and threads.isdigit() and int(threads) > 0:
        sys.modules["torch"].set_num_threads(int(threads))


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
    # Not the interpreter's own exit: tearing down torch's, diffusers' and transformers' modules took 1.1 s of CPU,
    # at every stop of a local Ray (a run's end, each of the suite's local runs). Its output is flushed; an error in
    # serve still exits through the interpreter, with its traceback in the log.
    sys.stderr.flush()
    os._exit(0)
