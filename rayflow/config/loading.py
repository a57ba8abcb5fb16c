"""Loading: a recipe YAML (with its `base`s) + CLI dotlist overrides -> plain data (omegaconf) -> RayflowConfig,
converted field by field and validated; and back (to_dict, to_yaml)."""

from __future__ import annotations

import dataclasses
import math
import os
import time
import types
import typing
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayflow.config.root import RayflowConfig, yaml_key
from rayflow.errors import ConfigError


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {[yaml_key(f.name) for f in dataclasses.fields(tp)]}"
    return {type(None): "null", bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, key)
            except ConfigError:
                pass
        raise ConfigError(key, value, _describe(tp))
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(key, value, _describe(tp))
        return _build(tp, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, _describe(tp))
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is Any:
        if tp is not Any and not isinstance(value, dict):
            raise ConfigError(key, value, _describe(tp))
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)  # .inf / .nan would pass every range check below and poison the run
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise ConfigError(key, value, _describe(tp))


REMOVED_KEYS = {
    "sync.apply_at": "nothing, the key is gone: set async.partial_rollout instead (true = the old apply_at=step, new "
                     "weights reach a trajectory at its next denoising-step boundary; false = the old apply_at=request, "
                     "new weights between requests only)",
}
"""Keys a config no longer has, with what to write instead."""


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f.name): f for f in dataclasses.fields(cls)}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if key in REMOVED_KEYS:
            raise ConfigError(key, value, REMOVED_KEYS[key])
        if name not in fields:
            raise ConfigError(key, value, f"a known key; {prefix or 'the config'} has {sorted(fields)}")
        f = fields[name]
        kwargs[f.name] = _convert(hints[f.name], value, key)
    return cls(**kwargs)


def from_dict(data: dict) -> RayflowConfig:
    """A validated RayflowConfig from plain data (as read from YAML)."""
    cfg = _build(RayflowConfig, data, "")
    cfg.validate()
    return cfg


BASE_KEY = "base"
"""A recipe's top-level `base: other.yaml` (relative to the recipe): that recipe's keys, then this one's on top."""


def _read_recipe(path: str, key: str = "--config", including: tuple[str, ...] = ()) -> DictConfig:
    """A recipe YAML with its relative paths resolved against its own directory, merged over its `base` (if any)."""
    try:
        data = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(key, path, "an existing YAML file") from None
    except (OmegaConfBaseException, OSError, yaml.YAMLError) as e:
        # Malformed YAML, or a top-level scalar.
        raise ConfigError(key, path, f"a YAML mapping of sections ({' '.join(str(e).split())})") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(key, path, "a YAML mapping of sections, not a list")
    here = os.path.dirname(os.path.abspath(path))
    data = OmegaConf.to_container(data, resolve=False)
    base = data.pop(BASE_KEY, None)
    data = OmegaConf.create(_relative_to(data, here))
    if base is None:
        return data
    base_key = f"{path}: {BASE_KEY}"
    if not isinstance(base, str):
        raise ConfigError(base_key, base, "the path of another recipe YAML, relative to this one")
    base_path = os.path.normpath(os.path.join(here, base))
    if base_path in including + (os.path.abspath(path),):
        raise ConfigError(base_key, base, "a recipe that does not include itself through its bases")
    return OmegaConf.merge(_read_recipe(base_path, base_key, including + (os.path.abspath(path),)), data)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the other arguments, the KEY=VALUE overrides) of a tool's command line, so that overrides may come anywhere:
    argparse gives one after `--staleness 0 1` to that option, and refuses one after an option once the
    positionals are taken."""
    is_override = [("=" in a and not a.startswith("-")) for a in argv]
    return [a for a, o in zip(argv, is_override) if not o], [a for a, o in zip(argv, is_override) if o]


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RayflowConfig:
    """Read a recipe YAML (optional; its `base`s first), apply dotlist overrides, convert and validate."""
    base = _read_recipe(path) if path else OmegaConf.create({})
    for text in overrides or []:
        if "=" not in text:  # omegaconf would read it as a key set to null, reported as an unknown key at best
            hint = " (a recipe YAML is given with --config)" if text.endswith((".yaml", ".yml")) else ""
            raise ConfigError("overrides", text, f"KEY=VALUE, e.g. trainer.total_steps=10{hint}")
    try:
        data = OmegaConf.to_container(OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides or []))), resolve=False)
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError("overrides", str(e).splitlines()[0], "KEY=VALUE overrides with valid YAML values") from None
    # Unknown keys and wrong types are reported as given, before the defaults are merged in.
    _build(RayflowConfig, _strip_interpolations(data), "")
    if isinstance(data.get("trainer"), dict) and data["trainer"].get("run_name") is None:
        data["trainer"].pop("run_name", None)
    data.setdefault("trainer", {}).setdefault("run_name", default_run_name(path))
    try:
        # Interpolations such as ${trainer.output_dir} resolve against the defaults too.
        full = OmegaConf.merge(OmegaConf.create(to_dict(RayflowConfig())), OmegaConf.create(data))
        resolved = OmegaConf.to_container(full, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(path or "overrides", str(e).splitlines()[0], "interpolations of existing keys") from None
    return from_dict(_expand_home(resolved))


PATH_KEYS = (("model", "path"), ("data", "prompts"), ("data", "eval_prompts"), ("trainer", "output_dir"), ("trainer", "resume"))
"""Keys that hold paths; a relative one in a recipe YAML is relative to the YAML's directory."""


def _path_slots(data: dict) -> list[tuple[dict, str]]:
    """(mapping, key) of every path in a config dict: PATH_KEYS and each reward function's `path` kwarg."""
    slots = [(data[section], key) for section, key in PATH_KEYS if isinstance(data.get(section), dict)]
    functions = data.get("reward", {}).get("functions") if isinstance(data.get("reward"), dict) else None
    return slots + [(fn["kwargs"], "path") for fn in (functions if isinstance(functions, list) else [])
                    if isinstance(fn, dict) and isinstance(fn.get("kwargs"), dict)]


def _expand_home(data: dict) -> dict:
    """`data` with a leading ~ of every path expanded (a run would otherwise write into a directory named "~")."""
    for section, key in _path_slots(data):
        if isinstance(section.get(key), str) and section[key].startswith("~"):
            section[key] = os.path.expanduser(section[key])
    return data


def _relative_to(data: dict, base_dir: str) -> dict:
    """`data` (a recipe YAML) with its relative paths made absolute against `base_dir`: PATH_KEYS, and the
    `path` kwarg of every reward function. Values that are not paths ("auto", interpolations) stay."""

    def fix(section: dict, key: str) -> None:
        value = section.get(key)
        if isinstance(value, str) and value and "${" not in value and value not in ("auto", "never") \
                and not os.path.isabs(os.path.expanduser(value)):
            section[key] = os.path.normpath(os.path.join(base_dir, value))

    for section, key in _path_slots(data):
        fix(section, key)
    return data


def default_run_name(config_path: str | None) -> str:
    """<recipe>-<YYYYmmdd>-<HHMMSS>: a new directory per run, so a run never resumes another by accident."""
    stem = os.path.splitext(os.path.basename(config_path))[0] if config_path else "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _strip_interpolations(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip_interpolations(v) for k, v in data.items() if not (isinstance(v, str) and "${" in v)}
    return data


def to_dict(cfg: Any) -> dict:
    """Plain data of a config, with YAML keys (async, not async_)."""
    if dataclasses.is_dataclass(cfg):
        return {yaml_key(f.name): to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, list):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def to_yaml(cfg: RayflowConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg)))
