"""Comparing sets of named tensors by layout (names and shapes), with errors that name the modules.

Weight sync, checkpoint restore and rollout staging all refuse tensors that do not line up with
what they bind: a LoRA that binds zero modules, or one that silently lost a projection, is an error.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

Layout = dict[str, tuple[int, ...]]


def layout(tensors: Mapping[str, torch.Tensor]) -> Layout:
    return {name: tuple(t.shape) for name, t in tensors.items()}


def _modules(names: list[str]) -> list[str]:
    """Parameter names -> the modules they belong to ("...attn.to_out.0"), for short errors."""
    mods = sorted({n.split(".lora_")[0] if ".lora_" in n else n.rsplit(".", 1)[0] for n in names})
    return mods[:10] + ([f"... {len(mods)} modules in all"] if len(mods) > 10 else [])


def layout_mismatch(expected: Layout, got: Layout) -> str | None:
    """What differs between two layouts, in words, or None when they are equal."""
    if not got:
        return f"no tensors given (expected {len(expected)}: modules {_modules(list(expected))})"
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    shapes = sorted(f"{n}: given {got[n]}, expected {expected[n]}" for n in set(expected) & set(got) if got[n] != expected[n])
    if not (missing or extra or shapes):
        return None
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} tensors of modules {_modules(missing)}")
    if extra:
        parts.append(f"{len(extra)} unexpected tensors of modules {_modules(extra)}")
    if shapes:
        parts.append(f"{len(shapes)} shape mismatches {shapes[:5]}")
    return "; ".join(parts)


def check_layout(expected: Layout, got: Layout, what: str) -> None:
    """Raise ValueError naming `what` and the modules that differ."""
    problem = layout_mismatch(expected, got)
    if problem:
        raise ValueError(f"{what}: {problem}")
