"""Where a local Ray's worker processes come from: forked from zygotes that hold the model code imported.

On a laptop an actor's first seconds are imports: torch, diffusers, transformers, peft, ~3 s of CPU a process on
2 cores, and every actor pays them again. A local run (rayflow.driver.launch) and the test suite's Ray
(tests/conftest.py) therefore start two zygotes (rayflow.distributed.zygote) before Ray and have Ray start every
worker through the zygote client (runtime_env `py_executable`):

    model zygote   torch, FSDP, peft and the run's diffusers pipeline class (its model classes and transformers'
                   modeling code): the learner, rollout and colocated-device actors are forked from it;
    light zygote   torch only: the weight-sync actor and the reward workers (`light_actor_options`: their runtime
                   env sets LIGHT_ENV), which need none of the model code, are forked from it.

A forked worker starts with those modules imported for ~0.5 s of CPU instead of ~3.5 s. Linux machines of up to
MAX_CORES cores without GPUs (`has_gpus`); RAYFLOW_ZYGOTE=0 in the environment turns it off (every worker is then a
fresh Python process, as on a cluster), RAYFLOW_ZYGOTE=1 on whatever the machine (on a GPU machine it fails: `has_gpus`).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from rayflow.distributed.zygote import Zygote, worker_command
from rayflow.distributed.zygote_client import LIGHT_ENV

MODEL_MODULES = ("torch", "torch.distributed.fsdp", "peft")
"""What the model zygote imports at start besides the run's pipeline class (`diffusers:<class>`)."""
LIGHT_MODULES = ("torch",)
MODEL_RAY_MODULES = ("ray", "rayflow.learner.worker", "rayflow.rollout.rank")
LIGHT_RAY_MODULES = ("ray",)
"""What each zygote imports when its first worker asks, under that worker's Ray variables
(rayflow.distributed.zygote.RayEnvironment): Ray, and the actors' code that defines no Ray remote class. Defining one
draws a random id from the generator of Ray's C++ side, which seeds it in the zygote, and every worker forked after
that drew the same "random" ids (two forked workers put the same object into the store, and one of them died)."""
SWITCH_ENV = "RAYFLOW_ZYGOTE"
MAX_CORES = 16
"""Above this many cores a local run starts plain workers: there the imports are not the bottleneck they are on a
laptop."""

_started: list[Zygote] = []
"""This process's zygotes (model, light), while its local Ray runs; their sockets share one directory."""


def start_worker_zygotes(pipeline_class: str) -> dict:
    """Start the two zygotes for a local Ray about to start in this process, without waiting for their imports (they
    overlap Ray's own start; `wait_worker_zygotes` after `ray.init`). Returns the keyword arguments for `ray.init`
    ({} where zygotes are not used: not Linux, RAYFLOW_ZYGOTE=0, or more than MAX_CORES cores or GPUs unless
    RAYFLOW_ZYGOTE=1): the runtime env whose worker command forks from them, and no workers started ahead of demand
    (those would be plain processes of another runtime env, which no actor of the run takes; a forked worker starts
    in a fraction of a second)."""
    if not zygotes_wanted():
        return {}
    if _started:  # one local Ray per process: stopping them here would kill that Ray's workers
        raise RuntimeError("this process's zygotes already run (a local Ray started here is still up)")
    directory = tempfile.mkdtemp(prefix="rayflow-zygote-")  # mode 0700: only this user reaches the sockets
    try:
        for name, modules in (("model", [*MODEL_MODULES, f"diffusers:{pipeline_class}", *MODEL_RAY_MODULES]),
                              ("light", [*LIGHT_MODULES, *LIGHT_RAY_MODULES])):
            _started.append(Zygote.launch(os.path.join(directory, name), list(modules)))
    except BaseException:
        stop_worker_zygotes()
        shutil.rmtree(directory, ignore_errors=True)  # if no zygote was launched in it
        raise
    # Both switches: enable_worker_prestart alone left the raylet starting workers for the first driver (two plain
    # Python workers on this machine, about 1 s of CPU each during the start-up, then idle for the whole run).
    return {"runtime_env": {"py_executable": worker_command(*_started)},
            "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False}}


def zygotes_wanted() -> bool:
    """Whether a local Ray started here forks its workers from zygotes: on Linux, with RAYFLOW_ZYGOTE=1, or unless
    RAYFLOW_ZYGOTE=0 on a machine of up to MAX_CORES cores without GPUs."""
    switch = os.environ.get(SWITCH_ENV)
    large_or_gpu = (os.cpu_count() or 1) > MAX_CORES or has_gpus()
    return sys.platform == "linux" and switch != "0" and (switch == "1" or not large_or_gpu)


def has_gpus() -> bool:
    """Whether this machine has NVIDIA or AMD GPUs (read from the drivers' files, without initialising CUDA). Zygotes
    are not used there. Tried on an H200 (README, "Measured on one H200"): `torch.cuda.is_available()` in the
    zygote's imports leaves forked workers unable to initialise CUDA; with PYTORCH_NVML_BASED_CUDA_CHECK=1 they can,
    but their first NCCL collective fails; and on 16 cores the imports saved no start-up time."""
    nvidia = "/proc/driver/nvidia/gpus"
    return (os.path.isdir(nvidia) and bool(os.listdir(nvidia))) or os.path.exists("/dev/kfd")


def wait_worker_zygotes() -> None:
    """Wait until this process's zygotes listen; a zygote that cannot start raises with its error (RuntimeError)."""
    for zygote in _started:
        zygote.wait_ready()


def stop_worker_zygotes() -> None:
    """Stop this process's zygotes (after its Ray has stopped) and forget them (a later Ray may start without);
    then remove their sockets' directory."""
    directories = {os.path.dirname(zygote.socket_path) for zygote in _started}
    while _started:
        _started.pop().stop()
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def light_actor_options() -> dict:
    """Actor options for an actor that needs none of the model code (the weight-sync actor, a reward worker): under
    a local Ray with zygotes, a worker forked from the light one; elsewhere none."""
    if not _started:
        return {}
    return {"runtime_env": {"env_vars": {LIGHT_ENV: "1"}}}
