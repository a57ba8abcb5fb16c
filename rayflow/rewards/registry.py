from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from rayflow.errors import ConfigError


@dataclass
class RewardOutput:
    """What a reward returns when it also reports figures about each image that are watched, not trained on."""

    scores: torch.Tensor
    """[B] float32: the reward."""
    metrics: dict[str, torch.Tensor]
    """name -> [B] float32, logged as reward/<name> (batch mean), e.g. shapes_accuracy."""


class RewardFn(Protocol):
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
                 ) -> torch.Tensor | RewardOutput:
        """images [B, H, W, 3] uint8, one prompt and one metadata dict (prompt_id, group_id, seed) per
        image -> rewards [B] float32 (or a RewardOutput with metrics beside them)."""


_REWARDS: dict[str, Callable[..., RewardFn]] = {}


RESERVED_NAMES = ("mean", "std", "reward_mean")
"""Logged by the trainer itself (reward/mean, reward/std, eval/reward_mean): no reward or reward metric may take them."""


def register_reward(name: str):
    """Decorator: register a reward factory (a class or function taking the reward's kwargs)."""
    if name in RESERVED_NAMES:
        raise ValueError(f"register_reward: got {name!r}; allowed: any name but {list(RESERVED_NAMES)} (the trainer "
                         f"logs its own scalars under them)")

    def wrap(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        _REWARDS[name] = factory
        return factory

    return wrap


def registered_rewards() -> list[str]:
    return sorted(_REWARDS)


def reward_factory(name: str) -> Callable[..., RewardFn]:
    if name not in _REWARDS:
        raise ConfigError("reward.functions[].name", name, f"one of {registered_rewards()}")
    return _REWARDS[name]


def make_reward(name: str, **kwargs: Any) -> RewardFn:
    reward_factory(name)
    try:
        return _REWARDS[name](**kwargs)
    except TypeError as e:
        raise ConfigError(f"reward.functions[{name}].kwargs", kwargs, f"the arguments of reward {name!r} ({e})") from None
