import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from rayflow.errors import ConfigError
from rayflow.rewards import make_reward, registered_rewards


def flat(rgb, size=16) -> torch.Tensor:
    return torch.tensor(rgb, dtype=torch.uint8).expand(1, size, size, 3).clone()  # [1, H, W, 3]


def noise(seed=0, size=64) -> torch.Tensor:
    return torch.randint(0, 256, (1, size, size, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_registry():
    assert {"color", "jpeg_compressibility"} <= set(registered_rewards())
    with pytest.raises(ConfigError) as info:
        make_reward("aesthetic")
    assert info.value.value == "aesthetic" and "'color'" in info.value.allowed
    with pytest.raises(ConfigError, match=r"reward.functions\[jpeg_compressibility\].kwargs: got \{'qual': 90\}"):
        make_reward("jpeg_compressibility", qual=90)
    with pytest.raises(ConfigError, match="reward 'color'"):
        make_reward("color", url="http://x")


def test_color_reward():
    reward = make_reward("color")
    red, gray = flat((255, 0, 0)), flat((128, 128, 128))
    images = torch.cat([red, red, gray, gray])
    scores = reward(images, ["a red apple", "a Blue car", "a white cat", "a red ball"])
    g = 128 / 255
    expected = [
        1.0,
        1 - math.sqrt(2) / math.sqrt(3),  # red vs blue: distance sqrt(1 + 0 + 1)
        g,  # gray vs white: distance sqrt(3)·(1 − g)
        1 - math.sqrt((1 - g) ** 2 + 2 * g**2) / math.sqrt(3),
    ]
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor(expected))


def test_color_reward_mean_over_pixels():
    image = flat((255, 0, 0))
    image[0, :, 8:] = 0  # half red, half black
    score = make_reward("color")(image, ["red"])
    torch.testing.assert_close(score, torch.tensor([1 - 0.5 / math.sqrt(3)]))


def test_color_reward_without_colour_names_the_prompt():
    with pytest.raises(ValueError, match=r"prompt 'a reddish fox' names no colour"):
        make_reward("color")(flat((0, 0, 0)), ["a reddish fox"])


@pytest.mark.parametrize("kwargs, quality", [({}, 95), ({"quality": 50}, 50)])
def test_jpeg_compressibility(kwargs, quality):
    reward = make_reward("jpeg_compressibility", **kwargs)
    images = torch.cat([flat((40, 90, 200), size=64), noise()])
    scores = reward(images, ["", ""])
    assert scores[0] > scores[1]
    expected = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(np.asarray(image)).save(buffer, format="JPEG", quality=quality)
        expected.append(-len(buffer.getvalue()) / 1000)
    torch.testing.assert_close(scores, torch.tensor(expected))
