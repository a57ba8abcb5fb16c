"""Loading: a recipe YAML (with its `base`s) + CLI dotlist overrides -> plain data -> RayflowConfig, converted field by
field and validated; and back (to_dict, to_yaml). omegaconf reads the YAML and the overrides' values and resolves
interpolations that are more than a plain reference; the layers are merged as plain dicts (omegaconf building and
merging its node trees made a load 57-96 ms, 2-13 ms without; the test suite loads some 560 configs)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import re
import time
import types
import typing
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rayflow.config.root import READ_ONLY_WHEN, RayflowConfig, yaml_key
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
    if tp is Any:
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, _describe(tp))
        return {name: _convert_entry(tp, name, v, key) for name, v in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)  # .inf / .nan would pass every range check below and poison the run
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise ConfigError(key, value, _describe(tp))


def _convert_entry(tp: Any, name: Any, value: Any, key: str) -> Any:
    """One entry of a `dict[K, V]` key (a role's `resources`, a reward's kwargs), converted as V."""
    key_type, value_type = typing.get_args(tp)
    if not isinstance(name, key_type):
        raise ConfigError(key, {name: value}, f"{_describe(tp)} with {_describe(key_type)} keys")
    try:
        return _convert(value_type, value, f"{key}.{name}")
    except ConfigError as e:
        if value is None and isinstance(name, str) and ":" in name:  # {gpu_node:1} is the key 'gpu_node:1' in YAML
            raise ConfigError(e.key, value, f"{e.allowed} (write {{{name.replace(':', ': ', 1)}}}: YAML needs a space "
                                            f"after the colon)") from None
        raise


REMOVED_KEYS = {
    "sync.apply_at": "nothing, the key is gone: set async.partial_rollout instead (true = the old apply_at=step, new "
                     "weights reach a trajectory at its next denoising-step boundary; false = the old apply_at=request, "
                     "new weights between requests only)",
}
"""Keys a config no longer has, with what to write instead."""


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """typing.get_type_hints of a config dataclass, once: evaluating the string annotations is a load's slowest part
    after the merges."""
    return typing.get_type_hints(cls)


def _build(cls: type, data: dict, prefix: str) -> Any:
    hints = _field_types(cls)
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


def _read_recipe(path: str, key: str = "--config", including: tuple[str, ...] = (), paths_from: str | None = None
                 ) -> dict:
    """A recipe YAML with its relative paths resolved against its own directory (or `paths_from`), merged over its
    `base` (if any)."""
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
    try:
        _check_containers(RayflowConfig, data, "")
    except ConfigError as e:  # named with its file: with bases, which of them says so
        raise ConfigError(f"{path}: {e.key}", e.value, e.allowed) from None
    data = _relative_to(data, paths_from or here)
    if base is None:
        return data
    base_key = f"{path}: {BASE_KEY}"
    if not isinstance(base, str):
        raise ConfigError(base_key, base, "the path of another recipe YAML, relative to this one")
    base_path = os.path.normpath(os.path.join(here, base))
    if base_path in including + (os.path.abspath(path),):
        raise ConfigError(base_key, base, "a recipe that does not include itself through its bases")
    return _merge(_read_recipe(base_path, base_key, including + (os.path.abspath(path),)), data)


def _container_type(tp: Any) -> type | None:
    """dict or list when a key of type `tp` holds a mapping or a list (null aside); None for a scalar or Any."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    if len(args) != 1:
        return None
    (tp,) = args
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return dict
    return list if typing.get_origin(tp) is list else None


def _check_containers(cls: type, data: dict, prefix: str) -> None:
    """Refuse, in one layer (a recipe file or one override) before it is merged, a mapping key given as anything but
    a mapping, and a list key given as a mapping. Merged, a section given as null or a scalar would replace what the
    layers below it set, or be silently replaced by a later override's mapping; a mapping would silently replace a list
    whole where the user meant to set one of its items."""
    hints = _field_types(cls)
    fields = {yaml_key(f.name): f.name for f in dataclasses.fields(cls)}
    for name, value in data.items():
        if name not in fields or (isinstance(value, str) and "${" in value):
            continue  # an unknown key is named by _build; an interpolation by its resolution
        key, tp = f"{prefix}.{name}" if prefix else str(name), hints[fields[name]]
        container = _container_type(tp)
        if container is None or (value is None and type(None) in typing.get_args(tp)) or isinstance(value, container):
            if dataclasses.is_dataclass(tp) and isinstance(value, dict):
                _check_containers(tp, value, key)
            continue
        if container is list and isinstance(value, dict):
            raise ConfigError(key, value, f"{_describe(tp)}, given whole, e.g. {key}=[...] (a list is replaced whole: "
                                          f"its items cannot be set one by one, as {key}.0.KEY=VALUE)")
        empty = " (a key with nothing after it is null: give it keys or delete it)" if value is None else ""
        raise ConfigError(key, value, _describe(tp) + empty)


def _merge(below: dict, above: dict) -> dict:
    """`above` merged over `below` (a new dict; neither is changed), as omegaconf merges: mappings key by key, anything
    else (a list, a scalar, null) replaced whole. `_check_containers` has refused, layer by layer, a scalar or null
    for a section and a mapping for a list."""
    merged = dict(below)
    for key, value in above.items():
        held = merged.get(key)
        merged[key] = _merge(held, value) if isinstance(held, dict) and isinstance(value, dict) else value
    return merged


OVERRIDE = re.compile(r"[A-Za-z_][\w.\[\]-]*=")
"""How a KEY=VALUE override starts: a dotted key, then '='."""


def is_override(arg: str) -> bool:
    """Whether a command-line argument is a KEY=VALUE override: it starts with a dotted key and '=', and is not an
    existing file or directory (a run directory may have '=' in its name, e.g. runs/lr=1e-4)."""
    return bool(OVERRIDE.match(arg)) and not os.path.exists(arg)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the other arguments, the KEY=VALUE overrides) of a tool's command line, so that overrides may come anywhere:
    argparse gives one after `--staleness 0 1` to that option, and refuses one after an option once the
    positionals are taken."""
    flags = [is_override(a) for a in argv]
    return [a for a, o in zip(argv, flags) if not o], [a for a, o in zip(argv, flags) if o]


YAML11_NUMBER = re.compile(r"""[-+]?(
      0[0-9_]+                                     # a leading 0: octal, 010 is 8
    | 0[xXoObB][0-9a-fA-F_]*                       # 0x10 is 16, 0b11 is 3 (0o7 stays text)
    | [0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?      # base 60: 1:30 is 90
    | (?=[0-9._]*[0-9])[0-9._]*_[0-9._]*([eE][-+]?[0-9]+)?  # 1_000 is 1000
)""", re.X)
"""Plain scalars that the YAML 1.1 reader of overrides turns into another number than they read as (YAML 1.2 reads
them as text or in decimal): refused where a key holds numbers."""


def _key_type(key: str) -> Any:
    """The declared type of a dotted key (trainer.seed: int; rollout.resources.x: float), or None where the config
    does not say (an unknown key, a list's item)."""
    tp: Any = RayflowConfig
    for part in key.split("."):
        if typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
            continue
        if not dataclasses.is_dataclass(tp):
            return None
        fields = {yaml_key(f.name): f.name for f in dataclasses.fields(tp)}
        if part not in fields:
            return None
        tp = _field_types(tp)[fields[part]]
    return tp


def _is_text(tp: Any) -> bool:
    """Whether a key of type `tp` holds text only (str, or str or null)."""
    return tp is str or set(typing.get_args(tp)) - {type(None)} == {str}


def _parse_override(text: str) -> dict:
    """One KEY=VALUE override as a config layer (plain data): parsed once per text (a test suite gives the same few
    hundred overrides thousands of times), a copy each call."""
    return copy.deepcopy(_parsed_override(text))


@functools.lru_cache(maxsize=4096)
def _parsed_override(text: str) -> dict:
    """One KEY=VALUE override as a config layer. A text key keeps the text YAML would read as a number
    (trainer.run_name=12:30 is "12:30", not 750); a YAML 1.1 number form is refused elsewhere, where it would
    silently become another number (trainer.total_steps=010 is 8)."""
    if "=" not in text:  # omegaconf would read it as a key set to null, reported as an unknown key at best
        hint = " (a recipe YAML is given with --config)" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError("overrides", text, f"KEY=VALUE, e.g. trainer.total_steps=10{hint}")
    try:
        layer = OmegaConf.from_dotlist([text])
    except (OmegaConfBaseException, ValueError, yaml.YAMLError) as e:
        raise ConfigError("overrides", str(e).splitlines()[0], "KEY=VALUE overrides with valid YAML values") from None
    key, raw = text.split("=", 1)
    data = value = OmegaConf.to_container(layer, resolve=False)
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    tp = _key_type(key)
    if tp is not None and _is_text(tp):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            set_dotted(data, key, raw.strip())
    else:
        _refuse_yaml11_numbers(key, raw)
    try:
        _check_containers(RayflowConfig, data, "")
    except ConfigError as e:
        if key.startswith(f"{e.key}."):  # reward.functions.0.weight=2: named as typed
            raise ConfigError(key, value, e.allowed) from None
        raise
    return data


def set_dotted(data: dict, key: str, value: Any) -> None:
    """data[a][b]... = value for the dotted key a.b... of plain config data (a part that indexes a list is its
    position: reward.functions.0.kwargs.path)."""
    *parents, leaf = key.split(".")
    for part in parents:
        data = data[int(part)] if isinstance(data, list) else data[part]
    data[leaf] = value


def _refuse_yaml11_numbers(key: str, raw: str) -> None:
    """ConfigError naming `key` when a plain scalar of its override value is one of YAML11_NUMBER's forms."""
    try:
        scalars = [t.value for t in yaml.scan(raw) if isinstance(t, yaml.ScalarToken) and t.plain]
    except yaml.YAMLError:
        return  # from_dotlist read it; nothing to add
    for scalar in scalars:
        if YAML11_NUMBER.fullmatch(scalar):
            read = yaml.safe_load(scalar)
            raise ConfigError(key, raw, f"numbers in plain decimal ({scalar!r} is a YAML 1.1 form, a leading 0, a "
                                        f"0x/0o/0b prefix, ':' or '_', that an override reads as {read!r}): write the "
                                        f"number meant, e.g. 10 not 010, 90 not 1:30")


def load_config(path: str | None = None, overrides: list[str] | None = None, key: str = "--config",
                saved_run: bool = False, paths_from: str | None = None) -> RayflowConfig:
    """Read a recipe YAML (optional; its `base`s first), apply dotlist overrides, convert and validate. `key`: the
    flag that named the recipe (a missing file is reported under it). `saved_run`: `path` is a run's config.yaml,
    whose unread keys are put back to their defaults before the overrides (`unread_at_defaults`). `paths_from`: the
    directory the relative paths in `path` lead from (None: its own; a run's config.yaml keeps a command-line relative
    path as given, relative to where the run started: `rayflow.paths.run_start_dir`)."""
    data = _read_recipe(path, key, paths_from=paths_from) if path else {}
    if saved_run:
        data = unread_at_defaults(data)
    for layer in [_parse_override(text) for text in overrides or []]:  # every override checked before any merge
        data = _merge(data, layer)
    # Unknown keys and wrong types are reported as given, before the defaults are merged in.
    _build(RayflowConfig, _strip_interpolations(data), "")
    if isinstance(data.get("trainer"), dict) and data["trainer"].get("run_name") is None:
        data["trainer"].pop("run_name", None)
    data.setdefault("trainer", {}).setdefault("run_name", default_run_name(path))
    full = _merge(to_dict(RayflowConfig()), data)  # interpolations resolve against the defaults too
    try:
        full = _resolve_references(full)
    except _NotAReference:
        try:  # omegaconf's grammar: resolvers, relative keys, escapes; and its errors for a missing key or a cycle
            full = OmegaConf.to_container(OmegaConf.create(full), resolve=True)
        except OmegaConfBaseException as e:
            raise ConfigError(path or "overrides", str(e).splitlines()[0], "interpolations of existing keys") from None
    return from_dict(_expand_home(full))


REFERENCE = re.compile(r"\$\{([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\}")
"""An interpolation that names a key of the config: ${trainer.output_dir}."""


class _NotAReference(Exception):
    """A "${" that REFERENCE does not cover alone; omegaconf resolves it."""


def _resolve_references(data: dict) -> dict:
    """`data` with every interpolation resolved, where each is a REFERENCE to a scalar key (the defaults' logdir, a
    recipe's ${trainer.output_dir}/...), as omegaconf resolves them: a string that is one reference takes the key's
    value, with its type; references inside text join as text (only text values: omegaconf's str() of other types is
    left to it). Raises _NotAReference for anything else, a missing key or a cycle."""

    def lookup(key: str, seen: frozenset) -> Any:
        if key in seen:
            raise _NotAReference(key)
        node = data
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                raise _NotAReference(key)
            node = node[part]
        if isinstance(node, (dict, list)):
            raise _NotAReference(key)
        return resolved(node, seen | {key})

    def resolved(value: Any, seen: frozenset = frozenset()) -> Any:
        if isinstance(value, dict):
            return {k: resolved(v, seen) for k, v in value.items()}
        if isinstance(value, list):
            return [resolved(v, seen) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        if "\\" in value:
            raise _NotAReference(value)  # an escaped interpolation
        whole = REFERENCE.fullmatch(value)
        if whole:
            return lookup(whole.group(1), seen)
        pieces = REFERENCE.split(value)  # text, key, text, ..., text
        texts, keys = pieces[0::2], [lookup(key, seen) for key in pieces[1::2]]
        if any("${" in text for text in texts) or not all(isinstance(v, str) for v in keys):
            raise _NotAReference(value)
        return "".join(t + v for t, v in zip(texts, keys + [""]))

    return resolved(data)


PATH_KEYS = (("model", "path"), ("data", "prompts"), ("data", "eval_prompts"), ("trainer", "output_dir"),
             ("trainer", "logdir"), ("trainer", "resume"))
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


def unread_at_defaults(data: dict) -> dict:
    """`data` (a config as plain data with YAML keys: a run's saved config.yaml) with each key of READ_ONLY_WHEN that its
    own settings leave unread put back to its default, in place. A version that accepted such a value (nothing read
    it: no setting of that run) wrote it into the run's config.yaml; compared or validated as it stands, it refused to
    resume or evaluate the run (model.tiny_seed=3 with a model.path: dropped from the command line, the resume saw a
    changed model.* setting; kept, the config was refused)."""
    defaults = to_dict(RayflowConfig())

    def value(key: str) -> Any:
        section, name = key.split(".")
        held = data.get(section)
        return held[name] if isinstance(held, dict) and name in held else defaults[section][name]

    for keys, decider, reads, _ in READ_ONLY_WHEN:  # in order: a key reset by one row decides a later one as reset
        if reads(value(decider)):
            continue
        for key in keys:
            section, name = key.split(".")
            if isinstance(data.get(section), dict) and name in data[section]:
                data[section][name] = defaults[section][name]
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
