"""Rewards: a registry of named reward functions over decoded images and their prompts.

A reward is built by `make_reward(name, **kwargs)` and called as
`reward(images, prompts, metadata) -> [B] float32`, with images [B, H, W, 3] uint8 (or a RewardOutput:
the [B] rewards and per-image metrics logged as reward/<name>).
"""

from rayflow.rewards.registry import RewardOutput, make_reward, register_reward, registered_rewards
from rayflow.rewards import builtin, clip, http, ocr, shapes, vlm_judge  # noqa: F401  (registers the built-in rewards)

__all__ = ["RewardOutput", "make_reward", "register_reward", "registered_rewards"]
