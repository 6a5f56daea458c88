"""The ``http`` reward: any endpoint that scores completions.

``http``.

``listener``
    The Lewis-game reward. The speaker's completion (``<thinking>…</thinking><coarse>…</coarse><detailed>…
    </detailed>``) becomes the question ``"Does this description match the image? Description: {description}"``
    asked of every candidate image by a listener service (``vlm-grpo-serve listener``, ``POST /batch_score``).
    The reward is 1.0 when the listener's most likely candidate is the target, else 0.0 (``mode="accuracy"``); or
    the listener's normalised P(yes) of the target (``mode="probability"``); or its raw P(yes) (``"yes_probability"``).
    A row says which images are candidates and which is the target through its ``solution``: either a JSON object
    ``{"candidates": ["a.png", "b.png", "c.png"], "target": 0}`` (``target``: an index, one of the paths, or a
    file name; relative paths are taken from ``candidate_root``, else from the folder of the row's first image), or
    a bare index ``"1"`` into the row's own images. Paths are sent, not pixels: the service must see the same files
    and have their folder among its ``--image_root``.

``http``
    Any endpoint that scores completions: ``POST url`` with ``{"batch": [{"completion": text, "solution": ...,
    "question": ..., "image_path": [...], "task_type": ..., "id": ...}, ...]}`` (the columns named by ``fields``)
    must answer ``{"scores": [float | null, ...]}`` (``"rewards"`` or a bare list also work), one per item.

Client options (``url``, ``timeout``, retries, cache, ``fallback``, ...; environment ``HTTP_REWARD_*``) are those
of :mod:`vlm_grpo.rewards.client`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from vlm_grpo.rewards.base import completion_text
from vlm_grpo.rewards.client import RemoteError, env_fallback, get_client, report, resolve_config

DEFAULT_HTTP_FIELDS = ("solution", "question", "image_path", "task_type", "id")


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _parse_scores(answer: Any, n: int) -> list[float | None]:
    scores = answer
    if isinstance(answer, dict):
        scores = next((answer[k] for k in ("scores", "rewards", "results") if k in answer), None)
    if not isinstance(scores, list) or len(scores) != n:
        got = len(scores) if isinstance(scores, list) else type(scores).__name__
        raise RemoteError(f"endpoint answered {got} scores for {n} items", retryable=False)
    out: list[float | None] = []
    for s in scores:
        if isinstance(s, dict):
            s = s.get("score", s.get("reward"))
        if s is None:
            out.append(None)
        elif isinstance(s, (int, float)) and not isinstance(s, bool):
            out.append(float(s))
        else:
            raise RemoteError(f"score {s!r} is not a number or null", retryable=False)
    return out


def http_reward(
    completions: Sequence[Any],
    *,
    url: str | None = None,
    fields: Sequence[str] = DEFAULT_HTTP_FIELDS,
    fallback: float | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    **columns: Any,
) -> list[float | None]:
    """Generic remote reward: POST the completions (and the dataset ``fields``) to ``url``, use its scores.

    Request ``{"batch": [{"completion": text, <field>: value, ...}, ...]}``; answer ``{"scores": [...]}`` (or
    ``"rewards"``, or a list; items may be ``{"score": x}``), a number or null per item. Environment
    ``HTTP_REWARD_*``; see the module docstring. Samples the server could not score get ``fallback``.
    """
    config = resolve_config(
        "HTTP_REWARD",
        url=url,
        **columns,
    )
    client = get_client("http", config)
    fallback = env_fallback("HTTP_REWARD", fallback)
    n = len(completions)
    items = []
    for i, completion in enumerate(completions):
        item: dict[str, Any] = {"completion": completion_text(completion)}
        for name in fields:
            column = columns.get(name)
            if isinstance(column, list) and len(column) == n:
                item[name] = _jsonable(column[i])
        items.append(item)
    call = client.map_chunks(items, lambda chunk: {"batch": chunk}, _parse_scores)
    rewards = [value if ok else fallback for value, ok in zip(call.values, call.ok, strict=True)]
    report(client, call, call.failed, fallback, log_metric)
    return rewards


http_reward.value_range = (-math.inf, math.inf)  # type: ignore[attr-defined]  # the endpoint decides
