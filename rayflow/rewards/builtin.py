"""Offline rewards to train against without any model download."""

from __future__ import annotations

import io
import re

import torch
from PIL import Image

from rayflow.rewards.registry import register_reward
from rayflow.rewards.validation import check_jpeg_quality

# RGB in [0, 1] of the colours a prompt may name.
PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0),
    "green": (0.0, 1.0, 0.0),
    "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0),
    "cyan": (0.0, 1.0, 1.0),
    "magenta": (1.0, 0.0, 1.0),
    "purple": (0.5, 0.0, 0.5),
    "orange": (1.0, 0.5, 0.0),
    "white": (1.0, 1.0, 1.0),
    "black": (0.0, 0.0, 0.0),
}
_COLOUR_WORD = re.compile(r"\b(" + "|".join(PALETTE) + r")\b", re.IGNORECASE)
_MAX_RGB_DISTANCE = 3**0.5


def named_colour(prompt: str) -> str:
    """The palette colour the prompt names; a clear error if it names none, or several: the reward scores the whole
    image against one colour, so "a red and blue ball" scored against red alone would punish the blue it asks for."""
    named = sorted({word.lower() for word in _COLOUR_WORD.findall(prompt)})
    if not named:
        raise ValueError(f"color reward: prompt {prompt!r} names no colour; known colours: {sorted(PALETTE)}")
    if len(named) > 1:
        raise ValueError(f"color reward: prompt {prompt!r} names several colours {named}; it scores an image against "
                         f"one colour: name one per prompt")
    return named[0]


@register_reward("color")
class ColorReward:
    """How close the image is to the colour its prompt names: 1 − mean over pixels of the RGB distance
    to that colour / sqrt(3), in [0, 1]. Dense on purpose: a thresholded "fraction of pixels of that
    colour" is 0 for every sample of a random model, which leaves GRPO no signal."""

    @staticmethod
    def check_prompt(prompt: str) -> None:
        """Raise before the run (preflight) for a prompt that names no colour or several, as scoring it would."""
        named_colour(prompt)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        rgb = images.float() / 255.0  # [B, H, W, 3]
        targets = torch.tensor([PALETTE[named_colour(p)] for p in prompts])  # [B, 3]
        distance = torch.linalg.vector_norm(rgb - targets[:, None, None, :], dim=-1)  # [B, H, W]
        return 1.0 - distance.mean(dim=(1, 2)) / _MAX_RGB_DISTANCE


@register_reward("jpeg_compressibility")
class JpegCompressibility:
    """Minus the JPEG size in kilobytes (DDPO's compressibility reward): simpler images score higher."""

    def __init__(self, quality: int = 95):
        self.check_kwargs({"quality": quality})
        self.quality = quality

    @staticmethod
    def check_kwargs(kwargs: dict, key: str = "reward.functions[jpeg_compressibility].kwargs") -> None:
        check_jpeg_quality(kwargs.get("quality", 95), f"{key}.quality")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        sizes = []
        for image in images:
            buffer = io.BytesIO()
            Image.fromarray(image.numpy()).save(buffer, format="JPEG", quality=self.quality)
            sizes.append(buffer.tell() / 1000.0)
        return -torch.tensor(sizes, dtype=torch.float32)
