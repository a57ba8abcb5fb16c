"""Training checkpoints: one directory per step, written atomically, the last k kept.

    <output_dir>/checkpoints/step_00000010/
        meta.json                    step, version, identity (base model, LoRA, algorithm), data position, counters
        adapter_default.safetensors  full LoRA tensors by canonical name ("transformer_blocks.0.attn.to_q.lora_A.weight")
        adapter_old.safetensors      the EMA shadow (DiffusionNFT)
        optimizer.pt                 AdamW state of full tensors by canonical name (plain tensors, numbers, strings)
        rng.safetensors              RNG states per process ("driver/torch", "learner1/numpy.keys", ...)

The same format serves the single-process reference trainer and the distributed learners (whose
state is gathered to full tensors), so either can resume or export the other's checkpoints.
Nothing is unpickled: tensors come from safetensors, the optimizer from torch.load(weights_only=True).
A directory is first written under a temporary name beside its final one and renamed when
complete, so a crash never leaves a partial `step_*` directory behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

FORMAT = "rayflow-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class Checkpoint:
    """Everything a run needs to continue exactly where it stopped, as plain data."""

    step: int
    """Optimizer steps completed; the resumed run's next step has this index."""
    version: int
    """Policy version of the adapters."""
    identity: dict
    """What this checkpoint can be resumed into (rayflow.learner.model.policy_identity)."""
    adapters: dict[str, dict[str, torch.Tensor]]
    """Adapter name → {canonical name: full tensor}."""
    optimizer: dict
    """rayflow.learner.state.optimizer_state output."""
    rng: dict[str, dict[str, torch.Tensor]]
    """Process name ("driver", "learner0", ...) → its RNG states (rayflow.rng)."""
    data: dict
    """The prompt sampler's position (GroupSampler.state_dict())."""
    counters: dict[str, int] = field(default_factory=dict)
    """Running totals that continue across a resume (e.g. skipped_steps)."""


class CheckpointMismatch(ValueError):
    """The checkpoint was written for another base model, LoRA configuration or algorithm."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directories under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = sorted(int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.match(name)))
    return [step_dir(root, s) for s in steps]


def latest_checkpoint(root: str) -> str | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(root: str, ckpt: Checkpoint, keep: int) -> str:
    """Write `ckpt` as root/step_<step>, atomically; then delete all but the newest `keep`. Returns its path."""
    os.makedirs(root, exist_ok=True)
    final = step_dir(root, ckpt.step)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=root)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is as readable as the run's other outputs
    try:
        for name, tensors in ckpt.adapters.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, f"adapter_{name}.safetensors"))
        torch.save(ckpt.optimizer, os.path.join(tmp, "optimizer.pt"))
        rng = {f"{process}/{key}": t for process, states in ckpt.rng.items() for key, t in states.items()}
        save_file(rng, os.path.join(tmp, "rng.safetensors"))
        meta = {
            "format": FORMAT, "step": ckpt.step, "version": ckpt.version, "identity": ckpt.identity,
            "adapters": sorted(ckpt.adapters), "data": ckpt.data, "counters": ckpt.counters,
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=2)
        _replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return final


def _replace_dir(src: str, dst: str) -> None:
    # A rename onto an existing directory fails: move the old one aside first, so `dst` is at every
    # moment either the old complete checkpoint or the new one.
    aside = None
    if os.path.exists(dst):
        aside = tempfile.mkdtemp(prefix=f".old-{os.path.basename(dst)}-", dir=os.path.dirname(dst))
        os.rename(dst, os.path.join(aside, "ckpt"))
    os.rename(src, dst)
    if aside is not None:
        shutil.rmtree(aside)


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path!r} is not a rayflow checkpoint (no meta.json)")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r}: checkpoint format {meta.get('format')!r}; this rayflow reads {FORMAT!r}")
    return meta


def load_checkpoint(path: str, identity: dict | None = None) -> Checkpoint:
    """Read a checkpoint directory. With `identity`, refuse (CheckpointMismatch, naming every difference)
    a checkpoint written for another base model, LoRA configuration or algorithm."""
    meta = read_meta(path)
    if identity is not None:
        check_identity(meta["identity"], identity, repr(path))
    rng: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(os.path.join(path, "rng.safetensors")).items():
        process, name = key.split("/", 1)
        rng.setdefault(process, {})[name] = t
    return Checkpoint(
        step=meta["step"],
        version=meta["version"],
        identity=meta["identity"],
        adapters={name: load_adapter(path, name) for name in meta["adapters"]},
        optimizer=torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True),
        rng=rng,
        data=meta["data"],
        counters=meta["counters"],
    )


def load_adapter(path: str, name: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, f"adapter_{name}.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no adapter {name!r} (adapters: {read_meta(path)['adapters']})")
    return load_file(file)


def check_identity(saved: dict, current: dict, what: str) -> None:
    """Raise CheckpointMismatch naming every field where a checkpoint's identity differs from this run's."""
    diffs = _differences(saved, current, "")
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint {what} was written for a different run and cannot be resumed here; "
            + "; ".join(f"{key}: checkpoint {a!r}, this run {b!r}" for key, a, b in diffs)
        )


def _differences(saved, current, prefix: str) -> list[tuple[str, object, object]]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            out += _differences(saved.get(key), current.get(key), name)
        return out
    return [] if saved == current else [(prefix, saved, current)]


def resolve_resume(resume: str, root: str) -> str | None:
    """trainer.resume → the checkpoint directory to start from, or None to start over.

    "auto": the newest checkpoint under `root`, if any. "never": none, and an error if `root` already
    holds checkpoints (a new run would mix its checkpoints with an old run's). Otherwise a path:
    a checkpoint directory, or a directory of them (its newest)."""
    if resume == "auto":
        return latest_checkpoint(root)
    if resume == "never":
        if list_checkpoints(root):
            raise ValueError(
                f"trainer.resume=never but {root!r} holds checkpoints of an earlier run; "
                f"use trainer.resume=auto to continue it, or another trainer.output_dir"
            )
        return None
    return find_checkpoint(resume)


def find_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint directory, else the newest checkpoint inside it."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    newest = latest_checkpoint(path)
    if newest is None:
        raise FileNotFoundError(f"{path!r} is neither a checkpoint directory nor a directory of checkpoints")
    return newest


def checkpoint_root(output_dir: str) -> str:
    """Where a run's checkpoints live: <trainer.output_dir>/checkpoints."""
    return os.path.join(output_dir, "checkpoints")


def is_save_step(steps_done: int, save_every: int, total_steps: int) -> bool:
    """Checkpoint after every save_every-th step (0: never in between) and after the last one."""
    return steps_done == total_steps or (save_every > 0 and steps_done % save_every == 0)


def export_lora(path: str, out: str, adapter: str = "default") -> str:
    """Write one adapter of a checkpoint in diffusers' LoRA format (out/pytorch_lora_weights.safetensors,
    "transformer."-prefixed peft keys, the LoRA config as metadata so alpha survives), with the pipeline
    class's own save_lora_weights. Returns `out`."""
    import diffusers
    from peft import LoraConfig

    identity = read_meta(path)["identity"]
    tensors = load_adapter(path, adapter)
    lora = identity["lora"]
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["targets"])
    pipeline = getattr(diffusers, identity["model"]["pipeline"])
    pipeline.save_lora_weights(out, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=config.to_dict())
    return out
