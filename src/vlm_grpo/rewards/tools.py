"""Rewards for tool-using rollouts: ``tool_use``, ``deepeyes``, ``tool_format``.

A tool rollout's completion is a list of messages: assistant turns, with the ``tool`` messages that TRL's
tool loop appended between them. With registered tools the rewards also receive the rollout's
environment (``environments``), which counts calls that returned successfully.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from vlm_grpo.rewards.base import completion_text

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<IMG_CONTEXT>", "<img>", "</img>")


def _messages(completion: Any) -> list[dict[str, Any]]:
    if isinstance(completion, list):
        return [m for m in completion if isinstance(m, dict)]
    return [{"role": "assistant", "content": completion_text(completion)}]


def assistant_text(completion: Any) -> str:
    """The model's own text of a rollout (tool results left out), turns joined by newlines."""
    return "\n".join(completion_text([m]) for m in _messages(completion) if m.get("role") == "assistant")


def _is_error(message: dict[str, Any]) -> bool:
    content = message.get("content")
    # TRL answers a failed call with str({"error": ...}); our tools' errors arrive that way too.
    return isinstance(content, str) and content.startswith("{'error'")


def successful_calls(completion: Any, environment: Any = None) -> int:
    """Tool calls that returned a result rather than an error."""
    if environment is not None and hasattr(environment, "successes"):
        return int(environment.successes)
    return sum(1 for m in _messages(completion) if m.get("role") == "tool" and not _is_error(m))


def tool_use_reward(
    completions: Sequence[Any], environments: Sequence[Any] | None = None, bonus: float = 1.0, **kwargs: Any
) -> list[float]:
    """``bonus`` (1.0) when the rollout called a tool and at least one call returned successfully, else 0."""
    envs = list(environments) if environments is not None and len(environments) == len(completions) else None
    return [bonus if successful_calls(c, envs[i] if envs else None) > 0 else 0.0 for i, c in enumerate(completions)]


def _tags_balanced(text: str, tag: str) -> bool:
    opens, closes = text.count(f"<{tag}>"), text.count(f"</{tag}>")
    if opens != closes:
        return False
    depth = 0
    for match in re.finditer(rf"</?{tag}>", text):
        depth += -1 if match.group().startswith("</") else 1
        if depth not in (0, 1):
            return False
    return True


def deepeyes_format_ok(completion: Any) -> bool:
    """DeepEyes' format rule: think / answer tags balanced in every turn, exactly one answer, in the last turn,
    and no image markers written by the model itself (broken image blocks)."""
    turns = [completion_text([m]) for m in _messages(completion) if m.get("role") == "assistant"]
    if not turns:
        return False
    for text in turns:
        if not _tags_balanced(text, "think") or not _tags_balanced(text, "answer"):
            return False
        if any(marker in text for marker in _VISION_MARKERS):
            return False
    return sum(t.count("<answer>") for t in turns) == 1 and "<answer>" in turns[-1]


def deepeyes_reward(
    completions: Sequence[Any],
    environments: Sequence[Any] | None = None,
    accuracy: str = "accuracy",
    accuracy_kwargs: dict[str, Any] | None = None,
    accuracy_weight: float = 0.8,
    format_weight: float = 0.2,
    tool_weight: float = 0.4,
    **kwargs: Any,
) -> list[float | None]:
    """DeepEyes: 0.8 x accuracy + 0.2 x format + 0.4 x tool bonus.

    accuracy: the ``accuracy`` reward (or ``llm_judge``, or any registered reward) on the model's own text;
    format: 0, or -1 when think / answer tags are unbalanced, the answer is missing, repeated or not in the
    last turn, or the model wrote image markers itself; tool bonus: 1 when a tool call returned successfully
    and the answer is right (accuracy > 0.5), as in DeepEyes, so calling tools alone pays nothing.
    """
    from vlm_grpo.rewards import REWARDS

    scorer: Callable[..., list[float | None]] = REWARDS.get(accuracy)
    texts = [assistant_text(c) for c in completions]
    scores = scorer(texts, **kwargs, **(accuracy_kwargs or {}))
    envs = list(environments) if environments is not None and len(environments) == len(completions) else None
    out: list[float | None] = []
    for i, (completion, acc) in enumerate(zip(completions, scores, strict=True)):
        if acc is None:
            out.append(None)
            continue
        fmt = 0.0 if deepeyes_format_ok(completion) else -1.0
        used = successful_calls(completion, envs[i] if envs else None) > 0 and acc > 0.5
        out.append(accuracy_weight * acc + format_weight * fmt + tool_weight * float(used))
    return out


def tool_format_reward(completions: Sequence[Any], require_call: bool = False, **kwargs: Any) -> list[float]:
    """1 when every ``<tool_call>`` the model wrote was a closed block holding ``{"name": str, "arguments": {}}``
    JSON (TRL turns such blocks into calls; a malformed one is answered with an error message), else 0.
    With ``require_call``, a rollout without any tool call also scores 0."""
    out = []
    for completion in completions:
        calls = 0
        ok = True
        for message in _messages(completion):
            if message.get("role") != "assistant":
                continue
            calls += len(message.get("tool_calls") or [])
            text = completion_text([message])
            if text.count("<tool_call>") != text.count("</tool_call>"):
                ok = False
            for block in _TOOL_CALL.findall(text):
                calls += 1
                try:
                    call = json.loads(block)
                except ValueError:
                    ok = False
                    continue
                if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                    ok = False
                elif not isinstance(call.get("arguments", {}), dict):
                    ok = False
        out.append(1.0 if ok and (calls or not require_call) else 0.0)
    return out


tool_use_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]  # with the default bonus
deepeyes_reward.value_range = (-0.2, 1.4)  # type: ignore[attr-defined]  # with the default weights
tool_format_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
