"""The README stays true: its opening commands, its configuration reference equals the code's, its
flow_grpo / DiffusionNFT override blocks load, and every test and repository path it or docs/*.md cites exists."""

import argparse
import ast
import contextlib
import io
import glob
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Iterator

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def documents() -> dict[str, str]:
    """README.md and docs/*.md by their path relative to the repository."""
    paths = ["README.md", *sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))]
    texts = {}
    for path in paths:
        with open(os.path.join(REPO, path)) as f:
            texts[path] = f.read()
    return texts


def defined_tests(test_file: str) -> set[str]:
    """The test functions a tests/ file defines (read, not imported: nothing is collected or run)."""
    with open(os.path.join(REPO, "tests", test_file)) as f:
        tree = ast.parse(f.read())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")}


def selects_a_test(test_file: str, expression: str) -> bool:
    """Whether `pytest tests/TEST_FILE -k EXPRESSION` selects a test: pytest's own -k grammar, matched as pytest
    matches it (case-insensitive substrings of the test's name and of its module's and directory's), over the
    functions' names (a parametrization's id or a marker name alone is not seen here)."""
    from _pytest.mark.expression import Expression

    expr = Expression.compile(expression)
    return any(expr.evaluate(lambda sub, **_: any(sub.lower() in n.lower() for n in (name, test_file, "tests")))
               for name in defined_tests(test_file))


CITED_TEST = re.compile(r"(?:tests/)?(test_\w+\.py)::(\w+)")
CITED_SELECTION = re.compile(r'`(?:tests/)?(test_\w+\.py)\s+-k\s+("[^"`]+"|[^`\s]+)`')  # a span may wrap a line
CITED_TEST_FILE = re.compile(r"(?<![\w/])(?:tests/)?(test_\w+\.py)\b")
CITED_PATH = re.compile(r"(?<![\w./<-])((?:rayflow|tools|recipes|tests|docs|models|cluster)/[\w./*{},-]*[\w*}/])")


def citations(pattern: re.Pattern) -> Iterator[tuple[str, tuple[str, ...]]]:
    """Every match of pattern in the docs, as ("FILE:LINE", its groups)."""
    for doc, text in documents().items():
        for match in pattern.finditer(text):
            yield f"{doc}:{text.count(chr(10), 0, match.start()) + 1}", match.groups()


def expand_braces(path: str) -> list[str]:
    """recipes/flowgrpo_{sd3,flux}.yaml -> both files."""
    match = re.match(r"(.*?)\{([^{}]*)\}(.*)", path)
    if match is None:
        return [path]
    head, alternatives, tail = match.groups()
    return [expanded for alternative in alternatives.split(",") for expanded in expand_braces(head + alternative + tail)]


def test_every_cited_test_and_selection_exists():
    """A `test_x.py::test_name` or `test_x.py -k expr` the docs cite names a test that exists (a test renamed since
    left a dead citation: two of the Failures section's named tests that never existed under those names)."""
    def exists(test_file: str) -> bool:
        return os.path.isfile(os.path.join(REPO, "tests", test_file))

    dead = [f"{at}: tests/{test_file} does not exist" for at, (test_file,) in citations(CITED_TEST_FILE)
            if not exists(test_file)]
    dead += [f"{at}: {test_file}::{name} is not a test of tests/{test_file}" for at, (test_file, name)
             in citations(CITED_TEST) if exists(test_file) and name not in defined_tests(test_file)]
    dead += [f"{at}: {test_file} -k {expression} selects no test" for at, (test_file, expression)
             in citations(CITED_SELECTION) if exists(test_file) and not selects_a_test(test_file, expression.strip('"'))]
    assert dead == []


def test_every_cited_repository_path_exists():
    """A rayflow/, tools/, recipes/, tests/, docs/, models/ or cluster/ path the docs name (a glob or {a,b} as
    written) exists: a file moved or renamed since leaves a dead reference."""
    dead = [f"{at}: {p}" for at, (path,) in citations(CITED_PATH) for p in expand_braces(path)
            if not glob.glob(os.path.join(REPO, p.rstrip("/").rstrip(".")))]
    assert dead == []


FENCED = re.compile(r"```[^\n]*\n(.*?)```", re.S)
INDENTED = re.compile(r"(?:^    .*\n?)+", re.M)
COMMAND = re.compile(r"python (?:tools|recipes)/\w+\.py\b")
PLACEHOLDERS = {"N": "2", "F": "0", "p": "0.3", "S": "tiny"}
"""Placeholders the docs write where a typed option needs a value (--rounds N, --first-seed F, --caption-noise p,
--shape S)."""


def documented_commands() -> set[tuple[str, str]]:
    """Every `python tools/X.py ...` and `python recipes/X.py ...` the docs show: in code blocks (a trailing backslash
    continues a line; a comment ends it) and in inline spans (which may wrap a line), as (document, command)."""
    commands = set()
    for doc, text in documents().items():
        for block in [m.group(1) for m in FENCED.finditer(text)] + INDENTED.findall(text):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if match := COMMAND.search(line):
                    commands.add((doc, line[match.start():].split("#")[0].strip()))
        for span in re.findall(r"`([^`]+)`", FENCED.sub("", text)):
            if COMMAND.match(" ".join(span.split())):
                commands.add((doc, " ".join(span.split())))
    return commands


def typed_argv(command: str) -> list[str] | None:
    """The command as a user would type it: `[--optional]` included, the first of `a|b` alternatives, PLACEHOLDERS
    given a value; None for one that elides its arguments (`...`, `KEY=VALUE`)."""
    command = command.split(" && ")[0]
    if any(elided in command for elided in ("...", "…", "{0,", "KEY=VALUE", "key=value")):
        return None
    command = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(" | ")[0], command)
    return [PLACEHOLDERS.get(arg, arg.split("|")[0]) for arg in shlex.split(command)][1:]


class Parsed(BaseException):
    """Raised where a script's own parse_args returns: nothing after it runs."""


def argparse_error(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The script's own argparse error for argv (run from the repository root up to its parse_args), or None."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse_args(self, args, namespace)
        raise Parsed()

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", argv)
        patch.setattr(sys, "path", list(sys.path))
        patch.setattr(os, "environ", dict(os.environ))  # pretrain_shapes.py pins CPU kernels as __main__
        patch.chdir(REPO)
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                runpy.run_path(os.path.join(REPO, argv[0]), run_name="__main__")
        except Parsed:
            return None
        except SystemExit:
            return (stderr.getvalue().strip().splitlines() or ["exited"])[-1]
    return "returned without parsing its arguments"


def overridden_recipe(argv: list[str]) -> tuple[str, list[str]] | None:
    """The recipe YAML a command's KEY=VALUE overrides apply to, and those overrides; None when it takes none."""
    def option(flag: str, default: str | None) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else default

    overrides = [arg for arg in argv[1:] if "=" in arg and not arg.startswith("-")]
    script = argv[0]
    if script.startswith("recipes/"):
        return option("--config", script[:-len(".py")] + ".yaml"), overrides
    if script == "tools/evaluate.py" and argv[1].endswith(".yaml"):
        return argv[1], overrides
    if script in ("tools/plan.py", "tools/simulate.py") and overrides:
        return option("--config", None), overrides
    if script == "tools/bench.py" and argv[1] in ("pipeline", "costs", "simulator", "startup") and overrides:
        return option("--recipe", option("--config", "recipes/flowgrpo_tiny.yaml")), overrides
    return None


def test_every_documented_tool_and_recipe_command_parses_and_its_overrides_load(monkeypatch):
    """Each `python tools/X.py ...` / `python recipes/X.py ...` in the docs names a script that exists, passes only
    options its argparse takes, and its KEY=VALUE overrides are keys and values its recipe takes (an option or key
    renamed since leaves a command that fails as written); a command shown refused (`$ COMMAND` then `error: ...`) is
    refused with that message. Nothing runs past the script's parse_args."""
    from rayflow.config import load_config

    failing = []
    for doc, command in sorted(documented_commands()):
        argv = typed_argv(command)
        if argv is None:
            continue
        if not os.path.isfile(os.path.join(REPO, argv[0])):
            failing.append(f"{doc}: {command}: {argv[0]} does not exist")
            continue
        if (error := argparse_error(argv, monkeypatch)) is not None:
            failing.append(f"{doc}: {command}: {error}")
        if (recipe_overrides := overridden_recipe(argv)) is not None and recipe_overrides[0] is not None:
            try:
                load_config(os.path.join(REPO, recipe_overrides[0]), recipe_overrides[1])
            except Exception as e:  # noqa: BLE001 - named in the failure list
                if f"$ {command}\nerror: {e}\n" not in documents()[doc]:  # else the docs show this very refusal
                    failing.append(f"{doc}: {command}: {type(e).__name__}: {e}")
    assert failing == []


def test_the_command_check_names_an_unknown_option_and_override(monkeypatch):
    assert "unrecognized arguments: --bogus" in argparse_error(["tools/plan.py", "--bogus"], monkeypatch)
    assert argparse_error(["tools/bench.py", "pipeline", "--rounds", "2"], monkeypatch) is None
    assert overridden_recipe(["recipes/flowgrpo_qwen_image.py", "--config", "recipes/flowgrpo_tiny.yaml", "a.b=1"]) == (
        "recipes/flowgrpo_tiny.yaml", ["a.b=1"])
    assert typed_argv("python tools/evaluate.py RUN_DIR [--seeds 32] [--first-seed F] [--checkpoint PATH | --base]") == [
        "tools/evaluate.py", "RUN_DIR", "--seeds", "32", "--first-seed", "0", "--checkpoint", "PATH"]


def test_readme_opens_with_the_two_set_up_commands():
    block = readme().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert block[0].startswith("R=/path/to/rayflow")
    assert block[1].startswith('pip install -e "$R" && python "$R/recipes/flowgrpo_qwen_image.py"')
    assert block[2].startswith('pip install -e "$R[test]" && pytest -n 2 --dist loadfile "$R"')
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    # CI runs exactly the README's test command, from a directory outside the clone.
    assert 'pip install -e "$R[test]" && pytest -n 2 --dist loadfile "$R"' in ci and 'cd "$(mktemp -d)"' in ci


def test_configuration_reference_matches_the_code():
    generated = subprocess.run([sys.executable, "tools/config_reference.py"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
    assert generated in readme(), "README's configuration reference is stale: paste `python tools/config_reference.py`"


def test_configuration_reference_tool_answers_help_and_refuses_arguments():
    """--help prints the usage, not the reference (it printed the whole reference); an unknown argument is refused."""
    tool = [sys.executable, "tools/config_reference.py"]
    usage = subprocess.run([*tool, "--help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert usage.startswith("usage: config_reference.py") and "### `model`" not in usage
    refused = subprocess.run([*tool, "model"], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "unrecognized arguments: model" in refused.stderr and refused.stdout == ""


def test_every_tensorboard_tag_is_documented():
    from rayflow.logging.monitor import SCALAR_TAGS

    text = readme()
    assert [tag for tag in SCALAR_TAGS if f"`{tag}`" not in text] == []


def test_the_reference_projects_recipes_as_overrides_load():
    """The override blocks under "Coming from flow_grpo / DiffusionNFT" are valid keys and values on the recipes
    they are written for (a renamed or removed key would make them fail)."""
    from rayflow.config import load_config
    from rayflow.paths import recipe

    section = readme().split("### Coming from flow_grpo / DiffusionNFT", 1)[1].split("\n## ", 1)[0]
    blocks = [" ".join(line.strip().rstrip("\\") for line in chunk.splitlines() if line.startswith("    "))
              for chunk in section.split("\n\n") if chunk.startswith("    ")]
    assert len(blocks) == 2
    flow_grpo = load_config(recipe("flowgrpo_qwen_image.yaml"), blocks[0].split())
    assert (flow_grpo.sampling.num_steps, flow_grpo.trainer.eval_num_steps, flow_grpo.algorithm.group_size) == (10, 40, 24)
    nft = load_config(recipe("diffusion_nft_qwen_image.yaml"), blocks[1].split())
    assert (nft.sampling.solver, nft.trainer.eval_solver, nft.trainer.eval_num_steps) == ("dpm2", "euler", 40)
    assert (nft.trainer.ema_decay, nft.trainer.ema_every) == (0.9, 1)
    # What the blocks say they reproduce and the base recipes do not already hold: 48 prompts x 24 images an epoch
    # (both configs), flow_grpo's train script's hard-coded LoRA (r=32, alpha=64), and their config/base.py optimizer
    # (learning_rate 3e-4, adam_weight_decay 1e-4). Without them a copied block trained 2 or 4 prompts a step.
    for cfg in (flow_grpo, nft):
        assert cfg.algorithm.prompts_per_step * cfg.algorithm.group_size == 48 * 24
        assert (cfg.learner.lr, cfg.learner.weight_decay) == (3e-4, 1e-4)
    assert (flow_grpo.learner.lora_rank, flow_grpo.learner.lora_alpha) == (32, 64)  # the NFT recipe trains every weight
