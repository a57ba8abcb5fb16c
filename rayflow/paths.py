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


def run_start_dir(run_dir: str, trainer: dict) -> str:
    """The directory a run was started in, where the relative paths its config.yaml keeps (as given on its command
    line) lead from: `run_dir` less its relative <trainer.output_dir>/<trainer.run_name> (`trainer`: the saved config's
    section); else (an absolute output_dir, or a run directory moved) this process's working directory."""
    output_dir, run_name = trainer.get("output_dir"), trainer.get("run_name")
    here = os.path.abspath(run_dir)
    if isinstance(output_dir, str) and isinstance(run_name, str) and not os.path.isabs(output_dir):
        tail = os.path.normpath(os.path.join(output_dir, run_name))
        if here.endswith(os.sep + tail):
            return here[: -len(tail) - 1]
    return os.getcwd()
