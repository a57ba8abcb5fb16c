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
        make_reward("hpsv2")
    assert info.value.value == "hpsv2" and "'color'" in info.value.allowed
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


def test_color_reward_refuses_a_prompt_naming_two_colours(tmp_path):
    """One colour per image: "a red and blue ball" was scored against red alone, silently. Refused when scored and
    before the run (the prompt file's line); a colour named twice is one colour."""
    from rayflow.rewards.validation import check_prompt_file

    with pytest.raises(ValueError, match=r"prompt 'a red and Blue ball' names several colours \['blue', 'red'\]"):
        make_reward("color")(flat((255, 0, 0)), ["a red and Blue ball"])
    path = tmp_path / "prompts.txt"
    path.write_text("a red apple on a red plate\na black and white cat\n")
    with pytest.raises(ValueError, match=rf"{path}:2: color reward: prompt 'a black and white cat' names several"):
        check_prompt_file(["color"], str(path))
    assert make_reward("color")(flat((255, 0, 0)), ["a red apple on a red plate"]) == 1.0


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


# -- the weighted total (rayflow.rewards.weighted) ----------------------------------------------

def weighted_config(*functions):
    from rayflow.config import RewardFnConfig

    return [RewardFnConfig(name=name, weight=weight, kwargs=kwargs) for name, weight, kwargs in functions]


def test_weighted_reward_is_the_weighted_sum_with_each_component_kept():
    from rayflow.rewards.weighted import WeightedReward

    images = torch.cat([flat((250, 10, 10), size=32), noise(1, size=32), flat((0, 0, 255), size=32)])
    prompts = ["a red apple", "a green tree", "a blue car"]
    reward = WeightedReward(weighted_config(("color", 0.5, {}), ("jpeg_compressibility", 2.0, {"quality": 80})))
    total, parts = reward(images, prompts)
    color = make_reward("color")(images, prompts)
    jpeg = make_reward("jpeg_compressibility", quality=80)(images, prompts)
    assert set(parts) == {"color", "jpeg_compressibility"}
    torch.testing.assert_close(parts["color"], color)
    torch.testing.assert_close(parts["jpeg_compressibility"], jpeg)
    torch.testing.assert_close(total, 0.5 * color + 2.0 * jpeg)


def test_a_reward_used_twice_is_named_by_position():
    from rayflow.rewards.weighted import WeightedReward

    images = torch.cat([noise(2, size=32), flat((9, 9, 9), size=32)])
    reward = WeightedReward(weighted_config(("jpeg_compressibility", 1.0, {"quality": 95}), ("color", -1.0, {}),
                                            ("jpeg_compressibility", 0.25, {"quality": 30})))
    total, parts = reward(images, ["red", "black"])
    assert set(parts) == {"jpeg_compressibility#0", "color", "jpeg_compressibility#2"}
    fine = make_reward("jpeg_compressibility", quality=95)(images, ["", ""])
    coarse = make_reward("jpeg_compressibility", quality=30)(images, ["", ""])
    torch.testing.assert_close(parts["jpeg_compressibility#2"], coarse)
    torch.testing.assert_close(total, fine - parts["color"] + 0.25 * coarse)


def test_weighted_reward_refuses_a_component_of_the_wrong_shape():
    from rayflow.rewards import register_reward
    from rayflow.rewards.registry import _REWARDS
    from rayflow.rewards.weighted import WeightedReward

    register_reward("test_one_number")(lambda: (lambda images, prompts, metadata=None: torch.tensor([1.0])))
    try:
        reward = WeightedReward(weighted_config(("test_one_number", 1.0, {})))
        with pytest.raises(ValueError, match=r"reward 'test_one_number' returned shape \(1,\) for 2 images"):
            reward(flat((0, 0, 0)).expand(2, -1, -1, -1), ["a", "b"])
    finally:
        del _REWARDS["test_one_number"]
