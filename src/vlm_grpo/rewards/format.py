"""Format rewards (the tag helpers other rewards share, ``extract_tag`` / ``extract_answer``, live in
:mod:`vlm_grpo.rewards.turns` and are importable from here too).

Tag-layout rewards (``format``: ``<think><answer>``, ``format_explain``: ``<think><answer><explain>`` (ViVQA-X),
``format_speaker_strict``: ``<thinking><coarse><detailed>`` (Lewis-game speaker; the seed's lenient
``format_speaker`` is in :mod:`vlm_grpo.rewards.listener`), any list through ``make_format_reward``
or the ``tags`` keyword) and the RynnBrain ``#### <answer><task>…</task></answer>`` layout (``format_rynnbrain``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

from vlm_grpo.rewards.base import RewardFunc, completion_text
from vlm_grpo.rewards.turns import extract_answer, extract_tag, final_turn
from vlm_grpo.tasks import RYNNBRAIN_TASK_TAGS

_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def _check_tags(tags: Sequence[str]) -> tuple[str, ...]:
    if isinstance(tags, str):
        raise TypeError(f"tags must be a sequence of tag names, not the string {tags!r}")
    tags = tuple(tags)
    if not tags:
        raise ValueError("a format reward needs at least one tag")
    for tag in tags:
        if not isinstance(tag, str) or not _TAG_NAME.fullmatch(tag):
            raise ValueError(f"Invalid tag name {tag!r}")
    if len(set(tags)) != len(tags):
        raise ValueError(f"Tags must be distinct, got {tags}")
    return tags


@functools.lru_cache(maxsize=64)
def _layout_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    any_tag = "|".join(re.escape(t) for t in tags)
    # Tempered token: any character that does not start one of our tags, so blocks can't nest and matching
    # stays linear in the text length.
    body = rf"(?:(?!</?(?:{any_tag})>).)*"
    blocks = r"\s*".join(rf"<{re.escape(t)}>{body}</{re.escape(t)}>" for t in tags)
    return re.compile(rf"\s*{blocks}\s*", re.DOTALL)


def tag_layout_score(text: str, tags: Sequence[str]) -> float:
    """1.0 iff ``text`` is exactly the blocks ``<t1>…</t1> <t2>…</t2> …`` (see :func:`make_format_reward`)."""
    return 1.0 if _layout_pattern(_check_tags(tags)).fullmatch(text) else 0.0


def make_format_reward(tags: Sequence[str], name: str) -> RewardFunc:
    """Build a format reward requiring ``<t1>…</t1> <t2>…</t2> …`` for ``tags`` in order.

    The reward of a completion is 1.0 iff its whole text (leading/trailing whitespace allowed) is exactly the
    given tags, each opened and closed once, in that order, separated only by whitespace, and no block contains
    an opening or closing tag of any of the given names (no nesting, no repeats); block contents may be empty.
    Of a tool rollout the model's final turn is scored (:func:`vlm_grpo.rewards.turns.final_turn`), so that it
    scores as the single-turn text of the same answer.
    Otherwise 0.0. Tag names are matched case-sensitively. E.g.
    ``make_format_reward(("think", "answer", "explain"), "format_explain")``. The reward also takes a ``tags``
    keyword (``--reward_kwargs '{"format": {"tags": ["think", "answer", "explain"]}}'``) replacing its tag list.
    """
    tags = _check_tags(tags)
    _layout_pattern(tags)
    layout = "".join(f"<{t}>...</{t}>" for t in tags)

    def reward(completions: Sequence[Any], tags: Sequence[str] | None = None, **kwargs: Any) -> list[float | None]:
        pattern = _layout_pattern(_check_tags(tags) if tags is not None else reward.tags)  # type: ignore[attr-defined]
        return [1.0 if pattern.fullmatch(final_turn(c)) else 0.0 for c in completions]

    reward.__name__ = name
    reward.__qualname__ = name
    reward.__doc__ = (
        f"Format reward '{name}': 1.0 iff the completion is exactly {layout} (tags in this order, each once, "
        "closed, not nested, only whitespace between and around the blocks), else 0.0. Range {0.0, 1.0}. "
        "The ``tags`` keyword (from --reward_kwargs) replaces the tag list."
    )
    reward.tags = tags  # type: ignore[attr-defined]
    reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
    return reward


format_reward = make_format_reward(("think", "answer"), "format")
format_reward.__doc__ = (
    "Format reward: 1.0 iff the whole completion (leading/trailing whitespace allowed) matches "
    r"``<think>...</think>\s*<answer>...</answer>``: both tags present, in this order, each closed, not nested and "
    "not repeated, nothing but whitespace outside them; else 0.0. Range {0.0, 1.0}."
)

format_explain_reward = make_format_reward(("think", "answer", "explain"), "format_explain")
format_explain_reward.__doc__ = (
    "ViVQA-X format reward: 1.0 iff the whole completion is ``<think>...</think> <answer>...</answer> "
    "<explain>...</explain>`` (all three present, in this order, each closed once, not nested, only whitespace "
    "outside them); else 0.0. Range {0.0, 1.0}."
)

format_speaker_strict_reward = make_format_reward(("thinking", "coarse", "detailed"), "format_speaker_strict")
format_speaker_strict_reward.__doc__ = (
    "Strict Lewis-game speaker format reward (``format_speaker`` is the seed's lenient one): 1.0 iff the whole "
    "completion is ``<thinking>...</thinking> "
    "<coarse>...</coarse> <detailed>...</detailed>`` (all three present, in this order, each closed once, not "
    "nested, only whitespace outside them); else 0.0. Range {0.0, 1.0}."
)

# ------------------------------------------------------------------------------------------- RynnBrain

_NUM = r"[-+]?(?:\d{1,12}(?:\.\d{0,12})?|\.\d{1,12})"
_POINT = rf"[(\[]\s*{_NUM}\s*,\s*{_NUM}\s*[)\]]"
_SEP = r"(?:\s*,\s*|\s+)"
_FRAME_POINTS = rf"\s*<frame\s*\d{{1,6}}\s*>\s*{_POINT}(?:{_SEP}{_POINT})*\s*"
# What the inner tag of each task must contain for the layout to count as well-formed.
_TASK_CONTENT = {
    "trajectory": _FRAME_POINTS,
    "affordance": _FRAME_POINTS,
    "area": _FRAME_POINTS,
    "segment": rf"\s*<frame\s*\d{{1,6}}\s*>\s*{_POINT}{_SEP}{_POINT}\s*",
    "counting": r"\s*\d{1,12}\s*",
}
_RYNN_PATTERNS = {
    task: re.compile(rf"(?:(?!####).)*####\s*<answer>\s*<{tag}>{_TASK_CONTENT[task]}</{tag}>\s*</answer>\s*", re.DOTALL)
    for task, tag in RYNNBRAIN_TASK_TAGS.items()
}
# general: one "####", then a non-empty final answer (free text, or one closed <answer>…</answer>).
_ANSWER_TAG = re.compile(r"</?answer>")


def _general_layout(text: str) -> bool:
    """One ``####``, then a non-empty free-text answer or exactly one closed, non-empty ``<answer>…</answer>``."""
    parts = text.split("####")
    if len(parts) != 2:
        return False
    tail = parts[1].strip()
    if tail.startswith("<answer>") and tail.endswith("</answer>"):
        inner = tail[len("<answer>") : -len("</answer>")]
        return bool(inner.strip()) and _ANSWER_TAG.search(inner) is None
    return bool(tail) and _ANSWER_TAG.search(tail) is None


RYNNBRAIN_MAX_CHARS = 100_000


def rynnbrain_format_score(text: str, task_type: str | None) -> float:
    """1.0 iff ``text`` has the RynnBrain layout of ``task_type`` (see :func:`format_rynnbrain_reward`), else 0.0."""
    if len(text) > RYNNBRAIN_MAX_CHARS:
        return 0.0
    task = (task_type or "").strip().lower()
    if task == "general":
        return 1.0 if _general_layout(text) else 0.0
    if task in _RYNN_PATTERNS:
        return 1.0 if _RYNN_PATTERNS[task].fullmatch(text) else 0.0
    return 1.0 if any(p.fullmatch(text) for p in _RYNN_PATTERNS.values()) or _general_layout(text) else 0.0


def format_rynnbrain_reward(
    completions: Sequence[Any], task_type: Sequence[str | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """RynnBrain format reward. Range {0.0, 1.0}.

    1.0 iff the completion is: free reasoning without ``####``, then one ``####``, then for the row's
    ``task_type`` (``trajectory``, ``affordance``, ``area``, ``counting``, ``segment``)
    ``<answer><TAG>CONTENT</TAG></answer>`` and nothing but whitespace after, where TAG is the task's tag
    (``segment`` uses ``<object>``) and CONTENT is ``<frame i>`` followed by ``(x, y)`` points (one or more,
    separated by commas and/or whitespace; exactly two corner points for ``segment``) or, for ``counting``, an
    integer. For
    ``general`` rows: one ``####`` followed by a non-empty final answer (free text, or one closed
    ``<answer>…</answer>``). Rows whose ``task_type`` is missing or another task accept any of these forms.
    Tags are case-sensitive. Completions over 100,000 characters get 0.0.
    """
    n = len(completions)
    tasks: Sequence[Any] = [None] * n if task_type is None else task_type
    if len(tasks) != n:
        raise ValueError(f"Got {n} completions but {len(tasks)} task_type entries")
    return [
        rynnbrain_format_score(completion_text(c), t if isinstance(t, str) else None)
        for c, t in zip(completions, tasks, strict=True)
    ]


format_rynnbrain_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]

__all__ = [
    "extract_answer",
    "extract_tag",
    "format_explain_reward",
    "format_reward",
    "format_rynnbrain_reward",
    "format_speaker_strict_reward",
    "make_format_reward",
    "rynnbrain_format_score",
    "tag_layout_score",
]
