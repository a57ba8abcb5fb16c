"""The `http` reward: score images with the user's own reward server.

Protocol (one POST per reward call, JSON both ways):

    request  {"images": ["<base64 JPEG>", ...],
              "prompts": ["a red apple", ...],
              "metadata": [{"prompt_id": 0, "group_id": 3, "seed": 42}, ...]}
    response {"rewards": [0.71, ...]}                       one float per image

The server may also answer {"error": "..."} with a non-2xx status; that message is raised. Deadlines
and retries: rayflow/rewards/http_client.py.
"""

from __future__ import annotations

import base64
import io

import torch
from PIL import Image

from rayflow.rewards.http_client import JsonClient, check_client_kwargs
from rayflow.rewards.registry import register_reward
from rayflow.rewards.validation import check_jpeg_quality


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


@register_reward("http")
class HttpReward:
    def __init__(self, url: str, timeout_s: float = 60.0, jpeg_quality: int = 95, max_outage_s: float = 0.0):
        """timeout_s: deadline of one request; max_outage_s: retry budget (set from reward.max_outage_s)."""
        self.check_kwargs({"url": url, "timeout_s": timeout_s, "max_outage_s": max_outage_s, "jpeg_quality": jpeg_quality})
        self.client = JsonClient(url, timeout_s=timeout_s, max_outage_s=max_outage_s, name="http")
        self.url = url
        self.jpeg_quality = jpeg_quality

    @staticmethod
    def check_kwargs(kwargs: dict, key: str = "reward.functions[http].kwargs") -> None:
        check_client_kwargs(kwargs, key)
        check_jpeg_quality(kwargs.get("jpeg_quality", 95), f"{key}.jpeg_quality")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        reply = self.client.post({
            "images": [encode_jpeg(im, self.jpeg_quality) for im in images],
            "prompts": list(prompts),
            "metadata": metadata or [{} for _ in prompts],
        })
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        numbers = isinstance(rewards, list) and all(
            isinstance(r, (int, float)) and not isinstance(r, bool) for r in rewards
        )
        if not numbers or len(rewards) != len(prompts):
            raise RuntimeError(
                f"http reward {self.url}: expected {{\"rewards\": [{len(prompts)} numbers]}}, got {str(reply)[:200]}"
            )
        return as_float32(rewards, f"http reward {self.url}")


def as_float32(values: list, source: str) -> torch.Tensor:
    """Numbers from a server as float32; one out of float range (e.g. a huge integer) is a clear error."""
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except OverflowError:
            f = float("inf")
        if abs(f) > torch.finfo(torch.float32).max:
            raise RuntimeError(f"{source}: value {i} ({str(v)[:40]}) is outside float32 range")
        out.append(f)
    return torch.tensor(out, dtype=torch.float32)
