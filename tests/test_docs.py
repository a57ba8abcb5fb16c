"""The README stays true: its opening commands, its configuration reference equals the code's, and its
flow_grpo / DiffusionNFT override blocks load."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


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
