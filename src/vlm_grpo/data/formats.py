"""Row formats our users bring, normalised into one canonical row.

Canonical row (what the dataset stores; only paths, never pixels):
    id, question (user text with one ``<image>`` marker where each image goes), system,
    solution (verbatim), image_path (list), accu_reward_method, task_type, source ("file:line").

Three input formats are detected from their keys:
    * VLM-R1:    ``conversations: [{from: human, value: "<image>..."}, {from: gpt, value: ...}]``, ``image``
    * RynnBrain: ``conversation: [{role: user, content: [{type: image, image: p}, {type: text, ...}]}, ...]``
    * EasyR1:    ``problem``, ``answer``, ``images``
"""

from __future__ import annotations

import json
from typing import Any

from vlm_grpo.tasks import IMAGE_TOKEN


class DataError(ValueError):
    """A data problem the user must fix; the message names where (``file`` or ``file:line``) and how.

    CLIs print it as ``error: <message>`` without a traceback.
    """

    def __init__(self, message: str, source: str | None = None) -> None:
        super().__init__(f"{source}: {message}" if source else message)
        self.source = source


class RowError(ValueError):
    """A problem with one row: carries the field it concerns."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _as_list(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise RowError(field, f"expected a path or a list of paths, got {type(value).__name__}")


def _require(row: dict, key: str) -> Any:
    if key not in row or row[key] is None:
        raise RowError(key, f"missing field '{key}'")
    return row[key]


def _vlm_r1(row: dict) -> dict:
    conversations = _require(row, "conversations")
    if not isinstance(conversations, list) or not conversations:
        raise RowError("conversations", "'conversations' must be a non-empty list of {from, value} turns")
    system = None
    question = None
    solution = None
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict) or "value" not in turn:
            raise RowError(f"conversations[{i}]", "each turn needs 'from' and 'value'")
        speaker = turn.get("from")
        value = turn["value"]
        if not isinstance(value, str):
            raise RowError(f"conversations[{i}].value", "turn value must be a string")
        if speaker == "system":
            system = value
        elif speaker in ("human", "user") and question is None:
            question = value
        elif speaker in ("gpt", "assistant") and solution is None:
            solution = value
    if question is None:
        raise RowError("conversations", "no 'human' turn in 'conversations'")
    if solution is None:
        raise RowError("conversations", "no 'gpt' turn (the solution) in 'conversations'")
    images = _as_list(row.get("image", row.get("images")), "image")
    # VLM-R1 puts the images in front when the question has no <image> marker (its multi-image GUI data).
    images_first = bool(images) and IMAGE_TOKEN not in question
    if images_first:
        question = IMAGE_TOKEN * len(images) + question
    return {
        "question": question,
        "system": system,
        "solution": solution,
        "image_path": images,
        "images_first": images_first,
    }


def _content_items(content: Any, field: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RowError(field, "content must be a string or a list of {type, ...} items")
    return content


def _rynnbrain(row: dict) -> dict:
    conversation = _require(row, "conversation")
    if not isinstance(conversation, list) or not conversation:
        raise RowError("conversation", "'conversation' must be a non-empty list of {role, content} turns")
    system = None
    parts: list[str] = []
    images: list[str] = []
    solution = None
    for i, turn in enumerate(conversation):
        if not isinstance(turn, dict) or "role" not in turn:
            raise RowError(f"conversation[{i}]", "each turn needs 'role' and 'content'")
        role = turn["role"]
        items = _content_items(turn.get("content"), f"conversation[{i}].content")
        if role == "system":
            system = "".join(str(it.get("text", "")) for it in items if isinstance(it, dict))
        elif role == "user" and not parts:
            for j, item in enumerate(items):
                kind = item.get("type") if isinstance(item, dict) else None
                if kind == "image":
                    path = item.get("image") or item.get("path") or item.get("url")
                    if not isinstance(path, str):
                        raise RowError(f"conversation[{i}].content[{j}].image", "image item without a path")
                    images.append(path)
                    parts.append(IMAGE_TOKEN)
                elif kind == "text":
                    parts.append(str(item.get("text", "")))
                else:
                    raise RowError(f"conversation[{i}].content[{j}]", f"unsupported content type {kind!r}")
        elif role == "assistant" and solution is None:
            solution = _assistant_text(items)
    if not parts:
        raise RowError("conversation", "no 'user' turn in 'conversation'")
    if solution is None:
        solution = row.get("solution") or row.get("answer")
        if solution is None:
            raise RowError("conversation", "no 'assistant' turn and no 'solution' field")
    return {"question": "".join(parts), "system": system, "solution": solution, "image_path": images}


def _assistant_text(items: list) -> str:
    """RynnBrain answers are text items or ``{"frameN": [[x, y], ...]}`` dicts; keep the latter as JSON."""
    texts = []
    for item in items:
        if isinstance(item, dict) and item.get("type") == "text":
            texts.append(str(item.get("text", "")))
        else:
            texts.append(json.dumps(item, ensure_ascii=False))
    return "".join(texts)


def _easyr1(row: dict) -> dict:
    question = _require(row, "problem")
    solution = _require(row, "answer")
    if not isinstance(question, str):
        raise RowError("problem", "'problem' must be a string")
    images = _as_list(row.get("images", row.get("image")), "images")
    # EasyR1 puts the images in front when the problem has no <image> marker.
    if images and IMAGE_TOKEN not in question:
        question = IMAGE_TOKEN * len(images) + question
    return {"question": question, "system": row.get("system"), "solution": str(solution), "image_path": images}


def detect_format(row: dict) -> str:
    if "conversations" in row:
        return "vlm_r1"
    if "conversation" in row:
        return "rynnbrain"
    if "problem" in row:
        return "easyr1"
    raise RowError(
        "conversations",
        "unknown row format: expected 'conversations' (VLM-R1), 'conversation' (RynnBrain) or 'problem' (EasyR1)",
    )


_NORMALISERS = {"vlm_r1": _vlm_r1, "rynnbrain": _rynnbrain, "easyr1": _easyr1}


def normalise_row(row: Any, notes: dict[str, Any] | None = None) -> dict:
    """Canonical fields of one raw row; raises :class:`RowError` naming the bad field.

    ``notes`` (optional) receives ``images_first: True`` when images without markers were put before the question.
    """
    if not isinstance(row, dict):
        raise RowError("<row>", f"a row must be a JSON object, got {type(row).__name__}")
    out = _NORMALISERS[detect_format(row)](row)
    if out.pop("images_first", False) and notes is not None:
        notes["images_first"] = True
    solution = out["solution"]
    out["solution"] = solution if isinstance(solution, str) else json.dumps(solution, ensure_ascii=False)
    out["system"] = out.get("system") if isinstance(out.get("system"), str) else None
    out["id"] = str(row.get("id", ""))
    method = row.get("accu_reward_method")
    out["accu_reward_method"] = method if isinstance(method, str) else None
    task = row.get("task_type")
    out["task_type"] = task if isinstance(task, str) else None
    return out


def count_placeholders(question: str) -> int:
    return question.count(IMAGE_TOKEN)
