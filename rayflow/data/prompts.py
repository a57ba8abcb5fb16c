"""Prompt datasets and the group sampler that assigns prompts and seeds to training steps."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from rayflow.errors import ConfigError
from rayflow.types import RolloutRequest, SamplingParams


def load_prompts(path: str, max_chars: int = 4096, key: str = "data.prompts") -> list[str]:
    """Prompts from a .txt (one per line; blank lines and # comments skipped) or a .jsonl file
    ({"prompt": "..."} per line), each at most `max_chars` characters (data.max_prompt_chars).
    Errors name the file and line; a file that is missing or of another kind, the setting `key` that named it."""
    return [text for _, text in prompt_lines(path, max_chars, key)]


def prompt_lines(path: str, max_chars: int = 4096, key: str = "data.prompts") -> list[tuple[int, str]]:
    """(line number, prompt) of each prompt in the file, as load_prompts reads them."""
    if not os.path.isfile(path):
        raise ConfigError(key, path, "an existing .txt or .jsonl file")
    ext = os.path.splitext(path)[1]
    if ext not in (".txt", ".jsonl"):
        raise ConfigError(key, path, "a .txt (one prompt per line) or .jsonl ({\"prompt\": ...} per line) file")
    prompts = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark (Windows editors), not text
                raw = raw[3:]
            text = _decode_line(raw, path, lineno).strip()
            if "\r" in text:  # lines are split at \n only: a file of \r-ended lines would read as one prompt
                raise ValueError(f"{path}:{lineno}: a carriage return inside the line (old Mac line endings?); "
                                 f"allowed: one prompt per line, each ending in \\n or \\r\\n")
            if not text or (ext == ".txt" and text.startswith("#")):
                continue
            if ext == ".jsonl":
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                    raise ValueError(f'{path}:{lineno}: expected {{"prompt": "<non-empty text>"}}, got {text[:80]!r}')
                text = record["prompt"].strip()
            if len(text) > max_chars:
                # A prompt far beyond the text encoder's context only slows every step that draws it.
                raise ValueError(f"{path}:{lineno}: a prompt of {len(text)} characters; allowed: at most "
                                 f"data.max_prompt_chars={max_chars} (starts {text[:60]!r})")
            prompts.append((lineno, text))
    if not prompts:
        raise ValueError(f"{path}: no prompts (the file is empty or only blank lines / comments)")
    return prompts


def _decode_line(raw: bytes, path: str, lineno: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                         f"a prompt file is text, one prompt per line") from None
    if "\x00" in text:
        raise ValueError(f"{path}:{lineno}: a NUL byte at column {text.index(chr(0)) + 1} (a binary file?); "
                         f"a prompt file is text, one prompt per line")
    return text


@dataclass(frozen=True)
class PromptGroup:
    """One prompt and the G seeds of its samples."""

    group_id: int
    prompt_id: int
    prompt: str
    seeds: tuple[int, ...]

    def requests(self, params: SamplingParams, micro_batch_size: int, min_version: int | None = None) -> list[RolloutRequest]:
        """The group as rollout requests of at most micro_batch_size samples each (RolloutRequest.min_version)."""
        out = []
        for start in range(0, len(self.seeds), micro_batch_size):
            seeds = list(self.seeds[start : start + micro_batch_size])
            out.append(
                RolloutRequest(
                    request_id=f"g{self.group_id}-s{start}",
                    prompts=[self.prompt] * len(seeds),
                    prompt_ids=[self.prompt_id] * len(seeds),
                    group_ids=[self.group_id] * len(seeds),
                    seeds=seeds,
                    params=params,
                    min_version=min_version,
                    noise_seeds=[self.seeds[0]] * len(seeds) if params.same_initial_noise else None,
                )
            )
        return out


class GroupSampler:
    """Deterministic stream of prompt groups: epochs over the prompts (shuffled per epoch with the
    run seed), each group with G fresh seeds. Its position is two integers, so a resumed run
    continues with exactly the groups it would have drawn.

    Seeds are base_seed · 1_000_003 + a running sample counter: distinct within a group (identical
    group members would make the advantages vanish) and across the run.
    """

    def __init__(self, prompts: list[str], group_size: int, seed: int, shuffle: bool = True):
        self.prompts = prompts
        self.group_size = group_size
        self.seed = seed
        self.shuffle = shuffle
        self.groups_drawn = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def group(self, n: int) -> PromptGroup:
        """Group n of the stream: a pure function of n (a resumed run redraws groups it had in flight)."""
        epoch, position = divmod(n, len(self.prompts))
        prompt_id = self._order(epoch)[position]
        first = self.seed * 1_000_003 + n * self.group_size
        return PromptGroup(
            group_id=n,
            prompt_id=prompt_id,
            prompt=self.prompts[prompt_id],
            seeds=tuple(range(first, first + self.group_size)),
        )

    def next_group(self) -> PromptGroup:
        self.groups_drawn += 1
        return self.group(self.groups_drawn - 1)

    def state_dict(self) -> dict:
        return {"groups_drawn": self.groups_drawn, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"data position was saved with trainer.seed={state['seed']}, this run has {self.seed}")
        self.groups_drawn = state["groups_drawn"]
