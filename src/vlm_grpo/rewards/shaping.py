"""Shaping rewards: cosine length shaping driven by the sample's real accuracy, the Lewis-game one-sentence bonus,
an n-gram repetition penalty and DAPO's soft overlong penalty.

Lengths are completion TOKENS (TRL's ``completion_ids``) when available, else characters of the completion text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from vlm_grpo.rewards.base import completion_text
from vlm_grpo.rewards.format import extract_tag

# Word-level penalties only look at this many leading words.
REPETITION_MAX_WORDS = 20_000
# Sentence counting only looks at this many characters.
SENTENCE_MAX_CHARS = 20_000


def _lengths(completions: Sequence[Any], completion_ids: Sequence[Any] | None) -> list[int]:
    if completion_ids is not None and len(completion_ids) == len(completions):
        return [
            len(ids) if ids is not None else len(completion_text(c))
            for ids, c in zip(completion_ids, completions, strict=True)
        ]
    return [len(completion_text(c)) for c in completions]


def _finite(name: str, value: Any) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


# --------------------------------------------------------------------------------------------- length


def cosine_length_value(
    length: int,
    correct: bool,
    max_len: int = 1000,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
) -> float:
    """Cosine length shaping (Yeo et al., 2025): with ``t = min(length, max_len) / max_len``,
    ``value = lo + (hi − lo) · (1 + cos(π t)) / 2`` where a correct sample goes from ``hi = max_value_correct``
    (length 0) down to ``lo = min_value_correct`` (length >= max_len) and a wrong one from ``min_value_wrong``
    (length 0: short wrong answers are penalised most) up to ``max_value_wrong``."""
    t = min(max(length, 0), max_len) / max_len
    cosine = math.cos(math.pi * t)
    if correct:
        start, end = max_value_correct, min_value_correct
    else:
        start, end = min_value_wrong, max_value_wrong
    return end + 0.5 * (start - end) * (1.0 + cosine)


def length_reward(
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None = None,
    max_len: int = 1000,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    correct_threshold: float = 1.0,
    **kwargs: Any,
) -> list[float | None]:
    """Cosine length shaping using the sample's REAL accuracy. Range [-1.0, 1.0] with the defaults
    ([min(min_value_wrong, max_value_wrong), max(min_value_correct, max_value_correct)] in general).

    A sample is correct when the ``accuracy`` reward of its row (same per-row ``accu_reward_method``, same
    ``solution``) is >= ``correct_threshold`` (1.0). Its length ``L`` is its number of completion tokens (characters
    without ``completion_ids``), capped at ``max_len`` (1000); with ``t = L / max_len``:
    correct -> ``0.5 + 0.25 · (1 + cos(π t))`` (1.0 at length 0 falling to 0.5 at ``max_len``: shorter correct
    answers earn more), wrong -> ``−0.5 − 0.25 · (1 + cos(π t))`` (−1.0 at length 0 rising to −0.5 at ``max_len``:
    a wrong answer is penalised less when it reasoned longer). The constants come from
    ``--reward_kwargs '{"length": {"max_len": 512, ...}}'``. Raises ``ValueError`` on rows the accuracy reward
    cannot score (no/empty solution, unknown method).
    """
    from vlm_grpo.rewards.accuracy import accuracy_reward

    max_len = int(max_len)
    if max_len <= 0:
        raise ValueError(f"max_len must be positive, got {max_len}")
    constants = {
        "min_value_correct": _finite("min_value_correct", min_value_correct),
        "max_value_correct": _finite("max_value_correct", max_value_correct),
        "min_value_wrong": _finite("min_value_wrong", min_value_wrong),
        "max_value_wrong": _finite("max_value_wrong", max_value_wrong),
    }
    threshold = _finite("correct_threshold", correct_threshold)
    accuracy = accuracy_reward(
        completions, solution=kwargs.get("solution"), accu_reward_method=kwargs.get("accu_reward_method")
    )
    lengths = _lengths(completions, completion_ids)
    return [
        cosine_length_value(length, acc is not None and acc >= threshold, max_len, **constants)
        for length, acc in zip(lengths, accuracy, strict=True)
    ]


# --------------------------------------------------------------------------------------------- one sentence

# A sentence ends at a run of . ! ? … followed by whitespace or the end of the text ("3.5", "e.g" and "U.S.A"
# have no whitespace after their inner dots), or at a run of the CJK marks 。！？ anywhere.
# (The look-behind/look-ahead pair makes each run of marks match whole, so long runs can't backtrack.)
_SENTENCE_END = re.compile(r"(?<![.!?…])[.!?…]+(?![.!?…])(?=\s|$)|[。！？]+")
_WORD_CHAR = re.compile(r"\w")


def count_sentences(text: str) -> int:
    """Number of sentences: pieces between sentence ends (:data:`_SENTENCE_END`) that hold a letter or digit."""
    text = text[:SENTENCE_MAX_CHARS]
    pieces = _SENTENCE_END.split(text)
    return sum(1 for piece in pieces if _WORD_CHAR.search(piece))


def one_sentence_reward(
    completions: Sequence[Any], tag: str | None = "detailed", value: float = 0.1, **kwargs: Any
) -> list[float | None]:
    """Lewis-game length reward: ``value`` (0.1) when the description is exactly one sentence, else 0.0.
    Range {0.0, 0.1}.

    The description is the content of the completion's last ``<detailed>…</detailed>`` (``tag``; ``tag=None``: the
    whole completion); 0.0 when that tag is missing. Sentences are counted by :func:`count_sentences`: pieces
    between runs of ``. ! ? …`` followed by whitespace or the end (or runs of ``。！？``), holding at least one
    letter or digit (so ``"A dog with 3.5 legs."`` is one sentence; ``"A dog. It runs."`` two).
    """
    value = _finite("value", value)
    out: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
        content = text if tag is None else extract_tag(text, tag)
        out.append(value if content is not None and count_sentences(content) == 1 else 0.0)
    return out


# --------------------------------------------------------------------------------------------- repetition


def repetition_value(text: str, ngram_size: int = 3, max_penalty: float = -1.0) -> float:
    """``max_penalty · (1 − distinct n-grams / n-grams)`` over the lower-cased whitespace-separated words (at most
    20,000); 0.0 with fewer than ``ngram_size`` words."""
    words = text.lower().split()[:REPETITION_MAX_WORDS]
    if len(words) < ngram_size:
        return 0.0
    ngrams = [tuple(words[i : i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
    return max_penalty * (1.0 - len(set(ngrams)) / len(ngrams))


def repetition_reward(
    completions: Sequence[Any], ngram_size: int = 3, max_penalty: float = -1.0, **kwargs: Any
) -> list[float | None]:
    """N-gram repetition penalty: ``max_penalty · (1 − distinct n-grams / total n-grams)`` of the completion's
    words (lower-cased, split on whitespace, first 20,000 words; ``ngram_size`` 3, ``max_penalty`` −1.0).
    0.0 for texts shorter than ``ngram_size`` words or without repeats. Range [−1.0, 0.0] ([max_penalty, 0])."""
    ngram_size = int(ngram_size)
    if ngram_size < 1:
        raise ValueError(f"ngram_size must be >= 1, got {ngram_size}")
    max_penalty = _finite("max_penalty", max_penalty)
    if max_penalty > 0:
        raise ValueError(f"max_penalty must be <= 0, got {max_penalty}")
    return [repetition_value(completion_text(c), ngram_size, max_penalty) for c in completions]


# --------------------------------------------------------------------------------------------- overlong


def overlong_value(length: int, max_len: int, cache_len: int) -> float:
    """DAPO soft overlong punishment: 0 for ``length <= max_len − cache_len``; ``((max_len − cache_len) − length) /
    cache_len`` (linear from 0 to −1) up to ``max_len``; −1 beyond."""
    expected = max_len - cache_len
    if length <= expected:
        return 0.0
    if length <= max_len:
        return (expected - length) / cache_len
    return -1.0


def overlong_reward(
    completions: Sequence[Any],
    completion_ids: Sequence[Any] | None = None,
    max_len: int = 1024,
    cache_len: int = 256,
    **kwargs: Any,
) -> list[float | None]:
    """DAPO soft overlong penalty on the completion length ``L`` (tokens; characters without ``completion_ids``):
    0.0 when ``L <= max_len − cache_len``; ``(max_len − cache_len − L) / cache_len`` in the last ``cache_len``
    tokens; −1.0 beyond ``max_len``. Set ``max_len`` to the run's ``--max_completion_length`` via
    ``--reward_kwargs '{"overlong": {"max_len": 1024, "cache_len": 256}}'`` (defaults 1024 / 256).
    Range [−1.0, 0.0]."""
    max_len, cache_len = int(max_len), int(cache_len)
    if not 0 < cache_len <= max_len:
        raise ValueError(f"overlong needs 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    return [overlong_value(length, max_len, cache_len) for length in _lengths(completions, completion_ids)]


length_reward.value_range = (-1.0, 1.0)  # type: ignore[attr-defined]
one_sentence_reward.value_range = (0.0, 0.1)  # type: ignore[attr-defined]
repetition_reward.value_range = (-1.0, 0.0)  # type: ignore[attr-defined]
overlong_reward.value_range = (-1.0, 0.0)  # type: ignore[attr-defined]

__all__ = [
    "cosine_length_value",
    "count_sentences",
    "length_reward",
    "one_sentence_reward",
    "overlong_reward",
    "overlong_value",
    "repetition_reward",
    "repetition_value",
]
