"""What makes a checkpoint prove itself, as plain functions: durable writes (fsync of files and directories),
sha256 per file, finite tensors, and the schema of meta.json."""

from __future__ import annotations

import hashlib
import os

import torch


def seal_file(file: str) -> dict:
    """fsync `file`, give it normal permissions, and return its manifest entry (sha256 and size)."""
    os.chmod(file, 0o644)
    with open(file, "rb") as f:
        os.fsync(f.fileno())
    return {"sha256": sha256_file(file), "bytes": os.path.getsize(file)}


def fsync_dir(directory: str) -> None:
    """Make the directory's entries (a new file, a rename) durable, not only the files' contents."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def all_finite(tree) -> bool:
    """Every floating-point tensor and float in a nested dict/list/tuple is finite (integer tensors: RNG states)."""
    if isinstance(tree, torch.Tensor):
        return not tree.is_floating_point() or bool(torch.isfinite(tree).all())
    if isinstance(tree, dict):
        return all(all_finite(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return all(all_finite(v) for v in tree)
    return not isinstance(tree, float) or (tree == tree and abs(tree) != float("inf"))


def is_count(value) -> bool:
    """An int >= 0 (JSON's true/false are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _get(meta: dict, key: str):
    for part in key.split("."):
        meta = meta.get(part) if isinstance(meta, dict) else None
    return meta


def meta_problem(meta: dict) -> str | None:
    """The first field of meta.json that breaks its schema, as "key is value; allowed: ..."; None if it holds."""
    data, counters, adapters = meta.get("data"), meta.get("counters"), meta.get("adapters")
    checks = [
        ("step", lambda: is_count(meta.get("step")), "an integer >= 0"),
        ("version", lambda: is_count(meta.get("version")), "an integer >= 0"),
        ("identity", lambda: isinstance(meta.get("identity"), dict), "an object"),
        ("adapters", lambda: isinstance(adapters, list) and adapters and all(isinstance(a, str) and a for a in adapters),
         "a non-empty list of adapter names"),
        ("data", lambda: isinstance(data, dict), "an object"),
        ("data.groups_drawn", lambda: is_count(data.get("groups_drawn")), "an integer >= 0"),
        ("data.seed", lambda: isinstance(data.get("seed"), int) and not isinstance(data.get("seed"), bool), "an integer"),
        ("data.pending_groups", lambda: isinstance(data.get("pending_groups", []), list)
         and all(is_count(g) for g in data.get("pending_groups", [])),
         "a list of integers >= 0"),
        ("counters", lambda: isinstance(counters, dict) and all(is_count(v) for v in counters.values()),
         "an object of integers >= 0"),
    ]
    for key, check, allowed in checks:  # in order: each check may rely on the ones before it
        if not check():
            return f"{key} is {_get(meta, key)!r}; allowed: {allowed}"
    return None


def sha256_file(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
