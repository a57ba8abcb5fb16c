"""The README stays true: its opening commands, and its configuration reference equals the code's."""

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


def test_every_tensorboard_tag_is_documented():
    from rayflow.logging.monitor import SCALAR_TAGS

    text = readme()
    assert [tag for tag in SCALAR_TAGS if f"`{tag}`" not in text] == []
