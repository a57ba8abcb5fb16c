"""What the worker processes of a local Ray import as they start, and which actors start without it.

On a laptop an actor's first seconds are imports: torch, diffusers, transformers, peft, ~4 s of CPU a process on
2 cores. A local run's Ray (rayflow.driver.launch) therefore has every worker process import
`rayflow.distributed.preload` as it starts (Ray's `preload_python_modules`): the learner's and the rollout's actor
modules and the run's diffusers pipeline class, so the workers Ray starts ahead of demand have them loaded by the time
the learner and the rollout rank take them.

The weight-sync actor and the reward workers need none of the model code. They start with SKIP_ENV in their runtime
env (`light_actor_options`): Ray gives an actor of another runtime env a worker process of its own, started with that
environment, whose preload then imports nothing. So they neither pay for imports they do not use nor take the
preloaded workers from the actors that use them.
"""

from __future__ import annotations

import os

ACTOR_MODULES = ("rayflow.learner.worker", "rayflow.rollout.worker", "rayflow.rollout.rank")
"""The actor modules of the learner and the rollout (rank.py holds the rollout's model code)."""
PRELOAD_MODULE = "rayflow.distributed.preload"
PIPELINE_ENV = "RAYFLOW_PRELOAD_PIPELINE"
"""The diffusers pipeline class the workers preload; set in the driver before its local Ray starts (Ray's processes
inherit its environment), and only then: it also says that this process's Ray preloads."""
SKIP_ENV = "RAYFLOW_SKIP_PRELOAD"
PRELOAD_MAX_CORES = 16
"""Ray starts up to one worker per core ahead of demand; with the preload each holds ~400 MB (RSS). Above this many
cores a local run does not preload: there the imports are not the bottleneck they are on a laptop."""


def preload_system_config(cpus: int, pipeline_class: str) -> dict:
    """Ray system settings of a local run with `cpus` logical CPUs that loads a `pipeline_class` model: its workers
    preload on a machine of up to PRELOAD_MAX_CORES cores (and the class is named to them in this process's
    environment), and idle workers are kept until an actor takes them (with the default soft limit, the logical CPUs,
    Ray killed the second preloaded worker before the rollout actor asked for one on a 2-CPU run)."""
    if (os.cpu_count() or 1) > PRELOAD_MAX_CORES:
        return {}
    os.environ[PIPELINE_ENV] = pipeline_class
    return {"preload_python_modules": [PRELOAD_MODULE], "num_workers_soft_limit": 2 * cpus}


def end_preload() -> None:
    """Forget the preload when this process's local Ray stops (a later Ray in the same process may not preload)."""
    os.environ.pop(PIPELINE_ENV, None)


def light_actor_options() -> dict:
    """Actor options for an actor that needs none of the model code (the weight-sync actor, a reward worker): under
    a preloading local Ray, a worker process of its own that skips the preload; elsewhere none."""
    if PIPELINE_ENV not in os.environ:
        return {}
    return {"runtime_env": {"env_vars": {SKIP_ENV: "1"}}}
