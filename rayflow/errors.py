"""Errors that name what was wrong, the value given, and what is allowed."""

from __future__ import annotations

from typing import Any


def one_line(error: BaseException) -> str:
    """`error` as type and first line."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


class ConfigError(ValueError):
    """A config key, request field or file holds a value that is not allowed."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}: got {value!r}; allowed: {allowed}")

    def __reduce__(self):
        # Pickled with its own arguments (not the message alone), so it crosses Ray process boundaries.
        return type(self), (self.key, self.value, self.allowed)
