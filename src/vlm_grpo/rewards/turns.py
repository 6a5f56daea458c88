"""What a reward reads of a tool rollout: the model's turns, its final answer, the tool observations.

With ``--tools`` a completion is a list of messages, in the order the model saw them: ``assistant`` messages
hold each turn's text as the model wrote it (``<think>``, the tool calls in the protocol's own syntax, the answer),
``tool`` messages the replies it read between turns, as they were shown to it (the protocol's wrapper, e.g.
``<tool_response>`` / ``<interpreter>``, with one image marker of the model family per returned image:
``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen, ``<img><IMG_CONTEXT></img>`` for InternVL).
:func:`vlm_grpo.rewards.completion_text` joins them all: the rollout as a whole.

Graders of the answer must not read tool output (code can print ``<answer>...</answer>``): they use
:func:`final_turn` / :func:`final_answer`. A single-turn completion (a string, or one assistant message) is its own
final turn, so the same reward scores both alike.
"""

from __future__ import annotations

import re
from typing import Any

from vlm_grpo.rewards.base import completion_text


def _messages(completion: Any) -> list[dict[str, Any]]:
    if isinstance(completion, list):
        return [m for m in completion if isinstance(m, dict)]
    return [{"role": "assistant", "content": completion_text(completion)}]


def model_turns(completion: Any) -> list[str]:
    """The text of each turn the model wrote, in order (tool observations left out)."""
    return [completion_text([m]) for m in _messages(completion) if m.get("role") == "assistant"]


def tool_observations(completion: Any) -> list[str]:
    """The text of each tool reply the model read, in order, with the family's image markers."""
    return [completion_text([m]) for m in _messages(completion) if m.get("role") in ("tool", "user")]


def final_turn(completion: Any) -> str:
    """The model's last turn: the one that gives the answer ("" when the model wrote nothing)."""
    turns = model_turns(completion)
    return turns[-1] if turns else ""


def final_answer(completion: Any) -> str:
    """The content of the last ``<answer>...</answer>`` of the model's last turn, stripped (that whole turn,
    stripped, when it has no complete answer tag); never text a tool printed."""
    return extract_answer(final_turn(completion))


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the LAST complete ``<tag>…</tag>`` in ``text`` (tag names match case-insensitively), else ``None``.

    "Last" means: the last closing tag, paired with the last opening tag before it, so with nested or repeated
    tags the innermost/last block wins. Linear time, whatever the text (no regex backtracking on huge input).
    """
    if not isinstance(text, str) or not text:
        return None
    name = re.escape(tag)
    close = None
    for close in re.finditer(rf"</{name}\s*>", text, re.IGNORECASE):  # noqa: B007 - keep the last one
        pass
    if close is None:
        return None
    opening = None
    for opening in re.finditer(rf"<{name}\s*>", text[: close.start()], re.IGNORECASE):  # noqa: B007
        pass
    if opening is None:
        return None
    return text[opening.end() : close.start()]


def extract_answer(text: str) -> str:
    """The answer a completion (or a solution) gives: the content of its last ``<answer>…</answer>``, stripped;
    the whole text, stripped, when it has no complete answer tag."""
    text = text if isinstance(text, str) else completion_text(text)
    content = extract_tag(text, "answer")
    return (text if content is None else content).strip()
