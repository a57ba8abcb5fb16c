"""Starting a run: everything that can be checked without Ray first (config, prompts, model directory,
resume target), then Ray (joining RAY_ADDRESS, or a local loopback instance) and a check that the
cluster can hold the run, then the Trainer; every actor is shut down however the run ends (Ctrl-C and
`ray job stop` included), and the run ends with a summary of where its outputs are.

Nothing here imports Ray at module level: on a local run the loopback setting must be in the
environment before Ray is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import NoReturn

from rayflow.checkpoint import checkpoint_root, newest_resumable
from rayflow.config import RayflowConfig, load_config
from rayflow.distributed.resources import check_cluster_fits, required_cpus
from rayflow.distributed.worker_imports import init_local_ray, stop_worker_zygote
from rayflow.errors import ConfigError, one_line
from rayflow.runs import USER_ERRORS, RunComplete, lock_run_dir, preflight, release_run_dir, write_run_config

log = logging.getLogger("rayflow")


def start_ray(cfg: RayflowConfig) -> bool:
    """Join the cluster at RAY_ADDRESS (as under `ray job submit`), else start a local Ray on loopback.
    Returns whether this process started Ray (and so must shut it down)."""
    if os.environ.get("RAY_ADDRESS"):
        import ray

        # A run directory inside a job's temporary working dir was refused before (runs.check_outputs_outlive_the_job).
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    # Keep a laptop run off the network (RAY-LOCAL.md): set before Ray is imported.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from rayflow.models.base import pipeline_class_of
    from rayflow.models.tiny import resolve_model_path

    # Logical CPUs: enough for every bundle even on a 2-core machine (each rank runs one torch thread).
    cpus = max(os.cpu_count() or 1, int(required_cpus(cfg) + 0.999))
    # After the preflight, so the model directory exists (the tiny model is built there).
    model = cfg.model
    pipeline_class = pipeline_class_of(resolve_model_path(model.path, model.cache_dir, model.tiny_size, model.tiny_seed,
                                                          model.tiny_arch))
    # A minimal Ray install (no ray[default]: the offline GPU machine's bundle) cannot start the dashboard, and
    # ray.init(include_dashboard=True) would refuse to start at all: run without it and say so.
    dashboard_missing = ray._private.utils.get_dashboard_dependency_error()
    # Workers forked from a process that holds the model code imported (rayflow.distributed.worker_imports).
    with _one_start_at_a_time():
        context = init_local_ray(pipeline_class, meanwhile=_import_the_trainer, num_cpus=cpus,
                                 include_dashboard=not dashboard_missing, dashboard_host="127.0.0.1",
                                 dashboard_port=dashboard_port())
    if dashboard_missing:
        log.warning("local Ray with %d logical CPUs, without its dashboard: %s (pip install 'ray[default]' for it)",
                    cpus, dashboard_missing)
    else:
        log.info("local Ray with %d logical CPUs; dashboard at http://%s (its API wants the token in ~/.ray/auth_token)",
                 cpus, context.dashboard_url)
    return True


def _import_the_trainer() -> None:
    """What the driver imports once Ray is up (the trainer and the actors' classes: 2.0 s on 2 cores, most of it
    torch.distributed's DTensor and FSDP2), while the zygote still imports the model code (its last 2.8 s on one core
    after Ray started, at a slow hour)."""
    importlib.import_module("rayflow.driver.trainer")


START_LOCK = "rayflow-ray-start.lock"
"""In the temporary directory: held while a local Ray starts (_one_start_at_a_time)."""


@contextlib.contextmanager
def _one_start_at_a_time() -> Iterator[None]:
    """Hold a machine-wide lock while a local Ray starts: two runs started together would both find the dashboard's
    port free, and the second dashboard to bind it would fail that run's start (seen, a minute into ray.init)."""
    # Read-only, and made writable for all: a lock file another user created (0644 under their umask) stopped every
    # other user's local run with PermissionError; flock needs no write access.
    fd = os.open(os.path.join(tempfile.gettempdir(), START_LOCK), os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        with contextlib.suppress(PermissionError):  # another user's file: theirs to chmod
            os.fchmod(fd, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def dashboard_port(preferred: int = 8265) -> int:
    """Ray's usual dashboard port, or a free one when another run on this machine holds it (Ray would
    otherwise fail to start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


class Terminated(KeyboardInterrupt):
    """SIGTERM, unwound as Ctrl-C is."""


_stop_signals: list[int] = []
"""The stop signals (SIGINT, SIGTERM) the run received, in order. The exception a stop unwinds with does not say which
it was, nor always that it was a stop: Ray's blocking calls (ray.wait, ray.get) re-raise the handler's Terminated as a
bare KeyboardInterrupt, and a call in flight that the stop broke may fail with an error of its own."""


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT), `ray job stop` and container shutdowns (SIGTERM): unwind as KeyboardInterrupt, so actors are
    shut down and the last complete checkpoint stays as it is; each signal recorded in _stop_signals."""
    _stop_signals.clear()

    def handler(signum, frame):
        _stop_signals.append(signum)
        raise Terminated(f"signal {signum}") if signum == signal.SIGTERM else KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def root_cause(error: BaseException) -> BaseException:
    """The exception at the bottom of a chain of RayTaskErrors and `raise ... from` wrappers."""
    from ray.exceptions import RayTaskError

    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RayTaskError) and getattr(error, "cause", None) is not None:
            error = error.cause
        elif error.__cause__ is not None:
            error = error.__cause__
        else:
            break
    return error


def describe_failure(error: BaseException) -> str:
    """One line: the root cause first, then the wrapper that reported it when that says something more."""
    cause = root_cause(error)
    first = (str(cause).strip().splitlines() or [""])[0]
    line = first if isinstance(cause, ConfigError) else f"{type(cause).__name__}: {first}"
    if cause is not error:
        outer = (str(error).strip().splitlines() or [""])[0]
        line += f" (reported as {type(error).__name__}: {outer[:200]})"
    return line


def _seconds(durations: dict[str, float]) -> str:
    """The start-up lines' format, as in "ray 5.1s, checks 0.0s" (tools/bench.py startup reads it back)."""
    return ", ".join(f"{name} {s:.1f}s" for name, s in durations.items())


def run_recipe(default_config: str, argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=f"Train with {os.path.basename(default_config)} (dotlist overrides after it).")
    parser.add_argument("--config", default=default_config, help=f"a recipe YAML (default {default_config})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=3 model.path=/models/Qwen-Image")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_lock = None
    try:
        # Bad input fails here, before Ray starts, with one message naming the key or file and line.
        cfg = load_config(args.config, args.overrides)
        prompts, plan = preflight(cfg)
        run_lock = lock_run_dir(cfg)  # before the run's config.yaml is written: another driver may be training it
        write_run_config(cfg, plan.inputs)  # a resume's fingerprints of the inputs, not taken again
    except RunComplete as e:
        log.info("%s", e)
        return []
    except USER_ERRORS as e:
        release_run_dir(run_lock)
        sys.exit(f"error: {e}")
    except BaseException:
        release_run_dir(run_lock)
        raise
    _stop_on_signals()
    start = time.perf_counter()
    try:
        started = start_ray(cfg)
    except (KeyboardInterrupt, SystemExit) as e:
        # ray.init puts in a SIGTERM handler of its own, which exits with the signal's number (15): a stop while Ray
        # starts is a stop too. What Ray had started is stopped already (init_local_ray).
        if isinstance(e, SystemExit) and e.code != signal.SIGTERM:
            raise
        release_run_dir(run_lock)
        _exit_stopped(None, cfg, Terminated() if isinstance(e, SystemExit) else e)
    ray_s = time.perf_counter() - start
    _stop_on_signals()  # again, over ray.init's
    from rayflow.driver.trainer import Trainer  # imports Ray
    from rayflow.planning.device_check import check_before_start

    trainer = None
    try:
        checks_start = time.perf_counter()
        check_cluster_fits(cfg, joined=not started)
        # The devices' features and, on GPU clusters, the memory plan: before any actor starts.
        check_before_start(cfg)
        checks_s = time.perf_counter() - checks_start
        trainer = Trainer(cfg, prompts)
        phases = {"ray": ray_s, "checks": checks_s, **trainer.startup_s, "total": time.perf_counter() - start}
        log.info("startup: %s", _seconds(phases))
        log.info("startup of learner rank 0: %s", _seconds(trainer.learners.setup_seconds()))
        history = trainer.run()
        log.info("%s", summary(cfg, history, time.perf_counter() - start))
    except KeyboardInterrupt as e:
        _exit_stopped(trainer, cfg, e)
    except Exception as e:
        if _stop_signals:  # the stop broke a call in flight, which failed with an error of its own: still a stop
            log.info("the stop broke a call in flight: %s", one_line(e))
            log.debug("the call the stop broke", exc_info=True)
            _exit_stopped(trainer, cfg, e)
        if isinstance(root_cause(e), USER_ERRORS):
            sys.exit(f"error: {describe_failure(e)}")
        log.exception("the run failed")
        sys.exit(f"error: {describe_failure(e)}; {_where(cfg)}")
    finally:
        stopped_in_teardown = _tear_down(trainer, started, run_lock)
    if stopped_in_teardown is not None:  # the run had ended; stopped while it was tearing down, it exits as stopped
        sys.exit(_stopped_status(stopped_in_teardown))
    return history


def _exit_stopped(trainer, cfg: RayflowConfig, stop: BaseException) -> NoReturn:
    """Say where the stopped run can continue from, and exit with the stop's status."""
    step = trainer.version if trainer is not None else 0
    print(f"interrupted at step {step}; {_where(cfg)}", file=sys.stderr)
    sys.exit(_stopped_status(stop))


def _stopped_status(stop: BaseException) -> int:
    """The shell's 128 + signal number of the first stop signal, so a script around the command tells a stop from a
    failure (1); without one recorded, the stop's own kind (Terminated: SIGTERM, else SIGINT)."""
    if _stop_signals:
        return 128 + _stop_signals[0]
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


def _tear_down(trainer, started: bool, run_lock) -> KeyboardInterrupt | None:
    """Shut the run's actors down, then the local Ray this run started, then release the run directory, however the
    run ended. A Ctrl-C or SIGTERM during one of these cuts that one short and the rest still run (the local Ray is
    stopped, the directory released); it is returned, not raised, so the run's own outcome (a stop's status, a
    failure's message) is what the process exits with, without a traceback from the teardown. An error in a part
    (the actors' shutdown failing) lets the rest run too, and is raised after them."""
    parts = [("the actors' shutdown", trainer.shutdown)] if trainer is not None else []
    if started:
        import ray

        parts += [("Ray's shutdown", ray.shutdown), ("the worker zygote's stop", stop_worker_zygote)]
    parts.append(("the run directory's release", lambda: release_run_dir(run_lock)))
    stopped, error = None, None
    for name, part in parts:
        try:
            part()
        except KeyboardInterrupt as e:
            log.warning("stopped again during the teardown: %s cut short (%s)", name, e or "Ctrl-C")
            stopped = stopped or e
        except Exception as e:
            error = error or e
    if error is not None:
        raise error
    return stopped


def _where(cfg: RayflowConfig) -> str:
    """The checkpoint a resume=auto continues from (the newest intact one, not merely the newest: one saved with NaN
    or Inf values is passed over, and named) and how to continue from it."""
    root = checkpoint_root(cfg.trainer.run_dir)
    resumable, passed_over = newest_resumable(root)
    why = "; ".join(f"{os.path.basename(e.path)}: {e.file}: {e.reason}" for e in passed_over)
    if resumable is None and not passed_over:
        return f"no checkpoint was written (run dir {cfg.trainer.run_dir})"
    if resumable is None:
        return f"no intact checkpoint under {root} ({why}); restore one, or start a new run"
    skipped = f" (a resume passes over {why})" if passed_over else ""
    return f"last checkpoint {resumable}{skipped}; continue with the same command and {_continuing(cfg)}"


def _continuing(cfg: RayflowConfig) -> str:
    """The overrides that continue this run from its newest checkpoint. trainer.resume=auto is named when the command
    set it otherwise: the same command with trainer.resume=PATH resumed PATH again (the run's newer checkpoints set
    aside as abandoned), and with trainer.resume=never it was refused."""
    resume = "" if cfg.trainer.resume == "auto" else " trainer.resume=auto"
    return f"trainer.run_name={cfg.trainer.run_name}{resume}"


def summary(cfg: RayflowConfig, history: list[dict[str, float]], seconds: float) -> str:
    """Where the run's outputs are and how it ended."""
    tail = history[-10:]
    reward = sum(h["reward/mean"] for h in tail) / len(tail) if tail else float("nan")
    return (
        f"done: {len(history)} steps in {seconds:.0f}s; reward {reward:.4f} (mean of the last {len(tail)} steps)\n"
        f"  run dir     {os.path.abspath(cfg.trainer.run_dir)}\n"
        f"  checkpoint  {newest_resumable(checkpoint_root(cfg.trainer.run_dir))[0]}\n"  # the one a continuation resumes
        f"  tensorboard tensorboard --logdir {cfg.trainer.logdir}\n"
        f"  continue    the same command with {_continuing(cfg)} trainer.total_steps=<more>"
    )
