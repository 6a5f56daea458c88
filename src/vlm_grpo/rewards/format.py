"""Format rewards (``<think>…</think><answer>…</answer>`` layout) and the tag helpers other rewards share."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from vlm_grpo.rewards.base import RewardFunc, completion_text

_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


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


def make_format_reward(tags: Sequence[str], name: str) -> RewardFunc:
    """Build a format reward requiring ``<t1>…</t1> <t2>…</t2> …`` for ``tags`` in order.

    The reward of a completion is 1.0 iff its whole text (leading/trailing whitespace allowed) is exactly the
    given tags, each opened and closed once, in that order, separated only by whitespace, and no block contains
    an opening or closing tag of any of the given names (no nesting, no repeats); block contents may be empty.
    Otherwise 0.0. Tag names are matched case-sensitively. E.g.
    ``make_format_reward(("think", "answer", "explain"), "format_explain")``.
    """
    if isinstance(tags, str):
        raise TypeError(f"tags must be a sequence of tag names, not the string {tags!r}")
    tags = tuple(tags)
    if not tags:
        raise ValueError("make_format_reward needs at least one tag")
    for tag in tags:
        if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
            raise ValueError(f"Invalid tag name {tag!r}")
    if len(set(tags)) != len(tags):
        raise ValueError(f"Tags must be distinct, got {tags}")

    any_tag = "|".join(re.escape(t) for t in tags)
    # Tempered token: any character that does not start one of our tags, so blocks can't nest and matching
    # stays linear in the text length.
    body = rf"(?:(?!</?(?:{any_tag})>).)*"
    blocks = r"\s*".join(rf"<{re.escape(t)}>{body}</{re.escape(t)}>" for t in tags)
    pattern = re.compile(rf"\s*{blocks}\s*", re.DOTALL)
    layout = "".join(f"<{t}>...</{t}>" for t in tags)

    def reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return [1.0 if pattern.fullmatch(completion_text(c)) else 0.0 for c in completions]

    reward.__name__ = name
    reward.__qualname__ = name
    reward.__doc__ = (
        f"Format reward '{name}': 1.0 iff the completion is exactly {layout} (tags in this order, each once, "
        "closed, not nested, only whitespace between and around the blocks), else 0.0. Range {0.0, 1.0}."
    )
    reward.tags = tags  # type: ignore[attr-defined]
    return reward


format_reward = make_format_reward(("think", "answer"), "format")
format_reward.__doc__ = (
    "Format reward: 1.0 iff the whole completion (leading/trailing whitespace allowed) matches "
    r"``<think>...</think>\s*<answer>...</answer>``: both tags present, in this order, each closed, not nested and "
    "not repeated, nothing but whitespace outside them; else 0.0. Range {0.0, 1.0}."
)

__all__ = ["extract_answer", "extract_tag", "format_reward", "make_format_reward"]
