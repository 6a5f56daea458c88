"""Reward registry.

A reward follows TRL's reward-function interface: ``fn(completions, **columns) -> list[float | None]``
where ``columns`` are every dataset column of the batch (``solution``, ``image_path``,
``image_sizes``, ``coord_sizes``, ``accu_reward_method``, ``task_type``, ...). Register one with
``@register_reward("name")``; users can also name ``path/to/file.py:fn`` or ``package.module:fn``.
EasyR1-style batch rewards ``fn(reward_inputs: list[dict]) -> list[float | dict]`` work too (see
:mod:`vlm_grpo.rewards.base`): ``overall`` is the reward, other keys are logged as ``rewards/<name>/<key>``.
"""

from __future__ import annotations

from vlm_grpo.rewards.base import (
    RewardFunc,
    SafeReward,
    batch_reward,
    completion_text,
    reward_kind,
)
from vlm_grpo.rewards.catalog import REWARDS, build_reward_funcs, register_reward

# tool-using rollouts
REWARDS.register("tool_use", "vlm_grpo.rewards.tools:tool_use_reward")
REWARDS.register("deepeyes", "vlm_grpo.rewards.tools:deepeyes_reward")
REWARDS.register("tool_format", "vlm_grpo.rewards.tools:tool_format_reward")

__all__ = [
    "REWARDS",
    "RewardFunc",
    "SafeReward",
    "batch_reward",
    "build_reward_funcs",
    "completion_text",
    "register_reward",
    "reward_kind",
]
