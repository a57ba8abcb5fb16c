"""Prompt files, the group sampler's stream of prompts and seeds, and a group's rollout requests."""

import os
import re

import pytest

from rayflow.data.prompts import GroupSampler, PromptGroup, load_prompts
from rayflow.errors import ConfigError
from rayflow.types import SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["a red apple", "a blue car", "a green tree", "a yellow duck", "a white cat"]


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# -- load_prompts ---------------------------------------------------------------------------

def test_txt_skips_comments_and_blank_lines(tmp_path):
    path = write(tmp_path, "p.txt", "# colours\na red apple\n\n   \n  a blue car  \n# a comment\nc# is not a comment\n")
    assert load_prompts(path) == ["a red apple", "a blue car", "c# is not a comment"]


def test_jsonl(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a red apple", "tag": 1}\n\n{"prompt": " ünïcode "}\n')
    assert load_prompts(path) == ["a red apple", "ünïcode"]


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("p.txt", "", "{path}: no prompts"),
        ("p.txt", "# only\n\n# comments\n", "{path}: no prompts"),
        ("p.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n', "{path}:3: not valid JSON"),
        ("p.jsonl", '{"prompt": "a"}\n{"text": "b"}\n', '{path}:2: expected {{"prompt": "<non-empty text>"}}'),
        ("p.jsonl", '{"prompt": "a"}\n\n{"prompt": "   "}\n', '{path}:3: expected {{"prompt": "<non-empty text>"}}'),
        ("p.jsonl", '{"prompt": 7}\n', '{path}:1: expected'),
        ("p.jsonl", '["a red apple"]\n', '{path}:1: expected'),
        # old Mac line endings: without the check the whole file was one prompt
        ("p.txt", "a red apple\ra green leaf\ra blue sky\r", "{path}:1: a carriage return inside the line"),
    ],
    ids=["empty", "only-comments", "bad-json-line-3", "no-prompt-key", "empty-prompt", "prompt-not-text", "not-object",
         "cr-line-endings"],
)
def test_bad_files_name_the_file_and_line(tmp_path, name, text, message):
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError, match=re.escape(message.format(path=path))):
        load_prompts(path)


def test_wrong_extension_and_missing_file(tmp_path):
    csv = write(tmp_path, "p.csv", "a red apple\n")
    with pytest.raises(ConfigError, match=re.escape(f"data.prompts: got {csv!r}; allowed: a .txt")):
        load_prompts(csv)
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match=re.escape(f"data.prompts: got {missing!r}; allowed: an existing")):
        load_prompts(missing)


def test_a_missing_eval_prompt_file_is_named_as_data_eval_prompts_before_the_run(tmp_path):
    from rayflow.config import load_config
    from rayflow.runs import preflight

    missing = str(tmp_path / "held_out.txt")
    cfg = load_config(os.path.join(REPO, "recipes", "flowgrpo_tiny.yaml"), [f"data.eval_prompts={missing}"])
    with pytest.raises(ConfigError, match=re.escape(f"data.eval_prompts: got {missing!r}; allowed: an existing")):
        preflight(cfg)


def test_the_reward_check_of_a_prompt_file_reads_it_with_the_runs_max_prompt_chars(tmp_path, monkeypatch):
    """preflight's reward check (check_prompt_file) read the files at the default 4096 characters: a run with
    data.max_prompt_chars=10000 stopped on a 5000-character prompt, blaming data.max_prompt_chars=4096."""
    from rayflow import runs
    from rayflow.config import load_config
    from rayflow.rewards.validation import check_prompt_file

    long = write(tmp_path, "long.txt", "a red apple " + "x" * 5000 + "\n")
    cfg = load_config(os.path.join(REPO, "recipes", "flowgrpo_tiny.yaml"),
                      [f"data.prompts={long}", f"data.eval_prompts={long}", "data.max_prompt_chars=10000"])

    class PromptsChecked(Exception):
        pass

    def stop(cfg):
        raise PromptsChecked

    monkeypatch.setattr(runs, "build_tiny_model_once", stop)  # the prompt files passed: the model would be built next
    with pytest.raises(PromptsChecked):
        runs.preflight(cfg)
    with pytest.raises(ValueError, match="allowed: at most data.max_prompt_chars=100 "):
        check_prompt_file(["color"], long, max_chars=100)
    missing = str(tmp_path / "held_out.txt")  # named as the setting that named it, not always data.prompts
    with pytest.raises(ConfigError, match=re.escape(f"data.eval_prompts: got {missing!r}")):
        check_prompt_file(["color"], missing, key="data.eval_prompts")


def test_a_binary_file_names_file_and_line(tmp_path):
    path = str(tmp_path / "p.txt")
    with open(path, "wb") as f:
        f.write(b"a red apple\nPK\x03\x04\xff\xfe\n")  # a zip archive renamed .txt
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: not UTF-8 text (byte 0xff at column 5)")):
        load_prompts(path)
    with open(path, "wb") as f:
        f.write(b"a red apple\n\nab\x00cd\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: a NUL byte at column 3 (a binary file?)")):
        load_prompts(path)


def test_a_prompt_longer_than_the_limit_names_file_line_and_length(tmp_path):
    path = write(tmp_path, "p.jsonl", '{"prompt": "a red apple"}\n' + '{"prompt": "%s"}\n' % ("x" * 1_200_000))
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: a prompt of 1200000 characters; allowed: at most "
                                                   f"data.max_prompt_chars=4096")):
        load_prompts(path)
    assert load_prompts(path, max_chars=1_200_000)[1] == "x" * 1_200_000
    with pytest.raises(ValueError, match=":1: a prompt of 11 characters; allowed: at most data.max_prompt_chars=10"):
        load_prompts(path, max_chars=10)


# -- GroupSampler ---------------------------------------------------------------------------

def draw(sampler: GroupSampler, n: int) -> list[PromptGroup]:
    return [sampler.next_group() for _ in range(n)]


def test_sampler_is_deterministic_for_a_seed():
    assert draw(GroupSampler(PROMPTS, 4, seed=3), 12) == draw(GroupSampler(PROMPTS, 4, seed=3), 12)
    assert [g.prompt_id for g in draw(GroupSampler(PROMPTS, 4, seed=3), 10)] != \
           [g.prompt_id for g in draw(GroupSampler(PROMPTS, 4, seed=4), 10)]


def test_seeds_are_distinct_within_and_across_groups():
    groups = draw(GroupSampler(PROMPTS, 4, seed=3), 12)
    seeds = [s for g in groups for s in g.seeds]
    assert all(len(g.seeds) == 4 for g in groups)
    assert len(set(seeds)) == len(seeds) == 48
    other_run = {s for g in draw(GroupSampler(PROMPTS, 4, seed=4), 12) for s in g.seeds}
    assert not other_run & set(seeds)  # another run seed draws other noise
    assert [g.group_id for g in groups] == list(range(12))


def test_epochs_cover_every_prompt_once_shuffled_per_epoch():
    groups = draw(GroupSampler(PROMPTS, 2, seed=0), 3 * len(PROMPTS))
    epochs = [[g.prompt_id for g in groups[e * 5 : (e + 1) * 5]] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(5))
    assert len({tuple(order) for order in epochs}) > 1  # reshuffled, not one order repeated
    assert all(g.prompt == PROMPTS[g.prompt_id] for g in groups)
    unshuffled = draw(GroupSampler(PROMPTS, 2, seed=0, shuffle=False), 7)
    assert [g.prompt_id for g in unshuffled] == [0, 1, 2, 3, 4, 0, 1]


def test_state_dict_resumes_the_same_sequence():
    full = draw(GroupSampler(PROMPTS, 3, seed=9), 13)
    first = GroupSampler(PROMPTS, 3, seed=9)
    draw(first, 7)  # mid second epoch
    state = first.state_dict()
    resumed = GroupSampler(PROMPTS, 3, seed=9)
    resumed.load_state_dict(state)
    assert draw(resumed, 6) == full[7:]


def test_state_of_another_seed_is_refused():
    state = GroupSampler(PROMPTS, 3, seed=9).state_dict()
    with pytest.raises(ValueError, match="saved with trainer.seed=9, this run has 10"):
        GroupSampler(PROMPTS, 3, seed=10).load_state_dict(state)


# -- PromptGroup.requests ---------------------------------------------------------------------

def test_requests_split_a_group_into_micro_batches():
    group = PromptGroup(group_id=6, prompt_id=2, prompt="a green tree", seeds=(100, 101, 102, 103, 104))
    params = SamplingParams(num_steps=3)
    requests = group.requests(params, micro_batch_size=2)
    assert [r.seeds for r in requests] == [[100, 101], [102, 103], [104]]
    assert [r.request_id for r in requests] == ["g6-s0", "g6-s2", "g6-s4"]
    assert len({r.request_id for r in requests}) == 3
    for r in requests:
        n = len(r.seeds)
        assert r.prompts == ["a green tree"] * n and r.prompt_ids == [2] * n and r.group_ids == [6] * n
        assert r.params is params
        r.validate()


@pytest.mark.parametrize("ext, body", [(".txt", b"a red cube\nb\n"), (".jsonl", b'{"prompt": "a red cube"}\n{"prompt": "b"}\n')])
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, ext, body):
    """Windows editors start UTF-8 files with EF BB BF: a .txt's first prompt kept it (and reached the text encoder
    and the per-prompt advantages as another prompt), a .jsonl failed on line 1."""
    path = str(tmp_path / f"p{ext}")
    with open(path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + body)
    assert load_prompts(path) == ["a red cube", "b"]
