"""Rewards: a registry of named reward functions over decoded images and their prompts.

A reward is built by `make_reward(name, **kwargs)` and called as
`reward(images, prompts, metadata) -> [B] float32`, with images [B, H, W, 3] uint8.
"""

from rayflow.rewards.registry import make_reward, register_reward, registered_rewards
from rayflow.rewards import builtin, clip, http, ocr, vlm_judge  # noqa: F401  (registers the built-in rewards)

__all__ = ["make_reward", "register_reward", "registered_rewards"]
