"""A run's directory and what resuming into it means, decided before anything starts.

    <trainer.output_dir>/<trainer.run_name>/
        config.yaml     the resolved config the run (last) started with
        inputs.json     what its input files held then (INPUTS_FILE)
        checkpoints/    step_00000050/ ... (rayflow.checkpoint)
        tensorboard/

A resume is checked against the config the checkpoint's run was started with: a run that is already
complete says so instead of training nothing; settings that change what the run means (model,
algorithm, LoRA, sampling, CFG, rewards, prompts, batch and group sizes, seed) are refused, naming
each; the others (total_steps, logging, eval, placement, ...) are allowed and listed. Input files are
compared by what they hold, not where they are.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
from dataclasses import dataclass, field

import torch
import yaml

from rayflow.checkpoint import CheckpointMismatch, check_train_mode, checkpoint_root, read_meta, resolve_resume
from rayflow.config import RayflowConfig, set_dotted, to_dict, to_yaml, unread_at_defaults
from rayflow.data.prompts import load_prompts
from rayflow.errors import ConfigError
from rayflow.models.base import pipeline_class_of
from rayflow.models.shapes import check_shapes_base
from rayflow.rewards.validation import check_prompt_file

log = logging.getLogger("rayflow")
CONFIG_FILE = "config.yaml"
BREAKING = ("model.", "algorithm.", "learner.lora_", "sampling.", "cfg.", "reward.functions", "data.prompts", "data.shuffle",
            "trainer.seed")
"""Dotted-key prefixes whose change makes a resumed run a different experiment."""
IGNORED = ("model.cache_dir", "trainer.output_dir", "trainer.run_name", "trainer.logdir", "trainer.resume")
"""Keys that only locate the run (a copied run dir may be resumed from a new place)."""


INPUTS_FILE = "inputs.json"
"""Beside config.yaml: a fingerprint of each input file or directory (input_paths) when the run last started. A resume
compares what they hold, not their paths: a RayJob retry or a resubmission finds the recipe's files in another copy
of its working directory (another path, the same files), and a prompt file edited in place is another run."""
WHOLE_FILE_BYTES = 64 * 2**20
"""Files up to this size are hashed whole; larger ones (a reward model's weights) by their size, head and tail."""


class RunComplete(Exception):
    """The checkpoint to resume from already reached trainer.total_steps: there is nothing to train."""


class ResumeRefused(ValueError):
    """Resuming would continue a checkpoint under settings that change the run's meaning."""


USER_ERRORS = (ConfigError, CheckpointMismatch, ResumeRefused, FileNotFoundError, ValueError)
"""Root causes that are a setting or a file to fix: shown as one line, without a traceback."""


@dataclass
class ResumePlan:
    path: str | None
    """The checkpoint to continue from; None starts a new run."""
    step: int = 0
    """Its step (0 for a new run)."""
    changed: list[str] = field(default_factory=list)
    """Allowed setting changes against the checkpoint's run, as "key: old -> new"."""
    inputs: dict[str, dict] | None = None
    """input_fingerprints(cfg) when the comparison with the saved run took them (for write_run_config, so that a
    resume hashes each input once); None when it did not."""


def plan_resume(cfg: RayflowConfig) -> ResumePlan:
    """Where `cfg` starts: a new run, or a checkpoint it may continue. Raises RunComplete when that
    checkpoint is at or past trainer.total_steps, ResumeRefused when a setting of BREAKING changed,
    ValueError/FileNotFoundError for a resume target that is not a checkpoint."""
    t = cfg.trainer
    path = resolve_resume(t.resume, checkpoint_root(t.run_dir))
    if path is None:
        return ResumePlan(None)
    meta = read_meta(path)
    check_train_mode(meta, {"train_mode": cfg.learner.train_mode}, path)
    check_checkpoint_model(meta, run_model_dir(cfg), path)  # before "complete": another model's run is not this one
    step = meta["step"]
    if step >= t.total_steps:
        raise RunComplete(
            f"run {t.run_name!r} is complete: {path} is step {step} and trainer.total_steps={t.total_steps}; nothing to "
            f"train. Continue it with a larger trainer.total_steps, or leave trainer.run_name unset to start a new run"
        )
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    saved_file = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(saved_file):
        return ResumePlan(path, step, [f"(no {CONFIG_FILE} beside {path}: settings not compared)"])
    with open(saved_file) as f:
        # A value its own settings left unread (an older version accepted one) was no setting of the run.
        saved_config = unread_at_defaults(yaml.safe_load(f) or {})
    current_config = to_dict(cfg)
    saved_inputs = _read_inputs(run_dir)
    inputs = input_fingerprints(cfg) if saved_inputs else None
    moved = _compare_inputs_by_content(saved_config, current_config, saved_inputs, inputs or {})
    saved, current = _flatten(saved_config), _flatten(current_config)
    diffs = [(key, saved.get(key), current.get(key)) for key in sorted(set(saved) | set(current))
             if saved.get(key) != current.get(key) and not key.startswith(IGNORED)]
    refused = [d for d in diffs if d[0].startswith(BREAKING)]
    ema_saved, ema_now = float(saved.get("trainer.ema_decay") or 0), cfg.trainer.ema_decay
    if (ema_saved > 0) != (ema_now > 0):  # the checkpoint holds the "ema" weights exactly when its run kept them
        refused.append(("trainer.ema_decay", ema_saved, ema_now))
    if refused:
        raise ResumeRefused(
            f"cannot resume {path} under changed settings that change what the run means: "
            + "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in refused)
            + ". Put them back, or " + (f"leave out trainer.resume={t.resume}" if t.resume not in ("auto", "never")
                                          else "leave trainer.run_name unset (and trainer.resume=auto)")
            + " to start a new run"
        )
    return ResumePlan(path, step, moved + [f"{k}: {a!r} -> {b!r}" for k, a, b in diffs], inputs)


def run_model_dir(cfg: RayflowConfig) -> str:
    """The pipeline directory the run loads: model.path, or the cached tiny twin (preflight builds it first)."""
    from rayflow.models.tiny import cached_tiny_dir

    m = cfg.model
    return m.path if m.path is not None else cached_tiny_dir(m.cache_dir, m.tiny_size, m.tiny_seed, m.tiny_arch)


def check_checkpoint_model(meta: dict, model_dir: str, path: str) -> None:
    """Refuse a checkpoint whose meta.json records another model than `model_dir` holds: its pipeline class (the
    family), transformer class, or a key of the transformer's config (its layout). Told from the files, before Ray
    starts: without this a run whose config.yaml is missing (settings not compared) resumed another family's
    checkpoint, or was called complete, and only the learners' identity check refused it. Skipped where the model
    directory is not here (a cluster's path)."""
    saved = meta["identity"].get("model")
    config_file = os.path.join(model_dir, "transformer", "config.json")
    if not isinstance(saved, dict) or not os.path.isfile(config_file):
        return
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:  # escaped naming no file (json's own message only)
        raise ValueError(f"model.path: {config_file} is not a valid transformer config.json ({e})") from None
    if not isinstance(config, dict):  # a list escaped as an AttributeError traceback
        raise ValueError(f"model.path: {config_file} is not a valid transformer config.json (got a JSON "
                         f"{type(config).__name__}; allowed: an object of the transformer's settings)")
    current = {"pipeline": pipeline_class_of(model_dir), "transformer": config.get("_class_name")}
    diffs = [(f"identity.model.{key}", saved[key], value) for key, value in current.items()
             if key in saved and saved[key] != value]
    saved_config = saved.get("transformer_config") or {}
    if not diffs:  # the same classes: a layout key both record (the config file names some the identity lacks)
        diffs = [(f"identity.model.transformer_config.{key}", saved_config[key], config[key])
                 for key in sorted(set(saved_config) & set(config)) if saved_config[key] != config[key]]
    if diffs:
        raise CheckpointMismatch(
            f"checkpoint {path} was written for another model: {os.path.join(path, 'meta.json')} has "
            + ", ".join(f"{key}={a!r}" for key, a, _ in diffs) + f"; this run's model {model_dir} has "
            + ", ".join(f"{key.rsplit('.', 1)[-1]}={b!r}" for key, _, b in diffs)
            + ". Resume it with the model it was trained on (model.path / model.tiny_arch), or start a new run (another "
              "trainer.run_name, or trainer.resume=never)"
        )


def input_paths(config: dict) -> dict[str, str]:
    """Dotted key -> path of each file or directory the run reads: model.path, data.prompts, data.eval_prompts and
    each reward's kwargs.path (reward.functions.<i>.kwargs.path)."""
    found = {f"{section}.{key}": config.get(section, {}).get(key)
             for section, key in (("model", "path"), ("data", "prompts"), ("data", "eval_prompts"))}
    for i, fn in enumerate(config.get("reward", {}).get("functions") or []):
        found[f"reward.functions.{i}.kwargs.path"] = (fn.get("kwargs") or {}).get("path")
    return {key: path for key, path in found.items() if isinstance(path, str)}


def input_fingerprints(cfg: RayflowConfig) -> dict[str, dict]:
    """Dotted key -> {"path", "fingerprint"} of each input (input_paths): what inputs.json records, and what a resume
    compares against it."""
    return {key: {"path": path, "fingerprint": fingerprint(path)} for key, path in input_paths(to_dict(cfg)).items()}


def fingerprint(path: str) -> str | None:
    """What a file or directory holds: a file's sha256 (up to WHOLE_FILE_BYTES; beyond, of its size, first and last
    MiB); a directory's, of its files' relative paths and fingerprints; None when nothing is there."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size <= WHOLE_FILE_BYTES:
                h.update(f.read())
            else:
                h.update(str(size).encode() + f.read(2**20))
                f.seek(-(2**20), os.SEEK_END)
                h.update(f.read())
        return h.hexdigest()
    if os.path.isdir(path):
        for folder, _, files in sorted(os.walk(path)):
            for name in sorted(files):
                file = os.path.join(folder, name)
                h.update(f"{os.path.relpath(file, path)}:{fingerprint(file)}\n".encode())
        return h.hexdigest()
    return None


def _read_inputs(run_dir: str) -> dict[str, dict]:
    try:
        with open(os.path.join(run_dir, INPUTS_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:  # a run from before inputs.json: its paths are compared as text
        return {}


def _compare_inputs_by_content(saved: dict, current: dict, fingerprints: dict[str, dict],
                               current_fingerprints: dict[str, dict]) -> list[str]:
    """Where an input's path changed but what it holds did not, give `current` the saved path (in place), so the
    comparison sees no change; where the same path holds something else now, mark the saved path as changed in
    `saved`, so it does. `fingerprints`: the saved run's inputs.json; `current_fingerprints`: input_fingerprints of
    `current`. Returns a line for each input found at a new path."""
    moved = []
    for key, path in input_paths(current).items():
        old = fingerprints.get(key)
        if not old:
            continue
        now = current_fingerprints[key]["fingerprint"]
        if now == old["fingerprint"] and path != old["path"]:
            moved.append(f"{key}: {old['path']!r} -> {path!r} (moved; the same content)")
            set_dotted(current, key, old["path"])
        elif now != old["fingerprint"] and path == old["path"]:
            set_dotted(saved, key, f"{path} (as it was when the run last started; it has changed since)")
    return moved


def preflight(cfg: RayflowConfig) -> tuple[list[str], ResumePlan]:
    """Checks that need no Ray: the prompt files, the model directory (on a local run it must be here),
    the resume target and what resuming would change. Returns the training prompts and the resume plan (whose
    inputs go to write_run_config)."""
    check_outputs_outlive_the_job(cfg)
    prompts = load_prompts(cfg.data.prompts, cfg.data.max_prompt_chars)
    if cfg.data.eval_prompts:
        load_prompts(cfg.data.eval_prompts, cfg.data.max_prompt_chars, key="data.eval_prompts")
    for key, path in (("data.prompts", cfg.data.prompts), ("data.eval_prompts", cfg.data.eval_prompts)):
        if path:  # e.g. an OCR prompt without a quoted target
            check_prompt_file([fn.name for fn in cfg.reward.functions], path, cfg.data.max_prompt_chars, key)
    if cfg.model.path is not None and not os.environ.get("RAY_ADDRESS"):
        check_shapes_base(cfg.model.path)  # the shipped base: missing or corrupt is named with its rebuild command
        if not os.path.isdir(cfg.model.path):
            raise ConfigError("model.path", cfg.model.path, "a diffusers pipeline directory on this machine (a local run loads it here)")
        pipeline_class_of(cfg.model.path)  # a directory without a valid model_index.json, named before Ray starts
    model_dir = build_tiny_model_once(cfg) if cfg.model.path is None else cfg.model.path
    if cfg.learner.lora_targets and cfg.learner.train_mode == "lora" and os.path.isdir(model_dir):
        check_lora_targets(model_dir, cfg.learner.lora_targets)
    plan = plan_resume(cfg)
    if plan.path is not None:
        log.info("resuming run %r from %s (step %d)", cfg.trainer.run_name, plan.path, plan.step)
        for change in plan.changed:
            log.warning("resumed with a changed setting: %s", change)
    else:  # said at the start: a mistyped run_name, or the same command in another directory, trains from step 0
        log.info("a new run %r in %s, from step 0", cfg.trainer.run_name, os.path.abspath(cfg.trainer.run_dir))
    return prompts, plan


def job_working_dir() -> str | None:
    """The directory a `ray job submit --working-dir` driver runs in: Ray's temporary copy of the upload, deleted after
    the job (the job supervisor starts the entrypoint there). None when this process is no job with a working_dir."""
    job_config = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")  # set by Ray's job supervisor for the entrypoint
    if not job_config:
        return None
    try:
        runtime_env = json.loads(job_config).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    return os.getcwd() if runtime_env.get("working_dir") else None


def check_outputs_outlive_the_job(cfg: RayflowConfig) -> None:
    """Refuse a run directory or TensorBoard directory inside the job's temporary working dir: the checkpoints would
    go with it, and the same command then trains from step 0. Checked on the resolved paths, since a relative path
    in a recipe YAML is made absolute against the YAML's directory, which under a job is inside that copy too (it
    was neither warned about nor refused), and trainer.logdir is a path of its own."""
    workdir = job_working_dir()
    if workdir is None:
        return
    workdir = os.path.realpath(workdir)
    for key, value, path in (("trainer.output_dir", cfg.trainer.output_dir, cfg.trainer.run_dir),
                             ("trainer.logdir", cfg.trainer.logdir, cfg.trainer.logdir)):
        resolved = os.path.realpath(path)
        if os.path.commonpath([resolved, workdir]) == workdir:
            raise ConfigError(key, value, f"a directory outside the job's working directory (here {resolved}, in Ray's "
                                          f"temporary copy of the upload, which Ray deletes): an absolute path on the "
                                          "head or on shared storage")


def check_lora_targets(model_dir: str, targets: list[str]) -> None:
    """learner.lora_targets against the names of the transformer's modules, built on meta from its config (no weights
    read): a name that binds none is named here, not by every learner rank after Ray started. Only for targets set
    by hand (the models' own bind by construction), since it imports diffusers before Ray starts."""
    from rayflow.models.lora import unbound_targets
    from rayflow.models.random_init import shape_only_components

    with open(os.path.join(model_dir, "model_index.json")) as f:
        others = tuple(name for name in json.load(f) if name != "transformer")
    transformer = shape_only_components(model_dir, skip=others)["transformer"]
    names = [name for name, _ in transformer.named_modules()]
    unbound = unbound_targets(targets, names)
    if unbound:
        linears = sorted({name.split(".")[-1] for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError("learner.lora_targets", targets, f"names that end modules of {type(transformer).__name__} "
                                                           f"({unbound} end none; its linear layers end in {linears})")


def build_tiny_model_once(cfg: RayflowConfig) -> str:
    """Build (or find) the cached tiny model here, quietly, so the actors only load it. A cached one costs no
    import of diffusers or transformers (1.7 s before Ray starts, on 2 cores)."""
    from rayflow.models.tiny import cached_tiny_dir, is_saved_model, resolve_model_path

    m = cfg.model
    if not is_saved_model(cached_tiny_dir(m.cache_dir, m.tiny_size, m.tiny_seed, m.tiny_arch)):
        import diffusers
        import transformers

        diffusers.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    return resolve_model_path(None, m.cache_dir, m.tiny_size, m.tiny_seed, m.tiny_arch)


RUN_LOCK_FILE = ".driver.lock"
"""In the run's directory: held (flock) by the driver that trains the run, with its pid and host in it."""


def lock_run_dir(cfg: RayflowConfig) -> int:
    """Hold <run_dir>/.driver.lock while this driver trains the run; returns its descriptor (release_run_dir frees it).
    A second driver of the same run (the README's resubmit loop after its `ray job submit` client exited while the
    job went on, or the same command submitted twice) is refused: two drivers trained one run, both resuming from and
    saving the same step_* directories, each overwriting the other's."""
    run_dir = make_run_dirs(cfg)
    fd = os.open(os.path.join(run_dir, RUN_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):  # storage without locks: run unguarded
            log.warning("cannot lock %s (%s): nothing stops a second driver of run %r", run_dir, e, cfg.trainer.run_name)
            return fd
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError("trainer.run_name", cfg.trainer.run_name,
                          f"a run no other driver is training: {run_dir} is held by {holder} (a job that still runs, e.g. "
                          f"one whose `ray job submit` exited while the job went on: `ray job list`); wait for it to end "
                          f"or stop it, or name another run") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    return fd


def release_run_dir(fd: int | None) -> None:
    """Let the next driver of the run take it (closing the descriptor drops the flock)."""
    if fd is not None:
        os.close(fd)


def write_run_config(cfg: RayflowConfig, inputs: dict[str, dict] | None = None) -> str:
    """Write <run_dir>/config.yaml and inputs.json (what a later resume is compared against), each atomically.
    `inputs`: input_fingerprints(cfg) if already taken (a resume's ResumePlan.inputs), else taken here.
    Returns config.yaml's path."""
    run_dir = make_run_dirs(cfg)
    if inputs is None:
        inputs = input_fingerprints(cfg)
    _replace_file(os.path.join(run_dir, INPUTS_FILE), json.dumps(inputs, indent=2))
    return _replace_file(os.path.join(run_dir, CONFIG_FILE), to_yaml(cfg))


def make_run_dirs(cfg: RayflowConfig) -> str:
    """Make the run's directory and trainer.logdir, before Ray starts; the run's directory. A path that cannot be a
    directory (a file in the way, no permission, a read-only mount) is a ConfigError naming its key: it was a
    traceback, and a bad logdir one line naming no key only after Ray had started."""
    for key, directory in (("trainer.output_dir", cfg.trainer.run_dir), ("trainer.logdir", cfg.trainer.logdir)):
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            value = cfg.trainer.output_dir if key == "trainer.output_dir" else directory
            raise ConfigError(key, value, f"a directory this process can create and write in (making {directory} "
                                          f"failed: {e})") from None
    return cfg.trainer.run_dir


def _replace_file(path: str, text: str) -> str:
    """`text` into `path` through a temporary file renamed over it (never half written), readable by all; `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp files are private; a run's outputs are as readable as any other file
    os.replace(tmp, path)
    return path


def _flatten(data, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict):
        out = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: data}
