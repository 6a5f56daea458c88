"""Reward registry.

A reward follows TRL's reward-function interface: ``fn(completions, **columns) -> list[float | None]``
where ``columns`` are every dataset column of the batch (``solution``, ``image_path``,
``image_sizes``, ``coord_sizes``, ``accu_reward_method``, ``task_type``, ...). Register one with
``@register_reward("name")``; users can also name ``path/to/file.py:fn`` or ``package.module:fn``.
EasyR1-style batch rewards ``fn(reward_inputs: list[dict]) -> list[float | dict]`` work too (see
:mod:`vlm_grpo.rewards.base`): ``overall`` is the reward, other keys are logged as ``rewards/<name>/<key>``.
"""

from __future__ import annotations

from vlm_grpo.registry import Registry
from vlm_grpo.rewards.base import (
    RewardFunc,
    SafeReward,
    batch_reward,
    build_reward_funcs,
    completion_text,
    reward_kind,
)

REWARDS: Registry[RewardFunc] = Registry("reward", entry_point_group="vlm_grpo.rewards")


def register_reward(name: str):
    """Decorator: ``@register_reward("accuracy")``."""
    return REWARDS.register(name)


# Built-in rewards are lazy: importing vlm_grpo does not import math-verify until a run asks for it.
REWARDS.register("accuracy", "vlm_grpo.rewards.accuracy:accuracy_reward")
REWARDS.register("format", "vlm_grpo.rewards.format:format_reward")
REWARDS.register("iou", "vlm_grpo.rewards.grounding:iou_reward")

# reward library (issue 3)
REWARDS.register("vqa_graded", "vlm_grpo.rewards.accuracy:vqa_graded_reward")
REWARDS.register("format_explain", "vlm_grpo.rewards.format:format_explain_reward")
REWARDS.register("format_speaker", "vlm_grpo.rewards.format:format_speaker_reward")
REWARDS.register("format_rynnbrain", "vlm_grpo.rewards.format:format_rynnbrain_reward")
REWARDS.register("iou_threshold", "vlm_grpo.rewards.grounding:iou_threshold_reward")
REWARDS.register("od_ap", "vlm_grpo.rewards.detection:od_ap_reward")
REWARDS.register("od_ap50", "vlm_grpo.rewards.detection:od_ap50_reward")
REWARDS.register("od_length", "vlm_grpo.rewards.detection:od_length_reward")
REWARDS.register("weighted_sum", "vlm_grpo.rewards.detection:weighted_sum_reward")
REWARDS.register("rynn_trajectory", "vlm_grpo.rewards.rynnbrain:rynn_trajectory_reward")
REWARDS.register("rynn_affordance", "vlm_grpo.rewards.rynnbrain:rynn_affordance_reward")
REWARDS.register("rynn_area", "vlm_grpo.rewards.rynnbrain:rynn_area_reward")
REWARDS.register("rynn_counting", "vlm_grpo.rewards.rynnbrain:rynn_counting_reward")
REWARDS.register("rynn_segment", "vlm_grpo.rewards.rynnbrain:rynn_segment_reward")
REWARDS.register("rynn_general", "vlm_grpo.rewards.rynnbrain:rynn_general_reward")
REWARDS.register("rynnbrain", "vlm_grpo.rewards.rynnbrain:rynnbrain_reward")
REWARDS.register("explanation", "vlm_grpo.rewards.explanation:explanation_reward")
REWARDS.register("length", "vlm_grpo.rewards.shaping:length_reward")
REWARDS.register("one_sentence", "vlm_grpo.rewards.shaping:one_sentence_reward")
REWARDS.register("repetition", "vlm_grpo.rewards.shaping:repetition_reward")
REWARDS.register("overlong", "vlm_grpo.rewards.shaping:overlong_reward")
REWARDS.register("accuracy_format", "vlm_grpo.rewards.batch:accuracy_format_reward")

# served-model rewards (issue 5)
REWARDS.register("listener", "vlm_grpo.rewards.remote:listener_reward")
REWARDS.register("http", "vlm_grpo.rewards.remote:http_reward")
REWARDS.register("llm_judge", "vlm_grpo.rewards.judge:llm_judge_reward")

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
