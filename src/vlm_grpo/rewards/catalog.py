"""The reward registry, its built-in entries (lazy ``module:fn`` specs: importing vlm_grpo stays cheap), and
``build_reward_funcs``, which turns ``--reward_funcs`` names into the callables TRL calls."""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vlm_grpo.registry import Registry, load_object
from vlm_grpo.rewards.base import RewardFunc, SafeReward

REWARDS: Registry[RewardFunc] = Registry("reward", entry_point_group="vlm_grpo.rewards")


def register_reward(name: str):
    """Decorator: ``@register_reward("accuracy")``."""
    return REWARDS.register(name)


REWARDS.register("accuracy", "vlm_grpo.rewards.accuracy:accuracy_reward")
REWARDS.register("format", "vlm_grpo.rewards.format:format_reward")
REWARDS.register("iou", "vlm_grpo.rewards.grounding:iou_reward")

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

# served-model rewards
REWARDS.register("listener", "vlm_grpo.rewards.listener:listener_reward")
REWARDS.register("http", "vlm_grpo.rewards.http_endpoint:http_reward")
REWARDS.register("llm_judge", "vlm_grpo.rewards.judge:llm_judge_reward")


def check_requirements(name: str, fn: Callable) -> None:
    """A reward that needs an optional package declares ``fn.requires = {"module": "extra"}``; say which extra to
    install before the run starts rather than failing on every sample."""
    for module, extra in getattr(fn, "requires", {}).items():
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"Reward '{name}' needs the '{module}' package: pip install 'vlm-grpo[{extra}]'")


def parse_reward_kwargs(value: str | Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``--reward_kwargs`` as JSON text (command line) or a mapping (YAML): reward name -> keyword arguments."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--reward_kwargs is not valid JSON ({exc.msg}): {value!r}") from None
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ValueError('--reward_kwargs must map reward names to keyword arguments, e.g. {"iou": {"threshold": 0.5}}')
    return {str(k): dict(v) for k, v in value.items()}


def build_reward_funcs(
    names: Sequence[str],
    overrides: Mapping[str, str | Callable] | None = None,
    reward_kwargs: str | Mapping[str, Any] | None = None,
) -> list[SafeReward]:
    """Resolve reward names (or ``file.py:fn`` / ``module:fn`` specs) into safe callables for TRL.

    ``overrides`` (a VLM module's own variants, name -> callable or ``module:attr``) win over the registry.
    ``reward_kwargs`` (name -> keyword arguments) are bound to the reward, e.g. ``{"vqa_graded": {"scale": 3}}``.
    """
    bound = parse_reward_kwargs(reward_kwargs)
    unknown = set(bound) - set(names)
    if unknown:
        raise ValueError(f"--reward_kwargs names reward(s) not in --reward_funcs: {', '.join(sorted(unknown))}")
    funcs = []
    for name in names:
        fn = (overrides or {}).get(name) or REWARDS.get(name)
        if isinstance(fn, str):
            fn = load_object(fn)
        if not callable(fn):
            raise TypeError(f"Reward '{name}' resolved to {fn!r}, which is not callable")
        check_requirements(name, fn)
        if name in bound:
            fn = functools.partial(fn, **bound[name])
        label = name.rpartition(":")[2] if ":" in name else name
        funcs.append(SafeReward(fn, label))
    return funcs
