"""The `vlm_judge` reward: a vision-language model scores each image through an OpenAI-compatible
/v1/chat/completions server (what `vllm serve` and `sglang.launch_server` expose for Qwen2.5-VL or
UnifiedReward).

One request per image: a user message with the image as a base64 PNG data URL and the template with
the prompt filled in. The score is read as
    number:  the first number in the answer / max_score (a number outside [0, max_score] is an error)
    yes_no:  P(yes) / (P(yes) + P(no)) from the first token's top_logprobs where the server returns
             them, else 1 for an answer starting "yes" and 0 for one starting "no"
An answer with no score raises with the answer and the prompt (never a silent zero). Deadline,
retries and backoff: rayflow/rewards/http_client.py (shared with the `http` reward).
"""

from __future__ import annotations

import base64
import io
import math
import re
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image

from rayflow.errors import ConfigError
from rayflow.rewards.http import as_float32
from rayflow.rewards.http_client import JsonClient, check_client_kwargs
from rayflow.rewards.registry import register_reward
from rayflow.rewards.validation import check_number

DEFAULT_TEMPLATES = {
    "number": 'Rate from 0 to 10 how well this image matches the description "{prompt}" and how good it '
              "looks. Answer with the number only.",
    "yes_no": 'Does this image show "{prompt}"? Answer yes or no.',
}
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def png_data_url(image: torch.Tensor) -> str:
    """[H, W, 3] uint8 -> data:image/png;base64,... (lossless, as judges see it)."""
    buffer = io.BytesIO()
    Image.fromarray(image.numpy()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def parse_number(answer: str) -> float | None:
    match = _NUMBER.search(answer)
    return float(match.group()) if match else None


def parse_yes_no(choice: dict) -> float | None:
    """P(yes) among yes/no from the first generated token's top_logprobs, else from the answer's first word."""
    content = (choice.get("logprobs") or {}).get("content") or []
    if content and content[0].get("top_logprobs"):
        p = {"yes": 0.0, "no": 0.0}
        for entry in content[0]["top_logprobs"]:
            word = str(entry.get("token", "")).strip().lower()
            if word in p:
                p[word] += math.exp(float(entry["logprob"]))
        if p["yes"] + p["no"] > 0:
            return p["yes"] / (p["yes"] + p["no"])
    words = str((choice.get("message") or {}).get("content") or "").strip().lower().split()
    first = words[0].strip(".,!:;\"'") if words else ""
    return {"yes": 1.0, "no": 0.0}.get(first)


@register_reward("vlm_judge")
class VlmJudge:
    def __init__(self, url: str, model: str, score: str = "number", template: str | None = None,
                 max_score: float = 10.0, max_tokens: int = 16, max_concurrency: int = 8,
                 timeout_s: float = 60.0, max_outage_s: float = 0.0):
        """url: the server's /v1/chat/completions; model: the served model name; score: "number" or "yes_no";
        template: the question, with {prompt}; max_concurrency: requests in flight per reward call."""
        self.check_kwargs(dict(url=url, model=model, score=score, template=template, max_score=max_score,
                               max_tokens=max_tokens, max_concurrency=max_concurrency, timeout_s=timeout_s,
                               max_outage_s=max_outage_s))
        self.client = JsonClient(url, timeout_s=timeout_s, max_outage_s=max_outage_s, name="vlm_judge")
        self.url, self.model, self.score, self.max_score = url, model, score, max_score
        self.template = template or DEFAULT_TEMPLATES[score]
        self.max_tokens = 1 if score == "yes_no" else max_tokens
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rayflow-vlm-judge")

    @staticmethod
    def check_kwargs(kwargs: dict, key: str = "reward.functions[vlm_judge].kwargs") -> None:
        check_client_kwargs(kwargs, key)
        if not isinstance(kwargs.get("model"), str) or not kwargs["model"]:
            raise ConfigError(f"{key}.model", kwargs.get("model"), "the served model's name (as in GET /v1/models)")
        if kwargs.get("score", "number") not in DEFAULT_TEMPLATES:
            raise ConfigError(f"{key}.score", kwargs.get("score"), f"one of {sorted(DEFAULT_TEMPLATES)}")
        template = kwargs.get("template")
        if template is not None and (not isinstance(template, str) or "{prompt}" not in template):
            raise ConfigError(f"{key}.template", template, "text containing {prompt}")
        for name in ("max_concurrency", "max_tokens"):
            value = kwargs.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{key}.{name}", value, "an integer >= 1")
        check_number(kwargs.get("max_score", 10.0), f"{key}.max_score", "a finite number > 0", lambda v: v > 0)

    def request(self, image: torch.Tensor, prompt: str) -> dict:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(image)}},
                {"type": "text", "text": self.template.replace("{prompt}", prompt)},
            ]}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
        }
        if self.score == "yes_no":
            body.update(logprobs=True, top_logprobs=5)
        return body

    def judge(self, image: torch.Tensor, prompt: str) -> float:
        reply = self.client.post(self.request(image, prompt))
        try:
            choice = reply["choices"][0]
            answer = str(choice["message"]["content"])
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"vlm_judge reward {self.url}: not a chat completion: {str(reply)[:300]}") from None
        value = parse_yes_no(choice) if self.score == "yes_no" else parse_number(answer)
        if value is None:
            raise RuntimeError(f"vlm_judge reward {self.url}: no {self.score} score in the answer {answer[:200]!r} "
                               f"to prompt {prompt!r}")
        if self.score == "yes_no":
            return value
        if not 0 <= value <= self.max_score:  # a judge that rated on another scale, or answered in a sentence
            raise RuntimeError(f"vlm_judge reward {self.url}: score {value:g} outside [0, max_score={self.max_score:g}] "
                               f"in the answer {answer[:200]!r} to prompt {prompt!r}")
        return value / self.max_score

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        scores = list(self.pool.map(self.judge, images, prompts))
        return as_float32(scores, f"vlm_judge reward {self.url}")
