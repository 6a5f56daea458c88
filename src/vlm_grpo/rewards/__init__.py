"""Reward registry.

A reward follows TRL's reward-function interface: ``fn(completions, **columns) -> list[float | None]``
where ``columns`` are every dataset column of the batch (``solution``, ``image_path``,
``image_sizes``, ``coord_sizes``, ``accu_reward_method``, ``task_type``, ...). Register one with
``@register_reward("name")``; users can also name ``path/to/file.py:fn`` or ``package.module:fn``.
"""

from __future__ import annotations

from vlm_grpo.registry import Registry
from vlm_grpo.rewards.base import RewardFunc, SafeReward, build_reward_funcs, completion_text

REWARDS: Registry[RewardFunc] = Registry("reward", entry_point_group="vlm_grpo.rewards")


def register_reward(name: str):
    """Decorator: ``@register_reward("accuracy")``."""
    return REWARDS.register(name)


# Built-in rewards are lazy: importing vlm_grpo does not import math-verify until a run asks for it.
REWARDS.register("accuracy", "vlm_grpo.rewards.accuracy:accuracy_reward")
REWARDS.register("format", "vlm_grpo.rewards.format:format_reward")
REWARDS.register("iou", "vlm_grpo.rewards.grounding:iou_reward")

__all__ = [
    "REWARDS",
    "RewardFunc",
    "SafeReward",
    "build_reward_funcs",
    "completion_text",
    "register_reward",
]
