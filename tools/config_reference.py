"""Print the configuration reference (every section, key, type, default and meaning) as Markdown.

    python tools/config_reference.py > /tmp/ref.md

The README's "Configuration reference" is this output; tests/test_docs.py keeps them equal.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import typing

from rayflow.config import RayflowConfig, yaml_key
from rayflow.paths import REPO_ROOT


def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its one-line doc), by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def _type_name(tp: typing.Any) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "").replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        value = {k: v for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, str) and value.startswith(REPO_ROOT + os.sep):
        value = "<repo>/" + os.path.relpath(value, REPO_ROOT)  # the same on every machine
    return "`null`" if value is None else f"`{value!r}`".replace("|", "\\|")


def reference() -> str:
    out = []
    hints_root = typing.get_type_hints(RayflowConfig)
    for section in dataclasses.fields(RayflowConfig):
        cls = hints_root[section.name]
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        out += [f"### `{yaml_key(section.name)}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            meaning = docs.get(f.name, "").replace("|", "\\|")
            out.append(f"| `{yaml_key(section.name)}.{f.name}` | {_type_name(hints[f.name])} | {_default(f)} | {meaning} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)  # no options: --help answers, and a stray argument is refused instead of ignored
    print(reference())


if __name__ == "__main__":
    main()
