"""The zygote that forks a local Ray's workers (rayflow/distributed/zygote.py), without Ray: the client's command
runs in a forked child that holds the preloaded modules and takes the client's argv, environment, working
directory and stdio; exits and signals pass through both ways; nothing outlives what it belongs to."""

import os
import signal
import subprocess
import sys
import time

import pytest

from rayflow.distributed.worker_imports import MODEL_RAY_MODULES
from rayflow.distributed.zygote import CLIENT, Zygote
from rayflow.paths import REPO_ROOT

WORKER = """
import json, os, random, signal, sys, time
if sys.argv[1] == "wait":  # until SIGTERM, which it answers with exit code 3
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))
report = {"argv": sys.argv[1:], "env": os.environ.get("ZYGOTE_TEST"), "cwd": os.getcwd(), "pid": os.getpid(),
          "ppid": os.getppid(), "preloaded": "email.mime.text" in sys.modules, "random": random.random(),
          "path0": sys.path[0]}
print(json.dumps(report), flush=True)
mode = sys.argv[1]
if mode == "exit":
    sys.exit(int(sys.argv[2]))
if mode == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if mode == "wait":
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def zygotes(tmp_path_factory):
    """A zygote preloading a module no fresh interpreter imports, and the path of a second socket nobody serves."""
    root = tmp_path_factory.mktemp("zygote")
    zygote = Zygote.start(str(root / "z"), ["email.mime.text"])
    yield zygote, str(root / "nobody")
    zygote.stop()


def run_worker(zygote_socket, script, *args, env=None, cwd=None, **popen):
    """The client by hand (`python -S -I client SOCKET script ARGS`), the worker's stdout captured."""
    return subprocess.Popen([sys.executable, "-S", "-I", CLIENT, zygote_socket, str(script), *args],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, cwd=cwd, **popen)


def report_of(process):
    import json

    return json.loads(process.stdout.readline())


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_the_worker_is_forked_with_the_clients_argv_env_cwd_and_stdout(zygotes, script, tmp_path):
    zygote, _ = zygotes
    work = tmp_path / "work"
    work.mkdir()
    first = run_worker(zygote.socket_path, script, "exit", "7", env={"ZYGOTE_TEST": "one"}, cwd=work)
    second = run_worker(zygote.socket_path, script, "exit", "0", env={"ZYGOTE_TEST": "two"})
    a, b = report_of(first), report_of(second)
    assert first.wait(30) == 7 and second.wait(30) == 0  # the client ends with the worker's exit code
    assert a["argv"] == ["exit", "7"] and a["env"] == "one" and a["cwd"] == str(work)
    assert b["env"] == "two"
    # Forked from the zygote (not the client), with the module it preloaded, and sys.path as `python script.py`'s.
    assert a["ppid"] == b["ppid"] == zygote.process.pid != first.pid
    assert a["preloaded"] and b["preloaded"]
    assert a["path0"] == str(script.parent)
    assert a["random"] != b["random"]  # each reseeded, as a fresh process is


def test_the_entry_script_a_local_ray_runs_forks_the_worker_script_with_rays_args(zygotes, script):
    """`python ENTRY ARGS...`, as the raylet of `worker_imports.init_local_ray`'s Ray runs it for each worker: the
    worker script Ray would have run (its default_worker.py), forked, with those args."""
    zygote, _ = zygotes
    client = subprocess.Popen([sys.executable, zygote.write_worker_entry(str(script)), "exit", "4"],
                              stdout=subprocess.PIPE, text=True)
    report = report_of(client)
    assert client.wait(30) == 4
    assert report["argv"] == ["exit", "4"] and report["ppid"] == zygote.process.pid != client.pid
    assert report["preloaded"] and report["path0"] == str(script.parent)


def test_a_worker_whose_environment_turns_zygotes_off_is_run_by_its_client(zygotes, script):
    """RAYFLOW_ZYGOTE=0 in an actor's runtime env: a plain process, as on a cluster."""
    zygote, _ = zygotes
    client = run_worker(zygote.socket_path, script, "exit", "0", env={"RAYFLOW_ZYGOTE": "0"})
    report = report_of(client)
    assert client.wait(30) == 0
    assert report["pid"] == client.pid and not report["preloaded"]


def test_workers_forked_from_a_zygote_holding_torch_draw_from_torch_generators_of_their_own(tmp_path):
    """torch seeds its default generator from the OS in every fresh process; forked, every worker had the zygote's,
    and all of them drew the same numbers (`random` and numpy were reseeded, torch was not)."""
    script = tmp_path / "draw.py"
    script.write_text("import torch\nprint(torch.initial_seed(), torch.rand(4).tolist(), flush=True)\n")
    zygote = Zygote.start(str(tmp_path / "z"), ["torch"])
    try:
        draws = []
        for _ in range(2):
            client = run_worker(zygote.socket_path, script)
            draws.append(client.stdout.readline())
            assert client.wait(30) == 0
    finally:
        zygote.stop()
    assert draws[0] and draws[0] != draws[1]


def test_signals_pass_through_both_ways(zygotes, script):
    zygote, _ = zygotes
    killed = run_worker(zygote.socket_path, script, "signal")
    report_of(killed)
    assert killed.wait(30) == -signal.SIGTERM  # the worker died of SIGTERM: so does the client
    waiting = run_worker(zygote.socket_path, script, "wait")
    report_of(waiting)
    waiting.send_signal(signal.SIGTERM)  # forwarded to the worker, which exits 3
    assert waiting.wait(30) == 3


SIGNAL_STATE = """
import json, os, signal
print(json.dumps({"pid": os.getpid(), "pgid": os.getpgrp(), "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                  "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}), flush=True)
"""


def test_the_worker_has_the_signal_state_ray_gives_a_worker_and_a_ctrl_c_to_the_driver_reaches_neither(zygotes, tmp_path):
    """Ray starts its workers with SIGINT blocked, in process groups of their own; Python's handler raises
    KeyboardInterrupt (ray.cancel interrupts a task through it). Forked workers had SIGINT at SIG_DFL, unblocked, in the
    zygote's starter's process group: a terminal's Ctrl-C to a local run killed every actor outright (the raylet
    reported each as "unexpectedly exits ... OOM killer"), and the zygote itself, before the driver shut them down."""
    zygote, _ = zygotes
    script = tmp_path / "state.py"
    script.write_text(SIGNAL_STATE)
    as_ray_starts_it = {"preexec_fn": lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})}
    client = run_worker(zygote.socket_path, script, **as_ray_starts_it)
    forked = report_of(client)
    assert client.wait(30) == 0
    plain = run_worker("/nonexistent", script, **as_ray_starts_it)  # no zygote: the client execs the worker
    own = report_of(plain)
    assert plain.wait(30) == 0
    assert forked["pid"] != client.pid and own["pid"] == plain.pid
    assert forked["sigint"] and forked["blocked"] == own["blocked"] == [signal.SIGINT]
    assert forked["pgid"] == forked["pid"] != os.getpgrp()
    # The zygote, in its starter's process group, gets the terminal's Ctrl-C too: it goes on serving.
    zygote.process.send_signal(signal.SIGINT)
    later = run_worker(zygote.socket_path, script)
    assert report_of(later)["pid"] != later.pid and later.wait(30) == 0


def test_a_killed_client_takes_its_worker_with_it(zygotes, script):
    zygote, _ = zygotes
    client = run_worker(zygote.socket_path, script, "wait")
    worker = report_of(client)["pid"]
    client.kill()
    client.wait(30)
    assert wait_gone(worker), "the worker outlived its client"


def test_without_a_zygote_the_client_runs_the_worker_itself(zygotes, script):
    _, nobody = zygotes
    client = run_worker(nobody, script, "exit", "5")
    report = report_of(client)
    assert client.wait(30) == 5
    assert report["pid"] == client.pid and not report["preloaded"]  # the client exec'd a plain interpreter


def test_a_client_waits_for_a_zygote_still_importing(tmp_path, script, monkeypatch):
    """The zygotes import while Ray starts (`Zygote.launch`): a worker asked for meanwhile is forked once they
    listen."""
    (tmp_path / "slow_module.py").write_text("import time\ntime.sleep(1.5)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    zygote = Zygote.launch(str(tmp_path / "z"), ["slow_module"])
    try:
        client = run_worker(zygote.socket_path, script, "exit", "0")
        report = report_of(client)
        assert client.wait(30) == 0
        assert report["ppid"] == zygote.process.pid and report["pid"] != client.pid
    finally:
        zygote.stop()


def test_stopping_the_zygote_ends_its_workers_and_later_clients_run_their_own(tmp_path, script):
    zygote = Zygote.start(str(tmp_path / "z"), [])
    client = run_worker(zygote.socket_path, script, "wait")
    worker = report_of(client)["pid"]
    zygote.stop()
    assert wait_gone(worker)
    assert client.wait(30) != 0
    # Its socket file is left, with nobody listening: a new client runs the worker itself, without waiting.
    start = time.monotonic()
    late = run_worker(zygote.socket_path, script, "exit", "0")
    assert report_of(late)["pid"] == late.pid and late.wait(30) == 0
    assert time.monotonic() - start < 20


def test_a_zygote_ends_with_the_process_that_started_it(tmp_path):
    """A driver killed outright (SIGKILL: no shutdown runs) leaves no zygote behind."""
    owner = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom rayflow.distributed.zygote import Zygote\n"
                              f"print(Zygote.start({str(tmp_path / 'z')!r}, []).process.pid, flush=True)\n"
                              "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    zygote = int(owner.stdout.readline())
    owner.kill()
    owner.wait(30)
    assert wait_gone(zygote), "the zygote outlived its owner"


def test_a_zygote_that_cannot_preload_is_named_with_its_error(tmp_path):
    missing = r"(?s)preloading \['no_such_module_here'\].*No module named 'no_such_module_here'"
    with pytest.raises(RuntimeError, match=missing):
        Zygote.start(str(tmp_path / "z"), ["no_such_module_here"])
    # Ray caches its config at import: a zygote holding it from the start would hand every worker its starter's.
    with pytest.raises(RuntimeError, match="imported ray"):
        Zygote.start(str(tmp_path / "r"), ["ray.util"])
    # What it imports with Ray, at its first worker: an error there is in its log, and every worker runs by itself.
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    zygote = Zygote.start(str(tmp_path / "later"), ["json", "ray", "no_such_module_here"])
    try:
        for _ in range(2):
            client = run_worker(zygote.socket_path, script, "exit", "0")
            assert report_of(client)["pid"] == client.pid  # run by its client: not forked
            assert client.wait(60) == 0
    finally:
        zygote.stop()
    assert "No module named 'no_such_module_here'" in (tmp_path / "later.log").read_text()


RAY_PROBE = """
import json, os, sys
preloaded = all(m in sys.modules for m in sys.argv[1:])
import ray._raylet
from ray.util import serialization_addons


class Discard:  # a serialization context that keeps nothing registered with it
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


before = set(sys.modules)
serialization_addons.apply(Discard())  # what a Ray worker runs as it first serializes anything
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "preloaded": preloaded,
                  "imported_by_serializers": sorted(set(sys.modules) - before),
                  "delay": ray._raylet.Config.health_check_initial_delay_ms(),
                  "random_id": ray._raylet.UniqueID.from_random().hex()}), flush=True)
"""


def test_ray_is_imported_under_the_first_workers_ray_variables_and_a_worker_with_others_runs_itself(tmp_path):
    """The model zygote's modules from "ray" on are imported when the first worker asks, with its RAY_* variables
    set: Ray's C++ side reads them then, some for good (the job id: a worker of a zygote that imported Ray at start
    failed Ray's check for it). A forked worker finds the RayConfig of its own variables; one whose variables differ
    is not forked (its client runs it, without the preload). Forked workers draw different random ids from Ray's
    generator: a preloaded module that defines a remote class seeds it in the zygote, and every worker then drew the
    same ones (in a suite run two put the same object into the store and one died)."""
    script = tmp_path / "probe.py"
    script.write_text(RAY_PROBE)
    zygote = Zygote.start(str(tmp_path / "z"), ["json", *MODEL_RAY_MODULES])
    try:
        reports = []
        for delay in ("1234", "1234", "4321"):
            client = run_worker(zygote.socket_path, script, *MODEL_RAY_MODULES,
                                env={"RAY_health_check_initial_delay_ms": delay, "PYTHONPATH": REPO_ROOT})
            reports.append((report_of(client), client.pid))
            assert client.wait(60) == 0
    finally:
        zygote.stop()
    (first, _), (second, _), (other, other_client) = reports
    for forked in (first, second):
        assert (forked["ppid"], forked["preloaded"], forked["delay"]) == (zygote.process.pid, True, 1234)
        assert forked["imported_by_serializers"] == []  # RAY_SERIALIZER_MODULES: all of Ray's, from the zygote
    assert first["random_id"] != second["random_id"]
    assert (other["pid"], other["preloaded"], other["delay"]) == (other_client, False, 4321)
    assert "ray._common.pydantic_compat" in other["imported_by_serializers"]  # imported by the worker itself


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:  # reaped by its parent, or a zombie waiting to be
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):  # gone while being read
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_a_local_ray_on_a_gpu_machine_forks_from_a_zygote_only_when_asked(monkeypatch, switch):
    """Not yet tried with CUDA (README, Start-up): off where there are GPUs, on with RAYFLOW_ZYGOTE=1, and off
    everywhere with RAYFLOW_ZYGOTE=0. On, Ray's node is given the zygote's entry script as its worker script, and no
    workers ahead of demand; off, ray.init as it is."""
    import ray
    from ray._private.parameter import RayParams

    from rayflow.distributed import worker_imports

    monkeypatch.setattr(worker_imports, "has_gpus", lambda: True)
    monkeypatch.setattr(worker_imports, "_zygote", None)  # apart from the zygote of this test session's Ray, if any
    if switch is None:
        monkeypatch.delenv(worker_imports.SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(worker_imports.SWITCH_ENV, switch)
    started = {}

    def node_start(**kwargs):  # what ray.init hands its node: RayParams, defaulted by the node
        params = RayParams()
        params.update_if_absent(worker_path="default_worker.py", include_log_monitor=True)
        started.update(kwargs, worker_path=params.worker_path, log_monitor=params.include_log_monitor)

    monkeypatch.setattr(ray, "init", node_start)
    meanwhile = []  # the caller's imports for after the start: once, after ray.init (rayflow.driver.launch)
    try:
        worker_imports.init_local_ray("QwenImagePipeline", meanwhile=lambda: meanwhile.append(dict(started)), num_cpus=2)
        assert meanwhile == [started]
        zygote = worker_imports._zygote
        assert (zygote is not None) is (switch == "1")
        if zygote:
            assert started == {"address": "local", "num_cpus": 2, "_system_config": worker_imports.NO_WORKERS_AHEAD,
                               "worker_path": zygote.socket_path + "-worker.py", "log_monitor": True}
        else:
            assert started == {"address": "local", "num_cpus": 2, "worker_path": "default_worker.py",
                               "log_monitor": True}
    finally:
        worker_imports.stop_worker_zygote()
    params = RayParams()
    params.update_if_absent(worker_path="default_worker.py")
    assert params.worker_path == "default_worker.py"  # Ray's default back once ray.init returned
