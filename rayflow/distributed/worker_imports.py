"""Where a local Ray's worker processes come from: forked from a zygote that holds the model code imported.

On a laptop an actor's first seconds are imports: torch, diffusers, transformers, peft, ~3 s of CPU a process on
2 cores, and every actor pays them again. A local run (rayflow.driver.launch) and the test suite's Ray
(tests/conftest.py) therefore start Ray with `init_local_ray`: a zygote (rayflow.distributed.zygote) that imports
torch, FSDP, peft and the run's diffusers pipeline class (its model classes and transformers' modeling code), then
Ray and the learner's and rollout rank's code, and Ray starting every worker through the zygote client, which has
the zygote fork it. A forked worker starts with all of that imported for ~0.2 s of CPU instead of ~3.5 s.

Ray is told the client as its worker script (`_worker_script`), not through a runtime env's `py_executable`: a
worker of a non-empty runtime env is started through Ray's setup_worker.py, which imports Ray (~0.45 s of CPU) before
it execs the worker command, more than a forked worker's own start. So no actor here has a runtime env of its own,
and every actor, the weight-sync actor and reward workers included, is forked from the one zygote.

Linux machines of up to MAX_CORES cores without GPUs (`has_gpus`); RAYFLOW_ZYGOTE=0 in the environment turns it off
(every worker is then a fresh Python process, as on a cluster; an actor whose runtime env sets it gets one),
RAYFLOW_ZYGOTE=1 on whatever the machine (on a GPU machine it fails: `has_gpus`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator

from rayflow.distributed.zygote import Zygote
from rayflow.distributed.zygote_client import SWITCH_ENV

MODEL_MODULES = ("torch", "torch.distributed.fsdp", "peft")
"""What the zygote imports at start besides the run's pipeline class (`diffusers:<class>`)."""
RAY_SERIALIZER_MODULES = ("ray.util.serialization_addons", "ray._common.pydantic_compat", "pydantic.v1.fields",
                          "ray._private.arrow_serialization")
"""What Ray imports in a worker the first time it serializes anything (`ray.util.serialization_addons.apply`
registers its pydantic and Arrow serializers): 0.12 s of CPU in every forked worker unless the zygote holds them
(tests/test_zygote.py checks this list against what `apply` imports)."""
MODEL_RAY_MODULES = ("ray", *RAY_SERIALIZER_MODULES, "rayflow.learner.worker", "rayflow.learner.backend",
                     "rayflow.rollout.rank")
"""What the zygote imports when its first worker asks, under that worker's Ray variables
(rayflow.distributed.zygote.RayEnvironment): Ray, its serializers' modules, and the actors' code that defines no Ray
remote class. Defining one draws a random id from the generator of Ray's C++ side, which seeds it in the zygote, and
every worker forked after that drew the same "random" ids (two forked workers put the same object into the store, and
one of them died)."""
MAX_CORES = 16
"""Above this many cores a local run starts plain workers: there the imports are not the bottleneck they are on a
laptop."""
NO_WORKERS_AHEAD = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""Ray's `_system_config` under a zygote: no workers started ahead of demand. Both switches: enable_worker_prestart
alone left the raylet starting workers for the first driver (one or two, idle for the whole run)."""

_zygote: Zygote | None = None
"""This process's zygote, while its local Ray runs."""


def init_local_ray(pipeline_class: str, meanwhile: Callable[[], object] | None = None, **init_kwargs):
    """`ray.init(address="local", **init_kwargs)`, its workers forked from a zygote that preloads `pipeline_class`
    where `zygotes_wanted()`. The zygote imports while Ray starts; this returns once both are up (an error of either
    stops both). `meanwhile()` runs once Ray is up, before the wait for the zygote: the caller's own imports for after
    the start, on a core the zygote's last imports leave idle. After `ray.shutdown()`, `stop_worker_zygote()`."""
    import ray

    if not zygotes_wanted():
        context = ray.init(address="local", **init_kwargs)
        if meanwhile is not None:
            meanwhile()
        return context
    global _zygote
    if _zygote is not None:  # one local Ray per process: stopping it here would kill that Ray's workers
        raise RuntimeError("this process's zygote already runs (a local Ray started here is still up)")
    directory = tempfile.mkdtemp(prefix="rayflow-zygote-")  # mode 0700: only this user reaches the socket
    try:
        _zygote = Zygote.launch(os.path.join(directory, "zygote"),
                                [*MODEL_MODULES, f"diffusers:{pipeline_class}", *MODEL_RAY_MODULES])
        with _worker_script(_zygote.write_worker_entry(_default_worker_script())):
            context = ray.init(address="local", _system_config=NO_WORKERS_AHEAD, **init_kwargs)
        if meanwhile is not None:
            meanwhile()
        _zygote.wait_ready()
    except BaseException:
        if ray.is_initialized():
            ray.shutdown()
        stop_worker_zygote()
        shutil.rmtree(directory, ignore_errors=True)  # if no zygote was launched in it
        raise
    return context


@contextlib.contextmanager
def _worker_script(path: str) -> Iterator[None]:
    """Within: a local Ray that starts runs `python PATH ARGS...` for a worker instead of Ray's default_worker.py.
    Ray has no public option for it: ray.init leaves RayParams.worker_path unset, and the node fills it in with
    `update_if_absent`, which is where this puts PATH. (tests/test_runs.py checks that a local Ray's actors are forked.)"""
    from ray._private.parameter import RayParams

    update_if_absent = RayParams.update_if_absent

    def with_worker_script(params, **kwargs):
        if "worker_path" in kwargs:
            kwargs["worker_path"] = path
        update_if_absent(params, **kwargs)

    RayParams.update_if_absent = with_worker_script
    try:
        yield
    finally:
        RayParams.update_if_absent = update_if_absent


def _default_worker_script() -> str:
    """Ray's default_worker.py, the script the node would run for a worker (ray._private.node does the same join)."""
    import ray._private.node

    return os.path.join(os.path.dirname(ray._private.node.__file__), "workers", "default_worker.py")


def zygotes_wanted() -> bool:
    """Whether a local Ray started here forks its workers from a zygote: on Linux, with RAYFLOW_ZYGOTE=1, or unless
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


def stop_worker_zygote() -> None:
    """Stop this process's zygote (after its Ray has stopped) and forget it (a later Ray may start without one); then
    remove its socket's directory."""
    global _zygote
    if _zygote is None:
        return
    zygote, _zygote = _zygote, None
    zygote.stop()
    shutil.rmtree(os.path.dirname(zygote.socket_path), ignore_errors=True)
