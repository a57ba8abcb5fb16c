"""The `vlm_judge` reward against a local server speaking OpenAI's /v1/chat/completions schema: what
rayflow sends is checked against a JSON schema of the request, the answers are parsed as the README
says, concurrency is bounded, and an answer without a score fails loudly."""

import base64
import io
import math
import threading
import time

import jsonschema
import numpy as np
import pytest
import torch
from PIL import Image

from rayflow.config import from_dict
from rayflow.errors import ConfigError
from rayflow.rewards import make_reward
from reward_server import RewardServer

# The part of the chat-completions request schema rayflow uses (OpenAI API reference, CreateChatCompletionRequest).
REQUEST_SCHEMA = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        "model": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "user", "assistant"]},
                "content": {"type": "array", "items": {"oneOf": [
                    {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
                    {"type": "object", "required": ["type", "image_url"], "additionalProperties": False,
                     "properties": {"type": {"const": "image_url"}, "image_url": {
                         "type": "object", "required": ["url"],
                         "properties": {"url": {"type": "string", "pattern": "^data:image/png;base64,"}}}}},
                ]}},
            }}},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    "additionalProperties": False,
}


def completion(content: str, top_logprobs: list[tuple[str, float]] | None = None) -> dict:
    """A chat.completion response as vLLM / SGLang return it."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    if top_logprobs is not None:
        choice["logprobs"] = {"content": [{"token": content, "logprob": top_logprobs[0][1], "top_logprobs": [
            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top_logprobs]}]}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "judge", "choices": [choice],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}


def red_fraction(body: dict) -> float:
    """The test judge: decodes the PNG it was sent and returns its mean red level in [0, 1]."""
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    image = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
    return float(image[..., 0].mean() / 255.0)


def images() -> torch.Tensor:
    out = torch.zeros(4, 16, 16, 3, dtype=torch.uint8)
    for i in range(4):
        out[i, ..., 0] = 60 * i  # red levels 0, 60, 120, 180
    return out


PROMPTS = ["a red square", "a dark square", "a red square", "a red thing"]


def judge_url(server) -> str:
    return server.url.replace("/score", "/v1/chat/completions")


def test_number_answers_are_scores_and_requests_match_the_schema():
    in_flight, peak, lock = [0], [0], threading.Lock()

    def respond(i, body):
        jsonschema.validate(body, REQUEST_SCHEMA)
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.1)
        with lock:
            in_flight[0] -= 1
        return 200, completion(f"Score: {10 * red_fraction(body):.2f} out of 10")

    with RewardServer(respond) as server:
        reward = make_reward("vlm_judge", url=judge_url(server), model="judge", max_concurrency=2)
        scores = reward(images(), PROMPTS)
    expected = torch.tensor([round(10 * 60 * i / 255, 2) / 10 for i in range(4)])
    torch.testing.assert_close(scores, expected)
    assert peak[0] == 2  # in parallel, never more than max_concurrency
    sent = {r["messages"][0]["content"][1]["text"] for r in server.requests}
    assert sent == {f'Rate from 0 to 10 how well this image matches the description "{p}" and how good it looks. '
                    "Answer with the number only." for p in PROMPTS}
    assert all(r["model"] == "judge" and r["temperature"] == 0.0 for r in server.requests)


def test_yes_no_from_logprobs_or_from_the_answer():
    def respond(i, body):
        jsonschema.validate(body, REQUEST_SCHEMA)
        assert body["logprobs"] is True and body["max_tokens"] == 1
        p = red_fraction(body)
        if "thing" in body["messages"][0]["content"][1]["text"]:  # a server without logprobs
            return 200, completion("No." if p < 0.5 else "Yes")
        lp = [("Yes", math.log(max(p, 1e-6))), (" no", math.log(max(1 - p, 1e-6))), ("Maybe", math.log(0.01))]
        return 200, completion("Yes", lp)

    with RewardServer(respond) as server:
        scores = make_reward("vlm_judge", url=judge_url(server), model="judge", score="yes_no",
                             template="Is this {prompt}?")(images(), PROMPTS)
    p = [60 * i / 255 for i in range(4)]
    expected = [max(x, 1e-6) / (max(x, 1e-6) + max(1 - x, 1e-6)) for x in p[:3]] + [1.0]
    torch.testing.assert_close(scores, torch.tensor(expected, dtype=torch.float32))


def test_unparseable_answer_fails_loudly():
    with RewardServer(lambda i, body: (200, completion("I cannot judge this image."))) as server:
        reward = make_reward("vlm_judge", url=judge_url(server), model="judge")
        with pytest.raises(RuntimeError, match=r"vlm_judge reward .*: no number score in the answer "
                                               r"'I cannot judge this image.' to prompt 'a red square'"):
            reward(images()[:1], PROMPTS[:1])
    with RewardServer(lambda i, body: (200, completion("Score: 15"))) as server:  # another scale: not 1.5 in silence
        with pytest.raises(RuntimeError, match=r"score 15 outside \[0, max_score=10\] in the answer 'Score: 15'"):
            make_reward("vlm_judge", url=judge_url(server), model="judge")(images()[:1], PROMPTS[:1])
    with RewardServer(lambda i, body: (200, {"object": "error"})) as server:
        with pytest.raises(RuntimeError, match="not a chat completion"):
            make_reward("vlm_judge", url=judge_url(server), model="judge")(images()[:1], PROMPTS[:1])


def test_vlm_judge_kwargs_checked_at_config_time():
    def cfg(**kwargs):
        return {"reward": {"functions": [{"name": "vlm_judge", "kwargs": {"url": "http://h:8000/v1/chat/completions",
                                                                             "model": "m", **kwargs}}]}}

    with pytest.raises(ConfigError, match=r"kwargs.template: got 'Rate it'; allowed: text containing \{prompt\}"):
        from_dict(cfg(template="Rate it"))
    with pytest.raises(ConfigError, match=r"kwargs.score: got 'stars'"):
        from_dict(cfg(score="stars"))
    with pytest.raises(ConfigError, match=r"kwargs.max_concurrency: got 0"):
        from_dict(cfg(max_concurrency=0))
    # Reward kwargs are free-form, so the loader's finite-number check does not see them: each reward checks its own.
    # These reached the first call (an OverflowError, a TypeError, every call failing) or scored a silent 0 (max_score).
    for key, value, allowed in [("timeout_s", float("inf"), "a finite number of seconds > 0"), ("timeout_s", "abc", "a finite"),
                                ("timeout_s", 0, "a finite number of seconds > 0"), ("max_outage_s", -5, "a finite number of seconds >= 0"),
                                ("max_score", float("inf"), "a finite number > 0")]:
        with pytest.raises(ConfigError, match=rf"kwargs\.{key}: got .*; allowed: {allowed}"):
            from_dict(cfg(**{key: value}))


def test_http_jpeg_and_shapes_kwargs_checked_at_config_time():
    def cfg(name, **kwargs):
        return {"reward": {"functions": [{"name": name, "kwargs": kwargs}]}}

    url = "http://h:8000/score"
    with pytest.raises(ConfigError, match=r"kwargs\.timeout_s: got inf; allowed: a finite number of seconds > 0"):
        from_dict(cfg("http", url=url, timeout_s=float("inf")))
    for bad in (500, "high"):
        with pytest.raises(ConfigError, match=r"kwargs\.jpeg_quality: got .*; allowed: an integer JPEG quality in \[1, 100\]"):
            from_dict(cfg("http", url=url, jpeg_quality=bad))
    with pytest.raises(ConfigError, match=r"kwargs\.quality: got 'x'; allowed: an integer JPEG quality"):
        from_dict(cfg("jpeg_compressibility", quality="x"))
    # It failed in the reward worker's constructor, which the pool took for a crash and restarted until it gave up.
    with pytest.raises(ConfigError, match=r"kwargs\.score: got 'strictt'; allowed: one of \['flow_grpo', 'strict'"):
        from_dict(cfg("shapes", score="strictt"))
