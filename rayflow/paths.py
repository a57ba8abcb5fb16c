"""Where the repository's own files are, independent of the working directory."""

from __future__ import annotations

import argparse
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout rayflow is imported from (recipes/, tools/ and cluster/ live beside the package)."""
RECIPES_DIR = os.path.join(REPO_ROOT, "recipes")


def recipe(name: str) -> str:
    """Absolute path of a recipe YAML or prompt file given relative to recipes/ ("flowgrpo_qwen_image.yaml")."""
    return os.path.join(RECIPES_DIR, name)


def check_output_dirs(parser: argparse.ArgumentParser, outputs: dict[str, str | None]) -> None:
    """A tool's output files (flag -> path, None: not asked for) whose directory does not exist, named before the
    work that would write them (parser.error)."""
    for flag, path in outputs.items():
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{flag}: {path!r} is in no existing directory")
