"""The Lewis-game speaker's rewards: ``listener`` (does a served listener pick the target image from the speaker's
description?) and ``format_speaker`` (the seed's format check: ``<thinking>``, ``<coarse>`` and ``<detailed>`` all
present and closed; ``format_speaker_strict`` in :mod:`vlm_grpo.rewards.format` also wants them in order with
nothing around them).

Client options (``url``, ``timeout``, retries, cache, ``fallback``, ...; environment ``LISTENER_*``) are those of
:mod:`vlm_grpo.rewards.client`.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from vlm_grpo.rewards.base import completion_text
from vlm_grpo.rewards.client import CallResult, RemoteError, env_fallback, get_client, report, resolve_config
from vlm_grpo.rewards.format import extract_answer, extract_tag

DEFAULT_LISTENER_QUESTION = "Does this description match the image? Description: {description}"
MAX_DESCRIPTION_CHARS = 4000


def listener_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/batch_score``; a URL already naming an endpoint is kept."""
    path = urlsplit(url).path.rstrip("/")
    if path.endswith("/batch_score"):
        return url
    if path.endswith("/score"):
        return url.rstrip("/")[: -len("/score")] + "/batch_score"
    return url.rstrip("/") + "/batch_score"


def describe_text(text: str, tags: Sequence[str] = ("coarse", "detailed")) -> str:
    """What the listener is told: the stripped contents of ``tags`` joined by a space (those present and not
    empty); when none is, the whole text with every ``<tag>``/``</tag>`` removed. Whitespace is collapsed."""
    parts = []
    for tag in tags:
        value = extract_tag(text, tag)
        if value is not None and value.strip():
            parts.append(value.strip())
    description = " ".join(parts) if parts else re.sub(r"</?[A-Za-z_][A-Za-z0-9_.\-]*\s*>", " ", text)
    return " ".join(description.split())[:MAX_DESCRIPTION_CHARS]


def _candidate_root(image: str, candidates: list[str], target: Any) -> str:
    """The folder candidate names are relative to: the target image's path minus the target's name (so that
    ``concept/3.png`` under ``ROOT`` resolves to ``ROOT/concept/3.png``), else the image's own folder."""
    name = target if isinstance(target, str) else None
    if isinstance(target, int) and not isinstance(target, bool) and 0 <= target < len(candidates):
        name = candidates[target]
    if name and not os.path.isabs(name):
        name = os.path.normpath(name)
        if image.endswith(os.sep + name):
            return image[: -len(name) - 1]
    return os.path.dirname(image)


def parse_lewis_target(
    solution: Any, image_paths: Sequence[str] | None, candidate_root: str | None = None
) -> tuple[list[str], int]:
    """(absolute candidate paths, target index) of a Lewis-game row; ValueError when the row does not say."""
    if isinstance(solution, str):
        text = extract_answer(solution)
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"solution is neither an index nor a JSON object: {text[:80]!r}") from None
    else:
        data = solution
    images = list(image_paths or [])
    if isinstance(data, bool):
        raise ValueError("solution must be an index or {candidates, target}, not a boolean")
    if isinstance(data, int):
        candidates, target = images, data
    elif isinstance(data, dict):
        candidates = data.get("candidates")
        target = data.get("target")
        if not isinstance(candidates, list) or not candidates or not all(isinstance(c, str) for c in candidates):
            raise ValueError("solution.candidates must be a non-empty list of image paths")
    else:
        raise ValueError(f"solution must be an index or {{candidates, target}}, got {type(data).__name__}")
    base = candidate_root or (
        _candidate_root(images[0], candidates, target) if images and not images[0].startswith("data:") else ""
    )
    resolved = [
        c if c.startswith("data:image/") or os.path.isabs(c) else os.path.abspath(os.path.join(base, c))
        for c in candidates
    ]
    if isinstance(target, str):
        names = [target, os.path.abspath(os.path.join(base, target))]
        matches = [i for i, (c, r) in enumerate(zip(candidates, resolved, strict=True)) if c in names or r in names]
        if not matches:  # a bare file name names the candidate with that name
            matches = [i for i, r in enumerate(resolved) if os.path.basename(r) == target]
        if len(matches) != 1:
            raise ValueError(f"solution.target {target!r} matches {len(matches)} candidate(s), expected 1")
        target = matches[0]
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < len(resolved):
        raise ValueError(f"target {target!r} is not an index into {len(resolved)} candidate(s)")
    return resolved, target


def _parse_listener_response(answer: Any, n: int) -> list[dict[str, Any]]:
    results = answer.get("results") if isinstance(answer, dict) else None
    if not isinstance(results, list) or len(results) != n:
        got = len(results) if isinstance(results, list) else type(results).__name__
        raise RemoteError(f"listener answered {got} results for {n} requests", retryable=False)
    for r in results:
        probs = r.get("yes_probabilities") if isinstance(r, dict) else None
        if not isinstance(probs, list) or not isinstance(r.get("predicted_index"), int):
            raise RemoteError("listener result lacks yes_probabilities / predicted_index", retryable=False)
    return results


def _listener_value(result: dict[str, Any], target: int, n_candidates: int, mode: str) -> float:
    probs = [float(p) for p in result["yes_probabilities"]]
    if len(probs) != n_candidates:
        raise RemoteError(f"listener scored {len(probs)} of {n_candidates} candidates", retryable=False)
    if mode == "accuracy":
        return 1.0 if result["predicted_index"] == target else 0.0
    if mode == "yes_probability":
        return probs[target]
    total = sum(probs)
    return probs[target] / total if total > 0 and math.isfinite(total) else 1.0 / len(probs)


LISTENER_MODES = ("accuracy", "probability", "yes_probability")


def listener_reward(
    completions: Sequence[Any],
    image_path: Sequence[Sequence[str]] | None = None,
    solution: Sequence[Any] | None = None,
    *,
    url: str | None = None,
    mode: str = "accuracy",
    question_template: str = DEFAULT_LISTENER_QUESTION,
    description_tags: Sequence[str] = ("coarse", "detailed"),
    candidate_root: str | None = None,
    fallback: float | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    log_path: str | None = None,
    **options: Any,
) -> list[float | None]:
    """Lewis-game listener reward: does a served listener pick the target image from the speaker's description?

    See the module docstring for the row format, the modes and every parameter (environment ``LISTENER_*``).
    Samples whose row names no valid target get None (and a warning); a completion with no description gets 0.0;
    samples the server could not score get ``fallback``. Range [0, 1]. ``log_path`` (or the seed's ``LOG_PATH``):
    a JSON-lines prediction log, one line per game the listener answered (appended by every rank).
    """
    if mode not in LISTENER_MODES:
        raise ValueError(f"listener mode must be one of {LISTENER_MODES}, got {mode!r}")
    if "{description}" not in question_template:
        raise ValueError("question_template must contain {description}")
    config = resolve_config(
        "LISTENER",
        url=url,
        **options,
    )
    config = config.replace(url=listener_url(config.url))
    client = get_client("listener", config)
    fallback = env_fallback("LISTENER", fallback)
    n = len(completions)
    rewards: list[float | None] = [None] * n
    items: list[dict[str, Any]] = []
    wanted: list[tuple[int, int, int]] = []  # (sample, target, number of candidates)
    descriptions: list[str] = []
    bad_rows: list[str] = []
    for i, completion in enumerate(completions):
        try:
            candidates, target = parse_lewis_target(
                solution[i] if solution is not None else None,
                image_path[i] if image_path is not None else None,
                candidate_root,
            )
        except ValueError as exc:
            bad_rows.append(str(exc))
            continue
        description = describe_text(completion_text(completion), description_tags)
        if not description:
            rewards[i] = 0.0
            continue
        question = question_template.replace("{description}", description)
        items.append({"candidate_paths": candidates, "question": question, "topk": 1})
        wanted.append((i, target, len(candidates)))
        descriptions.append(description)
    if bad_rows:
        client.failures.record(len(bad_rows), f"rows without a valid Lewis target: {bad_rows[0]}", None, "bad rows")
    call = client.map_chunks(items, lambda chunk: {"batch": chunk}, _parse_listener_response) if items else None
    failed = 0
    for j, (i, target, n_candidates) in enumerate(wanted):
        assert call is not None
        if not call.ok[j]:
            rewards[i] = fallback
            failed += 1
            continue
        try:
            rewards[i] = _listener_value(call.values[j], target, n_candidates, mode)
        except RemoteError as exc:
            call.errors.append(str(exc))
            rewards[i] = fallback
            failed += 1
    report(client, call or CallResult([], []), failed, fallback, log_metric)
    log_path = log_path or os.environ.get("LOG_PATH")
    if log_path and call is not None:
        log_games(log_path, items, wanted, descriptions, call, rewards)
    return rewards


def log_games(
    path: str,
    items: Sequence[dict[str, Any]],
    wanted: Sequence[tuple[int, int, int]],
    descriptions: Sequence[str],
    call: CallResult,
    rewards: Sequence[float | None],
) -> None:
    """Append one JSON line per answered game: description, candidates, target, the listener's pick, reward."""
    lines = []
    for j, (i, target, _) in enumerate(wanted):
        if not call.ok[j]:
            continue
        result = call.values[j]
        game = {
            "time": time.time(),
            "rank": int(os.environ.get("RANK", "0")),
            "description": descriptions[j],
            "candidates": items[j]["candidate_paths"],
            "target": target,
            "predicted_index": result["predicted_index"],
            "yes_probabilities": result["yes_probabilities"],
            "correct": result["predicted_index"] == target,
            "reward": rewards[i],
        }
        lines.append(json.dumps(game, ensure_ascii=False) + "\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:  # one write per batch: ranks append whole lines
        f.write("".join(lines))


listener_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]  # plus whatever ``fallback`` is

SPEAKER_TAGS = ("thinking", "coarse", "detailed")


def _has_block(text: str, tag: str) -> bool:
    """``<tag>`` and, after it, ``</tag>`` (exact, case-sensitive: the seed's tags)."""
    start = text.find(f"<{tag}>")
    return start >= 0 and text.find(f"</{tag}>", start + len(tag) + 2) >= 0


def format_speaker_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """Lewis-game speaker format reward, as the seed defines it: 1.0 when ``<thinking>…</thinking>``,
    ``<coarse>…</coarse>`` and ``<detailed>…</detailed>`` are all present and closed (in any order, text around
    them allowed), else 0.0. Range {0.0, 1.0}. ``format_speaker_strict`` wants exactly the three blocks in order."""
    texts = [completion_text(c) for c in completions]
    return [1.0 if all(_has_block(t, tag) for tag in SPEAKER_TAGS) else 0.0 for t in texts]


format_speaker_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
