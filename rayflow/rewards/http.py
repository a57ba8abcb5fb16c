"""The `http` reward: score images with the user's own reward server.

Protocol (one POST per reward call, JSON both ways):

    request  {"images": ["<base64 JPEG>", ...],
              "prompts": ["a red apple", ...],
              "metadata": [{"prompt_id": 0, "group_id": 3, "seed": 42}, ...]}
    response {"rewards": [0.71, ...]}                       one float per image

The server may also answer {"error": "..."} with a non-2xx status; that message is raised.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import urllib.error
import urllib.parse
import urllib.request

import torch
from PIL import Image

from rayflow.errors import ConfigError
from rayflow.rewards.registry import register_reward


def encode_jpeg(image: torch.Tensor, quality: int = 95) -> str:
    """[H, W, 3] uint8 -> base64 JPEG text."""
    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="JPEG", quality=quality)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_jpeg(text: str) -> torch.Tensor:
    """base64 JPEG text -> [H, W, 3] uint8 (for servers written in Python)."""
    import numpy as np

    image = Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")
    return torch.from_numpy(np.asarray(image).copy())


def _error_detail(body: bytes) -> str:
    """The server's {"error": "..."} message, or the start of its body when it sent something else."""
    text = body.decode(errors="replace")
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    return str(reply["error"])[:500] if isinstance(reply, dict) and "error" in reply else text[:500]


@register_reward("http")
class HttpReward:
    def __init__(self, url: str, timeout_s: float = 60.0, jpeg_quality: int = 95):
        if urllib.parse.urlparse(url).scheme not in ("http", "https"):
            raise ConfigError("reward.functions[http].kwargs.url", url, "an http:// or https:// URL")
        self.url = url
        self.timeout_s = timeout_s
        self.jpeg_quality = jpeg_quality

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        body = {
            "images": [encode_jpeg(im, self.jpeg_quality) for im in images],
            "prompts": list(prompts),
            "metadata": metadata or [{} for _ in prompts],
        }
        request = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"http reward {self.url}: HTTP {e.code}: {_error_detail(e.read())}") from None
        except (TimeoutError, urllib.error.URLError) as e:
            if isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError):
                raise RuntimeError(f"http reward {self.url}: no reply within timeout_s={self.timeout_s}s") from None
            raise RuntimeError(f"http reward {self.url}: unreachable ({e})") from None
        except (OSError, http.client.HTTPException) as e:  # e.g. the server closed the connection without a reply
            raise RuntimeError(f"http reward {self.url}: the connection failed ({e!r})") from None
        try:
            reply = json.loads(raw)
        except ValueError as e:  # json.JSONDecodeError, or bytes that are not text
            raise RuntimeError(f"http reward {self.url}: the response is not JSON ({e})") from None
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        numbers = isinstance(rewards, list) and all(
            isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards
        )
        if not numbers or len(rewards) != len(prompts):
            raise RuntimeError(
                f"http reward {self.url}: expected {{\"rewards\": [{len(prompts)} numbers]}}, got {str(reply)[:200]}"
            )
        return torch.tensor(rewards, dtype=torch.float32)
