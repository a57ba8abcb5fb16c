"""Start-up checks of a config against the devices it will run on, before any actor starts.

`device_facts` runs where the work runs (a one-GPU Ray task on a GPU cluster, else this process);
`check_device` and the memory planner turn facts and config into one ConfigError naming the key.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from rayflow.config import RayflowConfig
from rayflow.errors import ConfigError

log = logging.getLogger("rayflow")


@dataclass(frozen=True)
class DeviceFacts:
    device: str
    """"cuda" or "cpu"."""
    name: str
    total_bytes: int
    """Memory of one GPU (0 on CPU)."""
    bf16: bool
    """Whether bfloat16 runs natively (CUDA compute capability 8.0 and newer; always on CPU)."""
    compiler: bool
    """Whether torch.compile has a backend compiler: Triton on CUDA, a C++ compiler on CPU."""


def device_facts() -> DeviceFacts:
    """Facts about the device this process sees (the first GPU, else the CPU)."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return DeviceFacts("cuda", props.name, props.total_memory, torch.cuda.is_bf16_supported(including_emulation=False),
                           importlib.util.find_spec("triton") is not None)
    compiler = any(shutil.which(cc) for cc in ("c++", "g++", "clang++"))
    return DeviceFacts("cpu", "cpu", 0, True, compiler)


def uses_bf16(cfg: RayflowConfig) -> list[tuple[str, str]]:
    """(key, value) of every setting that computes in bf16."""
    keys = []
    if cfg.model.dtype == "bfloat16":
        keys.append(("model.dtype", cfg.model.dtype))
    if cfg.learner.mixed_precision != "none":
        keys.append(("learner.mixed_precision", cfg.learner.mixed_precision))
    return keys


def check_device(cfg: RayflowConfig, facts: DeviceFacts) -> None:
    """ConfigError for a setting the device cannot run: bf16 without native support, a CUDA-only attention
    kernel without CUDA, compile without a compiler."""
    for key, value in uses_bf16(cfg):
        if not facts.bf16:
            # Not float16: it trains only under learner.mixed_precision=autocast (LearnerConfig's check), which computes
            # in bf16 too, so the advice to use it went round in a circle.
            allowed = "float32" if key == "model.dtype" else "'none' with model.dtype=float32"
            raise ConfigError(key, value, f"{allowed}: {facts.name} has no native bf16 (CUDA compute capability 8.0 or "
                                          f"newer), and model.dtype=float16 trains only with "
                                          f"learner.mixed_precision=autocast, which computes in bf16")
    from rayflow.models.speed import CUDA_ONLY_BACKENDS, HALF_ONLY_BACKENDS

    backend = cfg.model.attention_backend
    if backend in CUDA_ONLY_BACKENDS and facts.device != "cuda":
        raise ConfigError("model.attention_backend", backend,
                          f"one of 'auto', 'flash', 'math' on {facts.device} ({list(CUDA_ONLY_BACKENDS)} are CUDA kernels)")
    if backend in HALF_ONLY_BACKENDS and facts.device == "cuda":
        # Else the first rollout request fails in SDPA ("No available kernel"): the learner's autocast or bf16 policy
        # would run it in bf16, but a rollout rank computes in model.dtype.
        if not facts.bf16:
            raise ConfigError("model.attention_backend", backend,
                              f"'auto', 'efficient' or 'math' on {facts.name}: CUDA's {backend} kernel needs compute "
                              f"capability 8.0 or newer")
        if cfg.model.dtype == "float32":
            raise ConfigError("model.attention_backend", backend,
                              f"'auto', 'efficient' or 'math' with model.dtype=float32 (CUDA's {backend} kernel takes "
                              f"float16 and bfloat16 only, and rollout ranks compute in model.dtype), or "
                              f"model.dtype=bfloat16")
    if cfg.model.compile and not facts.compiler:
        needed = "Triton (pip install triton)" if facts.device == "cuda" else "a C++ compiler (g++ or clang++)"
        raise ConfigError("model.compile", True, f"false on this {facts.device}: torch.compile needs {needed}")


def start_cluster_probe() -> Callable[[], DeviceFacts] | None:
    """Start a short one-GPU task on the connected Ray cluster that returns that GPU's DeviceFacts; returns the
    function that waits for them, or None without GPUs."""
    import ray

    if ray.cluster_resources().get("GPU", 0) < 1:
        return None
    facts = ray.remote(num_gpus=1, num_cpus=0)(device_facts).remote()
    return lambda: ray.get(facts, timeout=600)


def check_before_start(cfg: RayflowConfig) -> None:
    """Every start-up check on the connected cluster: the device's features, and on GPU clusters the
    memory plan (trainer.memory_check) against one GPU's memory (or trainer.gpu_memory_gib)."""
    from rayflow.distributed.resources import role_bundles

    wait_for_probe = start_cluster_probe()
    if wait_for_probe is None:
        if any(b.gpus for b in role_bundles(cfg)):  # GPUs asked of nodes an autoscaler adds: not this CPU's features
            log.info("no GPU in the cluster yet: the devices and the memory plan are not checked (the ranks' GPUs come "
                     "with the nodes the autoscaler adds); `python tools/plan.py` shows the plan")
            return
        check_device(cfg, device_facts())
        log.info("no GPU in the cluster (yet): the memory plan is not checked; `python tools/plan.py` shows it")
        return
    from rayflow.planning.memory import GiB, check_fits, format_plan, plan_config
    from rayflow.planning.sizes import NoPublishedConfigs

    # The plan is made while the probe's GPU worker starts: on a fresh H100 machine the probe took 17 s (a new
    # worker importing torch and creating a CUDA context) and the plan 8 s, one after the other before this.
    planned = None
    if cfg.trainer.memory_check:
        try:
            planned = plan_config(cfg)
        except NoPublishedConfigs as e:
            log.warning("the memory plan is not checked: %s (`python tools/plan.py` there; trainer.memory_check=false "
                        "silences this)", e)
    facts = wait_for_probe()
    check_device(cfg, facts)
    if planned is None:
        return
    plan, source = planned
    device_bytes = int(cfg.trainer.gpu_memory_gib * GiB) if cfg.trainer.gpu_memory_gib else facts.total_bytes
    log.info("memory plan (%s):\n%s", facts.name, format_plan(plan, device_bytes, source))
    check_fits(cfg, plan, device_bytes)
