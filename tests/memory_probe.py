"""Measure, in a fresh process, the peak host memory of one LoRA forward + backward of the tiny model on CPU.

    python tests/memory_probe.py MODEL_DIR BATCH HEIGHT CHECKPOINTING(0|1) TEXT_TOKENS

Prints JSON {"peak_delta": bytes}: the rise of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs just before) over its resident set before the forward. Run with
MALLOC_MMAP_THRESHOLD_=65536 so freed activations go back to the OS and the peak is the peak.
"""

import json
import sys

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


def main() -> None:
    path, batch, size, checkpointing, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
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
    print(json.dumps({"peak_delta": _status("VmHWM") - before}))


if __name__ == "__main__":
    main()
