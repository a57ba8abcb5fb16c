"""The `http` reward against a local reward server (tests/reward_server.py) speaking its JSON protocol."""

import base64
import io
import re
import socket
import time

import numpy as np
import pytest
import torch
from PIL import Image

from rayflow.errors import ConfigError
from rayflow.rewards import make_reward
from reward_server import RewardServer


def images(n: int = 3, size: int = 16) -> torch.Tensor:
    out = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out[0, ..., 0] = 255  # one mostly red image, so the rewards differ clearly
    return out  # [B, H, W, 3]


def jpeg_bytes(image: torch.Tensor, quality: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.asarray(image)).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def test_rewards_are_the_servers_and_the_request_is_as_sent():
    batch = images()
    prompts = ["a red apple", "a blue car", "ünïcode prompt"]
    metadata = [{"prompt_id": 0, "group_id": 3, "seed": 42}, {"prompt_id": 1, "group_id": 3, "seed": 43},
                {"prompt_id": 7, "group_id": 4, "seed": 44}]
    with RewardServer() as server:
        scores = make_reward("http", url=server.url, jpeg_quality=80)(batch, prompts, metadata)
    assert len(server.requests) == 1  # one POST per reward call
    sent = server.requests[0]
    assert sent["prompts"] == prompts and sent["metadata"] == metadata
    # The expectation, from JPEG bytes encoded here with PIL at the requested quality.
    encoded = [jpeg_bytes(image, 80) for image in batch]
    assert [base64.b64decode(text) for text in sent["images"]] == encoded
    expected = [np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[..., 0].mean() / 255 for data in encoded]
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    torch.testing.assert_close(scores, torch.tensor(expected, dtype=torch.float32))
    assert scores[0] > 0.9 > scores[1]


def test_missing_metadata_is_sent_as_empty_records():
    with RewardServer() as server:
        make_reward("http", url=server.url)(images(2), ["a", "b"])
    assert server.requests[0]["metadata"] == [{}, {}]


def test_server_error_raises_its_message_with_the_url():
    with RewardServer(lambda i, body: (500, {"error": "reward model not loaded"})) as server:
        reward = make_reward("http", url=server.url)
        message = f"http reward {server.url}: HTTP 500: reward model not loaded"
        with pytest.raises(RuntimeError, match=re.escape(message)):
            reward(images(2), ["a", "b"])


@pytest.mark.parametrize(
    "payload, problem",
    [
        ({"rewards": [0.5]}, 'expected {"rewards": [2 numbers]}, got {\'rewards\': [0.5]}'),
        ({"rewards": [0.5, "high"]}, 'expected {"rewards": [2 numbers]}'),
        ({"scores": [0.5, 0.5]}, 'expected {"rewards": [2 numbers]}, got {\'scores\''),
        ([0.5, 0.5], 'expected {"rewards": [2 numbers]}, got [0.5, 0.5]'),
        (b"<html>Bad gateway</html>", "the response is not JSON"),
    ],
    ids=["wrong-length", "not-numbers", "no-rewards-key", "bare-list", "not-json"],
)
def test_malformed_reply_names_the_url_and_the_problem(payload, problem):
    with RewardServer(lambda i, body: (200, payload)) as server:
        reward = make_reward("http", url=server.url)
        with pytest.raises(RuntimeError, match=re.escape(f"http reward {server.url}: {problem}")):
            reward(images(2), ["a", "b"])


def test_unreachable_url():
    with socket.socket() as held:  # bound, never listening: refused, and no other process can take the port meanwhile
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}/score"
        with pytest.raises(RuntimeError, match=re.escape(f"http reward {url}: unreachable") + ".*Connection refused"):
            make_reward("http", url=url, timeout_s=5)(images(1), ["a"])


def test_a_server_slower_than_timeout_s_raises_in_time():
    def slow(i, body):
        server.stopping.wait(10)  # released when the test leaves the server
        return 200, {"rewards": [0.0]}

    with RewardServer(slow) as server:
        reward = make_reward("http", url=server.url, timeout_s=0.3)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=re.escape(f"http reward {server.url}: no reply within timeout_s=0.3s")):
            reward(images(1), ["a"])
        elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 3.0
    assert len(server.requests) == 1  # the request did arrive: slow, not unreachable


def test_url_without_scheme_is_refused_at_build_time():
    with pytest.raises(ConfigError, match=r"reward.functions\[http\].kwargs.url: got 'localhost:8000/score'"):
        make_reward("http", url="localhost:8000/score")
