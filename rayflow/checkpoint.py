"""Training checkpoints: one directory per step, written atomically, the last k kept.

    <output_dir>/checkpoints/step_00000010/
        meta.json                    step, version, identity (base model, LoRA, algorithm), data position, counters
        adapter_default.safetensors  full LoRA tensors by canonical name ("transformer_blocks.0.attn.to_q.lora_A.weight")
        adapter_old.safetensors      the EMA shadow (DiffusionNFT)
        adapter_ema.safetensors      the EMA for evaluation and export (trainer.ema_decay > 0)
        optimizer.pt                 AdamW state of full tensors by canonical name (plain tensors, numbers, strings)
        rng.safetensors              RNG states per process ("driver/torch", "learner1/numpy.keys", ...)
        manifest.json                sha256 and size of every file above, written last

With learner.train_mode=full, the adapter and optimizer files are replaced by one sharded directory:

        weights/.metadata, weights/__<rank>_0.distcp   torch.distributed.checkpoint of every weight set ("default",
                                     "old", "ema": whole transformers) and AdamW's state, each learner rank writing its
                                     shards (rayflow.learner.sharded); loads into any number of ranks

The same format serves the single-process reference trainer and the distributed learners (whose
LoRA state is gathered to full tensors; sharded weights any number of ranks reads), so either can
resume or export the other's checkpoints. LoRA checkpoints unpickle nothing: tensors come from
safetensors, the optimizer from torch.load(weights_only=True); a sharded directory's .metadata is
torch.distributed.checkpoint's own pickle, read only after the manifest's sha256 of it matched.
A directory is first written under a temporary name beside its final one, every file and the directory
fsynced, and renamed when complete, so neither a killed process nor a node crash leaves a partial
`step_*` directory behind. A checkpoint proves itself: `verify_checkpoint` checks the manifest's
checksums, the metadata's schema and that every tensor is finite (sharded weights: as their ranks found
them when writing, meta.json's "finite"), and `resolve_resume` falls back
(loudly, naming the file) from a damaged newest checkpoint to the previous intact one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from rayflow.checkpoint_integrity import all_finite, fsync_dir, meta_problem, seal_file, sha256_file

FORMAT = "rayflow-checkpoint/1"
MANIFEST = "manifest.json"
SHARDED_DIR = "weights"
"""Full fine-tuning's sharded weights and optimizer state (torch.distributed.checkpoint), in a checkpoint directory."""
_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER_DIR = re.compile(r"^\.(tmp|old|del)-(step_\d+)-")
log = logging.getLogger("rayflow")


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
    """Running totals that continue across a resume (e.g. skipped_steps, consecutive_skipped)."""
    base_model: dict = field(default_factory=dict)
    """The base model the run loaded (base_model_record): recorded, not compared on resume."""
    sharded: ShardedWeights | None = None
    """Full fine-tuning: the weights and optimizer state as a sharded directory, in place of `adapters` and
    `optimizer` (which are then empty)."""


@dataclass
class ShardedWeights:
    """A torch.distributed.checkpoint directory of every weight set and AdamW's state (rayflow.learner.sharded),
    written by the learner ranks, each its own shards."""

    directory: str
    names: list[str]
    """The weight sets it holds ("default", "old", "ema")."""
    finite: bool = True
    """Whether every tensor was finite when it was written (each rank checks its shards)."""


class CheckpointDamaged(ValueError):
    """A checkpoint file is missing, truncated, altered, holds non-finite tensors or invalid metadata."""

    def __init__(self, path: str, file: str, reason: str):
        self.path, self.file, self.reason = path, file, reason
        super().__init__(f"checkpoint {path} is damaged: {file}: {reason}")

    def __reduce__(self):
        return type(self), (self.path, self.file, self.reason)


class CheckpointWriteError(OSError):
    """Writing a checkpoint file failed (disk full, permissions, I/O error); names the file."""


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


def save_checkpoint(root: str, ckpt: Checkpoint, keep: int, previous_step: int | None = None) -> str:
    """Write `ckpt` as root/step_<step>, atomically and durably; then delete all but the newest `keep`,
    sparing the newest healthy checkpoint (finite tensors, last step applied) if none of those is. Returns its path.

    `previous_step`: the step of the checkpoint this run saved last or started from (0: from the start). The
    checkpoints under `root` after it are of a timeline the run left, set aside (`_abandon_others`); None: not known,
    only those after `ckpt.step` are."""
    os.makedirs(root, exist_ok=True)
    final = step_dir(root, ckpt.step)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=root)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is as readable as the run's other outputs
    try:
        if ckpt.sharded is not None:
            os.rename(ckpt.sharded.directory, os.path.join(tmp, SHARDED_DIR))  # written beside tmp, on the same filesystem
            names, finite = sorted(ckpt.sharded.names), ckpt.sharded.finite
        else:
            for name, tensors in ckpt.adapters.items():
                _write(tmp, f"adapter_{name}.safetensors", lambda f, t=tensors: save_file({k: v.contiguous() for k, v in t.items()}, f))
            _write(tmp, "optimizer.pt", lambda f: torch.save(ckpt.optimizer, f))
            names, finite = sorted(ckpt.adapters), all_finite(ckpt.adapters) and all_finite(ckpt.optimizer)
        rng = {f"{process}/{key}": t for process, states in ckpt.rng.items() for key, t in states.items()}
        _write(tmp, "rng.safetensors", lambda f: save_file(rng, f))
        healthy = finite and not ckpt.counters.get("consecutive_skipped", 0)
        meta = {
            "format": FORMAT, "step": ckpt.step, "version": ckpt.version, "identity": ckpt.identity,
            "adapters": names, "sharded": ckpt.sharded is not None, "data": ckpt.data, "counters": ckpt.counters,
            "base_model": ckpt.base_model, "healthy": healthy, "finite": finite,
        }
        _write(tmp, "meta.json", lambda f: _write_text(f, json.dumps(meta, indent=2)))
        files = {name: seal_file(os.path.join(tmp, name)) for name in _files(tmp)}
        # Written last: a directory with a valid manifest has every file complete.
        _write(tmp, MANIFEST, lambda f: _write_text(f, json.dumps({"format": FORMAT, "files": files}, indent=2)))
        seal_file(os.path.join(tmp, MANIFEST))
        for directory, _, _ in os.walk(tmp, topdown=False):
            os.chmod(directory, 0o755)  # the sharded weights' directory was made by mkdtemp too (private)
            fsync_dir(directory)
        _replace_dir(tmp, final)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _abandon_others(root, ckpt.step, previous_step)
    _rotate(root, keep)
    return final


def _abandon_others(root: str, step: int, previous_step: int | None) -> None:
    """Set aside the checkpoints of steps after `step` (just saved), and those after `previous_step` (the one this run
    saved last or resumed from) before it: a run resumed from an earlier one (past a damaged checkpoint, or an explicit
    trainer.resume) left that timeline, and rotation by step number would otherwise delete its new saves and keep the
    old timeline's (and the checkpoint it resumed from, the last of its own, not), and a later resume=auto pick the old
    timeline. Moved into .abandoned-step_*-*, kept for inspection, never resumed nor removed as a leftover."""
    found = list_checkpoints(root)  # oldest first
    since = step if previous_step is None else previous_step
    others = [path for path in found if _step_of(path) > since and _step_of(path) != step]
    for path in others:
        aside = _move_aside(path, "abandoned")
        log.warning("set %s aside as %s: this run resumed from an earlier step and saved step %d", path, aside, step)
    if others:
        fsync_dir(root)


def _step_of(path: str) -> int:
    """The step of a checkpoint directory listed by list_checkpoints (step_<step>)."""
    return int(_STEP_DIR.match(os.path.basename(path)).group(1))


def sharded_staging_dir(root: str, step: int) -> str:
    """A new directory under `root` for the learner ranks to write step `step`'s sharded weights into, before
    `save_checkpoint` moves it into the checkpoint (a leftover of a killed save, removed like the others)."""
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(step_dir(root, step))}-shards-", dir=root)


def _files(directory: str) -> list[str]:
    """Every file under `directory`, as sorted paths relative to it (the sharded weights' included)."""
    return sorted(os.path.relpath(os.path.join(d, f), directory) for d, _, names in os.walk(directory) for f in names)


def _write(directory: str, name: str, writer: Callable[[str], object]) -> None:
    file = os.path.join(directory, name)
    try:
        writer(file)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
        free = shutil.disk_usage(directory).free
        raise CheckpointWriteError(f"cannot write checkpoint file {file}: {e} ({free} bytes free on its filesystem)") from e


def _write_text(file: str, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)


def _rotate(root: str, keep: int) -> None:
    found = list_checkpoints(root)
    doomed, kept = found[:-keep], found[-keep:]
    if not any(_is_healthy(p) for p in kept):
        # The kept ones were all written after skipped steps or hold non-finite tensors: the newest
        # checkpoint that trained cleanly stays as the one to go back to.
        healthy = [p for p in doomed if _is_healthy(p)]
        if healthy:
            doomed.remove(healthy[-1])
            log.warning("checkpoint rotation keeps %s: the newer ones are not healthy (non-finite tensors or skipped steps)",
                        healthy[-1])
    for old in doomed:
        _remove_dir(old)


def _is_healthy(path: str) -> bool:
    try:
        return read_meta(path).get("healthy", False) is True
    except (OSError, ValueError):
        return False


def remove_leftovers(root: str) -> None:
    """Clear what saves killed midway left (.tmp-step_*, .old-step_*, .del-step_*). An .old- copy of a step that has
    no step_* directory is put back if it verifies: a re-save of that step killed between moving the old copy aside and
    renaming the new one in left it as the step's only complete copy. Every other leftover is deleted (.del-: a
    checkpoint rotation was deleting)."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        match = _LEFTOVER_DIR.match(name)
        if not match:
            continue
        leftover, final = os.path.join(root, name), os.path.join(root, match.group(2))
        if match.group(1) == "old" and not os.path.exists(final) and _is_intact(os.path.join(leftover, "ckpt")):
            os.rename(os.path.join(leftover, "ckpt"), final)
            fsync_dir(root)
            log.warning("restored %s from %s, left by a save of that step that did not finish", final, leftover)
        else:
            log.warning("removing %s, left by a checkpoint save that did not finish", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def _is_intact(path: str) -> bool:
    try:
        verify_checkpoint(path)
        return True
    except CheckpointDamaged:
        return False


def _replace_dir(src: str, dst: str) -> None:
    # A rename onto an existing directory fails: move the old one aside first, so `dst` is at every
    # moment either the old complete checkpoint or the new one.
    aside = _move_aside(dst) if os.path.exists(dst) else None
    os.rename(src, dst)
    if aside is not None:
        shutil.rmtree(aside)


def _remove_dir(path: str) -> None:
    """Delete a checkpoint directory, first renamed out of the step_* names in one step: a process killed or
    interrupted (`ray job stop`) while the files go leaves a leftover that the next start removes, never a
    step_* directory with some of its files gone."""
    shutil.rmtree(_move_aside(path, "del"))


def _move_aside(path: str, kind: str = "old") -> str:
    """Rename checkpoint directory `path` into a new .<kind>-<name>-* directory beside it (.old-: a re-save's old copy,
    which the next start puts back if the new one is missing; .del-: one being deleted); that directory."""
    aside = tempfile.mkdtemp(prefix=f".{kind}-{os.path.basename(path)}-", dir=os.path.dirname(path))
    os.rename(path, os.path.join(aside, "ckpt"))
    return aside


def read_meta(path: str) -> dict:
    """meta.json of a checkpoint directory, validated (CheckpointDamaged names the field and value)."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path!r} is not a rayflow checkpoint (no meta.json)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointDamaged(path, "meta.json", f"not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointDamaged(path, "meta.json", f"not a JSON object: {meta!r}")
    if meta.get("format") != FORMAT:
        raise CheckpointDamaged(path, "meta.json", f"format {meta.get('format')!r}; this rayflow reads {FORMAT!r}")
    problem = meta_problem(meta)
    if problem:
        raise CheckpointDamaged(path, "meta.json", problem)
    return meta


def verify_checkpoint(path: str, checksums: bool = True) -> None:
    """Raise CheckpointDamaged naming the first file that is missing, truncated or altered (against the
    manifest), invalid metadata, or a non-finite tensor in an adapter or the optimizer state.

    checksums=False: what can be told without reading the weights: the manifest, each file's size, meta.json, and the
    finite check the save itself made (meta.json's "finite"). Of a checkpoint this version saved, that finds what the
    full check finds, except a file altered after the save at its size (bit rot, an edit)."""
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        raise CheckpointDamaged(path, MANIFEST, "missing (not written by a complete save)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointDamaged(path, MANIFEST, f"unreadable ({e!r})") from None
    if not isinstance(files, dict):
        raise CheckpointDamaged(path, MANIFEST, f"unreadable ('files' is {type(files).__name__}, not an object)")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
            raise CheckpointDamaged(path, MANIFEST, f"unreadable (the entry of {name!r} is {entry!r}, not "
                                                    f"{{\"bytes\": int, \"sha256\": str}})")
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointDamaged(path, name, "missing")
        size = os.path.getsize(file)
        if size != entry["bytes"]:
            raise CheckpointDamaged(path, name, f"{size} bytes, the manifest says {entry['bytes']} (truncated or rewritten)")
        if checksums and sha256_file(file) != entry["sha256"]:
            raise CheckpointDamaged(path, name, "sha256 differs from the manifest's (the file was altered)")
    meta = read_meta(path)
    if not checksums and not meta.get("sharded") and meta.get("finite") is False:
        # The save's all_finite over the same adapters and optimizer state that the full check loads.
        raise CheckpointDamaged(path, "meta.json", "its save found non-finite (NaN or Inf) values in the adapters or "
                                                   "optimizer.pt (\"finite\": false)")
    if meta.get("sharded"):  # its ranks checked their shards' values when writing: reading them all here would gather the model
        if meta.get("finite") is False:
            raise CheckpointDamaged(path, f"{SHARDED_DIR}/", "holds non-finite (NaN or Inf) values (found by its ranks when writing)")
        return
    if not checksums:
        return
    for name in meta["adapters"]:
        if not all_finite(load_adapter(path, name)):
            raise CheckpointDamaged(path, f"adapter_{name}.safetensors", "holds non-finite (NaN or Inf) values")
    optimizer = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    if not all_finite(optimizer):
        raise CheckpointDamaged(path, "optimizer.pt", "holds non-finite (NaN or Inf) values")


def load_checkpoint(path: str, identity: dict | None = None) -> Checkpoint:
    """Read a checkpoint directory. With `identity`, refuse (CheckpointMismatch, naming every difference)
    a checkpoint written for another base model, LoRA configuration or algorithm."""
    meta = read_meta(path)
    if identity is not None:
        check_train_mode(meta, identity, path)
        check_identity(meta["identity"], identity, repr(path))
    rng: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(os.path.join(path, "rng.safetensors")).items():
        process, name = key.split("/", 1)
        rng.setdefault(process, {})[name] = t
    if meta.get("sharded"):
        sharded, adapters, optimizer = ShardedWeights(os.path.join(path, SHARDED_DIR), meta["adapters"]), {}, {}
    else:
        sharded, adapters = None, {name: load_adapter(path, name) for name in meta["adapters"]}
        optimizer = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    return Checkpoint(
        step=meta["step"],
        version=meta["version"],
        identity=meta["identity"],
        adapters=adapters,
        optimizer=optimizer,
        rng=rng,
        data=meta["data"],
        counters=meta["counters"],
        base_model=meta.get("base_model", {}),
        sharded=sharded,
    )


def load_adapter(path: str, name: str) -> dict[str, torch.Tensor]:
    file = os.path.join(path, f"adapter_{name}.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path!r} has no adapter {name!r} (adapters: {read_meta(path)['adapters']})")
    return load_file(file)


def check_train_mode(meta: dict, identity: dict, path: str) -> None:
    """Refuse a checkpoint of the other learner.train_mode with one message: what it holds, and what to do."""
    saved, current = train_mode_of(meta["identity"]), train_mode_of(identity)
    if saved != current:
        held = f"{SHARDED_DIR}/ (sharded full weights)" if meta.get("sharded") else \
            ", ".join(f"adapter_{name}.safetensors" for name in meta["adapters"]) + " (LoRA adapters)"
        raise CheckpointMismatch(
            f"learner.train_mode: got {current!r}; allowed: {saved!r} to resume checkpoint {path}, whose meta.json has "
            f"identity.train_mode={saved!r} and which holds {held}. Resume it with learner.train_mode={saved}, or start a "
            f"new run (another trainer.run_name, or trainer.resume=never)"
        )


def train_mode_of(identity: dict) -> str:
    """learner.train_mode of a policy identity (rayflow.learner.model.policy_identity): checkpoints from before
    full fine-tuning have no such key, and are LoRA."""
    return identity.get("train_mode", "lora")


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

    "auto": the newest intact checkpoint under `root`, if any. "never": none, and an error if `root` already
    holds checkpoints (a new run would mix its checkpoints with an old run's). Otherwise a path:
    a checkpoint directory, or a directory of them (its newest intact one). Leftovers of killed saves
    under `root` are removed first."""
    remove_leftovers(root)
    if resume == "auto":
        return newest_intact(root) if list_checkpoints(root) else None
    if resume == "never":
        if list_checkpoints(root):
            raise ValueError(
                f"trainer.resume=never but {root!r} holds checkpoints of an earlier run; "
                f"use trainer.resume=auto to continue it, or another trainer.output_dir"
            )
        return None
    try:
        return find_checkpoint(resume)
    except FileNotFoundError as e:  # the path alone did not say which setting named it
        raise FileNotFoundError(f"trainer.resume: {e}") from None


def find_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint directory (verified), else the newest intact checkpoint inside it."""
    if os.path.isfile(os.path.join(path, "meta.json")) or os.path.isfile(os.path.join(path, MANIFEST)):
        verify_checkpoint(path)
        return path
    if not list_checkpoints(path):
        inside = checkpoint_root(path)  # `path` a run's directory (tools/evaluate.py takes one)
        hint = f" (a run directory: its checkpoints are in {inside!r})" if list_checkpoints(inside) else ""
        raise FileNotFoundError(f"{path!r} is neither a checkpoint directory nor a directory of checkpoints{hint}")
    return newest_intact(path)


def newest_intact(root: str) -> str:
    """The newest checkpoint under `root` that verifies; each damaged newer one is reported (which file,
    why) and passed over. Raises CheckpointDamaged if none is intact."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
        except CheckpointDamaged as e:
            log.error("%s; falling back to the previous checkpoint", e)
            damaged.append(str(e))
            continue
        if damaged:
            log.warning("resuming from %s, the newest intact checkpoint (%d newer damaged)", path, len(damaged))
        return path
    raise CheckpointDamaged(root, "every checkpoint", "; ".join(damaged) + ". Restore one, or start a new run")


def newest_resumable(root: str) -> tuple[str | None, list[CheckpointDamaged]]:
    """The checkpoint under `root` that newest_intact (resume=auto) would pick, told without reading the weights
    (verify_checkpoint(checksums=False)), or None; and what is wrong with each newer one, newest first. Quiet: for
    messages about a run, where newest_intact is the resume itself."""
    damaged = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path, checksums=False)
        except CheckpointDamaged as e:
            damaged.append(e)
            continue
        return path, damaged
    return None, damaged


def base_model_record(model_cfg) -> dict:
    """What a checkpoint records of the base model (rayflow.config.ModelConfig): its directory, or the tiny spec."""
    if model_cfg.path is not None:
        return {"path": os.path.abspath(os.path.expanduser(model_cfg.path))}
    return {"tiny": {"size": model_cfg.tiny_size, "seed": model_cfg.tiny_seed}}


def checkpoint_root(output_dir: str) -> str:
    """Where a run's checkpoints live: <trainer.output_dir>/checkpoints."""
    return os.path.join(output_dir, "checkpoints")


def is_save_step(steps_done: int, save_every: int, total_steps: int) -> bool:
    """Checkpoint after every save_every-th step (0: never in between) and after the last one."""
    return steps_done == total_steps or (save_every > 0 and steps_done % save_every == 0)
