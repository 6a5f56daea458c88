"""What rewards and the rollout log read of a finished tool rollout: the turns as the model wrote them, the tool
replies as it read them, and per-rollout counts."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vlm_grpo.tools.base import ToolEnvironment

_PADS = ("<|image_pad|>", "<|video_pad|>", "<IMG_CONTEXT>")
_FRAME_START = re.compile(r"^\s*<\|im_start\|>\w+\n")
_FRAME_END = re.compile(r"<\|im_end\|>\s*<\|im_start\|>assistant\n?$")


def observation_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """A tool reply as the model read it, without the chat turn around it, one image marker per image."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    for pad in _PADS:
        text = re.sub(f"(?:{re.escape(pad)})+", pad, text)
    return _FRAME_END.sub("", _FRAME_START.sub("", text))


def rollout_messages(tokenizer: Any, ids: Sequence[int], mask: Sequence[int], turns: Sequence[Any]) -> list[dict]:
    """The completion handed to rewards: each model turn's text as the model wrote it (think, calls, answer:
    special tokens dropped as in a single-turn completion) and each tool reply as the model read it
    (:func:`observation_text`), in order. ``turns``: TRL's messages of the rollout, whose parsed
    ``tool_calls`` the model turns keep."""
    assistants = [m for m in turns if isinstance(m, dict) and m.get("role") == "assistant"]
    rounds: list[list[Any]] = []  # the tool names of each round of replies
    for previous, m in zip([None, *turns], turns, strict=False):
        if isinstance(m, dict) and m.get("role") == "tool":
            if not (isinstance(previous, dict) and previous.get("role") == "tool"):
                rounds.append([])
            rounds[-1].append(m.get("name"))
    messages: list[dict[str, Any]] = []
    start = 0
    for end in range(1, len(ids) + 1):
        if end < len(ids) and mask[end] == mask[start]:
            continue
        segment = list(ids[start:end])
        if mask[start]:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": tokenizer.decode(segment, skip_special_tokens=True),
            }
            if assistants:
                calls = assistants.pop(0).get("tool_calls")
                if calls:
                    message["tool_calls"] = calls
        else:
            message = {"role": "tool", "content": observation_text(tokenizer, segment)}
            if rounds:
                message["names"] = rounds.pop(0)
        messages.append(message)
        start = end
    return messages or [{"role": "assistant", "content": ""}]


def rollout_tool_stats(completions: Sequence[Any], environments: Sequence[Any] | None) -> dict[str, list[float]]:
    """Per-rollout counts for the log: assistant turns, tool calls, tool errors, images returned, timeouts."""
    turns = [float(sum(1 for m in c if isinstance(m, dict) and m.get("role") == "assistant")) for c in completions]
    stats = {"turns": turns}
    envs = [e for e in environments or [] if isinstance(e, ToolEnvironment)]
    if envs and len(envs) == len(completions):
        stats["calls_per_rollout"] = [float(e.calls) for e in envs]
        stats["errors_per_rollout"] = [float(e.errors) for e in envs]
        stats["images_returned"] = [float(len(e.images) - e.prompt_images) for e in envs]
        stats["sandbox_timeouts"] = [float(e.timeouts) for e in envs]
    return stats
