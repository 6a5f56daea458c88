"""EasyR1-style batch rewards: one call scores the whole batch and returns ``{"overall": x, ...metrics}`` per sample.

The protocol (how samples are passed, how ``overall`` and the other keys are used) is described in
:mod:`vlm_grpo.rewards.base`; any user plugin ``fn(reward_inputs, **kw)`` works the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vlm_grpo.rewards.base import batch_reward
from vlm_grpo.rewards.format import tag_layout_score


@batch_reward
def accuracy_format_reward(
    reward_inputs: list[dict[str, Any]], format_weight: float = 0.1, tags: Sequence[str] = ("think", "answer")
) -> list[dict[str, float]]:
    """EasyR1's r1v-style reward as a batch reward: per sample ``{"overall": (1 − format_weight) · accuracy +
    format_weight · format, "accuracy": ..., "format": ...}``, ``accuracy`` being the ``accuracy`` reward of the
    sample (per-row ``accu_reward_method``) and ``format`` the tag-layout reward for ``tags``
    (``<think>…</think><answer>…</answer>`` by default). ``format_weight`` 0.1. Range [0.0, 1.0]; ``accuracy`` and
    ``format`` are logged as ``rewards/accuracy_format/accuracy`` and ``.../format``."""
    from vlm_grpo.rewards.accuracy import accuracy_reward

    weight = float(format_weight)
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {weight}")
    tags = tuple(tags)
    responses = [r.get("response", "") for r in reward_inputs]
    accuracy = accuracy_reward(
        responses,
        solution=[r.get("ground_truth") for r in reward_inputs],
        accu_reward_method=[r.get("accu_reward_method") for r in reward_inputs],
    )
    out = []
    for response, acc in zip(responses, accuracy, strict=True):
        fmt = tag_layout_score(response, tags)
        acc = float(acc or 0.0)
        out.append({"overall": (1.0 - weight) * acc + weight * fmt, "accuracy": acc, "format": fmt})
    return out


accuracy_format_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]

__all__ = ["accuracy_format_reward"]
