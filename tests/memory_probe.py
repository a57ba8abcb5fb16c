"""The peak host memory of one LoRA forward + backward of the tiny model on CPU, measured in a process of its own.

`peak_delta` is the rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs just
before) over its resident set before the forward, with glibc's mmap threshold at 64 KiB so that freed activations go
back to the OS and the peak is the peak. tests/test_planning.py runs it in a process forked from the test session's
forkserver (tests/ranks.py), whose peaks a fresh interpreter's matched (README, Memory planner).
"""

import ctypes

import torch

from rayflow.distributed.parallelize import apply_activation_checkpointing
from rayflow.models.lora import add_lora
from rayflow.models import load_model


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


M_MMAP_THRESHOLD = -3
"""glibc's mallopt parameter: allocations above the threshold are mmapped, and unmapped when freed."""


def peak_delta(path: str, batch: int, size: int, checkpointing: bool, tokens: int) -> int:
    """The rise of this process's peak resident set over one LoRA forward + backward, after a warm-up one."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536)  # freed activations go back to the OS
    torch.set_num_threads(1)
    model = load_model(path, transformer_only=True)
    add_lora(model.transformer, rank=8, alpha=8, targets=model.lora_target_modules)
    if checkpointing:
        apply_activation_checkpointing(model.transformer)
    model.transformer.train()
    latents, _ = model.prepare_latents(list(range(batch)), size, size)
    cond = model.planning_conditioning(batch, tokens)  # same shape the planner uses
    cond.embeds.normal_()
    timestep = torch.full((batch,), 500.0)
    # One warm-up step: lazily allocated state (autograd, allocator arenas) is then part of the baseline.
    model.predict_velocity(latents, timestep, cond, size, size).square().mean().backward()
    model.transformer.zero_grad(set_to_none=False)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    model.predict_velocity(latents, timestep, cond, size, size).square().mean().backward()
    return _status("VmHWM") - before
