"""Checks of reward kwargs and prompts that run before Ray starts.

A reward factory may define
    check_kwargs(kwargs: dict, key: str) -> None    raise ConfigError for a bad value
    check_prompt(prompt: str) -> None               raise ValueError for a prompt it cannot score
Unknown or missing kwargs are caught here for every reward from its factory's signature.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from rayflow.errors import ConfigError
from rayflow.rewards.registry import reward_factory


def check_reward_kwargs(name: str, kwargs: dict[str, Any], key: str) -> None:
    """Raise ConfigError naming `key` if reward `name` cannot be built with `kwargs`."""
    factory = reward_factory(name)
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(key, kwargs, f"the arguments of reward {name!r}: {_parameters(factory)} ({e})") from None
    check = getattr(factory, "check_kwargs", None)
    if check is not None:
        check(kwargs, key)


def check_number(value: Any, key: str, allowed: str, ok: Callable[[float], bool]) -> None:
    """ConfigError naming `key` unless `value` is a finite int or float (not a bool) for which `ok(value)` holds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ConfigError(key, value, allowed)


def check_jpeg_quality(value: Any, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ConfigError(key, value, "an integer JPEG quality in [1, 100]")


def _parameters(factory) -> str:
    return ", ".join(str(p) for p in inspect.signature(factory).parameters.values()) or "none"


def check_prompt_file(names: list[str], path: str, max_chars: int = 4096, key: str = "data.prompts") -> None:
    """Raise ValueError naming the file and line of the first prompt one of the rewards cannot score. The file is read
    as load_prompts reads it: `max_chars` is the run's data.max_prompt_chars, `key` the setting that named the file."""
    from rayflow.data.prompts import prompt_lines

    checks = [(n, c) for n in names if (c := getattr(reward_factory(n), "check_prompt", None)) is not None]
    if not checks:
        return
    for lineno, prompt in prompt_lines(path, max_chars, key):
        for name, check in checks:
            try:
                check(prompt)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
