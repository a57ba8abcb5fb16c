"""Starting a run: config first, then Ray (joining RAY_ADDRESS, or a local loopback instance), then the
Trainer; every actor is shut down however the run ends (Ctrl-C and `ray job stop` included).

Nothing here imports Ray at module level: on a local run the loopback setting must be in the
environment before Ray is imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from rayflow.config import RayflowConfig, load_config
from rayflow.data.prompts import load_prompts
from rayflow.errors import ConfigError


def required_cpus(cfg: RayflowConfig) -> float:
    """Logical CPUs the run's placement groups reserve."""
    r, lr, rw, s = cfg.rollout, cfg.learner, cfg.reward, cfg.sync
    return (r.num_replicas * r.cfg_parallel_size * r.cpus_per_rank + lr.world_size * lr.cpus_per_rank
            + rw.num_workers * rw.cpus_per_worker + s.cpus)


def start_ray(cfg: RayflowConfig) -> bool:
    """Join the cluster at RAY_ADDRESS (as under `ray job submit`), else start a local Ray on loopback.
    Returns whether this process started Ray (and so must shut it down)."""
    if os.environ.get("RAY_ADDRESS"):
        import ray

        if not os.path.isabs(cfg.trainer.output_dir):
            logging.getLogger("rayflow").warning(
                "trainer.output_dir=%r is relative: under `ray job submit` it lands in the job's temporary copy of "
                "the working dir, which Ray deletes (and resume=auto then finds nothing); give an absolute path",
                cfg.trainer.output_dir)
        ray.init(address=os.environ["RAY_ADDRESS"])
        return False
    # Keep a laptop run off the network (RAY-LOCAL.md): set before Ray is imported.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    # Logical CPUs: enough for every bundle even on a 2-core machine (each rank runs one torch thread).
    cpus = max(os.cpu_count() or 1, int(required_cpus(cfg) + 0.999))
    context = ray.init(address="local", num_cpus=cpus, include_dashboard=True, dashboard_host="127.0.0.1")
    logging.getLogger("rayflow").info("local Ray with %d logical CPUs; dashboard at http://%s", cpus, context.dashboard_url)
    return True


def _stop_on_sigterm() -> None:
    """`ray job stop` and container shutdowns send SIGTERM: unwind like Ctrl-C, so actors are shut down
    and the last complete checkpoint stays as it is."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def run_recipe(default_config: str, argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=f"Train with {os.path.basename(default_config)} (dotlist overrides after it).")
    parser.add_argument("--config", default=default_config, help=f"a recipe YAML (default {default_config})")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=3 model.path=/models/Qwen-Image")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        # Bad input fails here, before anything starts, with one message naming the key or file and line.
        cfg = load_config(args.config, args.overrides)
        prompts = load_prompts(cfg.data.prompts)
        if cfg.data.eval_prompts:
            load_prompts(cfg.data.eval_prompts)
    except (ConfigError, ValueError) as e:
        sys.exit(f"error: {e}")
    started = start_ray(cfg)
    _stop_on_sigterm()
    from rayflow.driver.trainer import Trainer  # imports Ray

    trainer = None
    try:
        trainer = Trainer(cfg, prompts)
        return trainer.run()
    finally:
        if trainer is not None:
            trainer.shutdown()
        if started:
            import ray

            ray.shutdown()
