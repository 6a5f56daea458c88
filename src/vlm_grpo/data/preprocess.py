"""RynnBrain-style raw records -> GRPO rows and SFT chain-of-thought rows.

A raw record is a ``conversation`` of a ``user`` turn (image / video-frame items with optional
``width``/``height``, and text), an optional ``Thinking`` turn (the chain of thought) and an
``assistant`` turn whose answer is ``{"frameN": [[x, y], ...]}`` items (coordinates normalised to
0-1000), a count, or text. Each record becomes, in the canonical VLM-R1 row format:

* a GRPO row: the task's system prompt, the question (one ``<image>`` per frame, where it stood, plus
  the task's output-format hint) and the solution in the task's output format, wrapped in
  ``<answer>…</answer>``, e.g. ``<answer><trajectory><frame 3> (450, 320), (480, 350)</trajectory></answer>``;
* an SFT row: the same prompt, answered in RynnBrain's layout ``{Thinking}\n#### {solution}``
  (``--simple``: ``#### {solution}``), which the ``format_rynnbrain`` reward scores.

Rows already in a supported format (VLM-R1, EasyR1, or RynnBrain rows of other tasks) pass through
``normalise_row`` with their solution kept verbatim; their SFT answer is ``<think>{thinking}</think>`` +
the solution (``--simple``: the solution alone), the layout of the ``format`` reward. ``--cot_layout``
picks one layout for all. Records are split into train/test by a seeded
shuffle (the same records in both stages) and written to ``train/<task>_<stage>_train.*`` and
``test/<task>_<stage>_test.*`` (stage ``rl`` or ``cot``).
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo.data.formats import RowError, normalise_row
from vlm_grpo.data.records import Record, iter_records, vlm_r1_row, write_rows
from vlm_grpo.tasks import (
    RYNNBRAIN_OUTPUT_FORMATS,
    RYNNBRAIN_SYSTEM_PROMPTS,
    RYNNBRAIN_TASK_TAGS,
    RYNNBRAIN_TASKS,
)

# One definition of the RynnBrain tasks, shared with their rewards: system prompts, output-format hints, tags.
SYSTEM_PROMPTS: dict[str, str] = RYNNBRAIN_SYSTEM_PROMPTS
#: task -> the tag its answer is written in (None: free-form text)
TASK_TAGS: dict[str, str | None] = {task: RYNNBRAIN_TASK_TAGS.get(task) for task in RYNNBRAIN_TASKS}
TASK_ALIASES = {"segmentation": "segment", "object": "segment"}
COORDINATE_TASKS = ("trajectory", "affordance", "area", "segment")
#: the output-format hint appended to the question (unless it already states one): reasoning, then
#: ``#### <answer><TAG>…</TAG></answer>``, the layout ``format_rynnbrain`` scores
FORMAT_HINTS: dict[str, str] = RYNNBRAIN_OUTPUT_FORMATS
#: chain-of-thought layouts of SFT answers: RynnBrain's (reasoning, then ``####`` and the answer) and the
#: package's ``<think>…</think><answer>…</answer>`` (what the ``format`` reward scores)
COT_LAYOUTS = ("auto", "rynnbrain", "think")

COORD_MIN, COORD_MAX = 0, 1000
_FRAME_KEY = re.compile(r"frame\s*(\d+)", re.IGNORECASE)
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_POINT = re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)")
_FRAME_TAG = re.compile(r"<frame\s*\d+\s*>", re.IGNORECASE)


def system_prompts() -> dict[str, str]:
    """Per-task system prompts (those of ``vlm_grpo.rewards.rynnbrain``)."""
    return dict(SYSTEM_PROMPTS)


def canonical_task(task: str | None) -> str | None:
    if task is None:
        return None
    task = task.strip().lower()
    return TASK_ALIASES.get(task, task)


def format_number(value: Any) -> str:
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


# --------------------------------------------------------------------------- answers


def frame_points(items: Any) -> list[tuple[int, list[tuple[float, float]]]]:
    """``[{"frame3": [[x, y], ...]}, ...]`` -> ``[(3, [(x, y), ...]), ...]``; a 4-number entry is a box (2 points)."""
    frames = []
    for item in items if isinstance(items, list) else [items]:
        if not isinstance(item, dict):
            continue
        for key, value in item.items():
            match = _FRAME_KEY.fullmatch(str(key))
            if not match:
                continue
            if not isinstance(value, list):
                raise RowError("assistant", f"'{key}' must be a list of [x, y] points")
            points: list[tuple[float, float]] = []
            for entry in value:
                if not isinstance(entry, (list, tuple)) or len(entry) not in (2, 4):
                    raise RowError("assistant", f"'{key}': expected [x, y] (or [x1, y1, x2, y2]) points, got {entry!r}")
                try:
                    numbers = [float(v) for v in entry]
                except (TypeError, ValueError):
                    raise RowError("assistant", f"'{key}': non-numeric coordinate in {entry!r}") from None
                points.extend(zip(numbers[0::2], numbers[1::2], strict=True))
            frames.append((int(match.group(1)), points))
    return frames


def solution_points(solution: str) -> list[tuple[float, float]]:
    """Every coordinate a solution holds: ``(x, y)`` tuples after ``<frame i>`` tags, or JSON ``frameN`` lists."""
    if _FRAME_TAG.search(solution):
        return [(float(x), float(y)) for x, y in _POINT.findall(solution)]
    if "frame" in solution and solution.lstrip().startswith(("{", "[")):
        try:
            value = json.loads(solution)
        except ValueError:
            return []
        try:
            return [p for _, points in frame_points(value) for p in points]
        except RowError:
            return []
    return []


def coordinate_problem(solution: str) -> str | None:
    """Why the solution's coordinates are out of the 0-1000 frame, or None."""
    outside = [p for p in solution_points(solution) if not all(COORD_MIN <= v <= COORD_MAX for v in p)]
    if not outside:
        return None
    shown = ", ".join(f"({format_number(x)}, {format_number(y)})" for x, y in outside[:3])
    return f"{len(outside)} coordinate(s) outside {COORD_MIN}-{COORD_MAX}: {shown}"


def _texts(items: Any) -> list[str]:
    if isinstance(items, str):
        return [items]
    out = []
    for item in items if isinstance(items, list) else [items]:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and item.get("type") == "text":
            out.append(str(item.get("text", "")))
    return out


def _count(items: Any) -> int:
    values = items if isinstance(items, list) else [items]
    for item in values:
        if isinstance(item, bool):
            continue
        if isinstance(item, (int, float)):
            return int(item)
        if isinstance(item, dict) and isinstance(item.get("count"), (int, float)):
            return int(item["count"])
    for text in _texts(items):
        match = re.search(r"-?\d+", text)
        if match:
            return int(match.group())
    raise RowError("assistant", "counting answer holds no number")


def answer_body(items: Any, task: str) -> str:
    """The answer in the task's output format (without ``<answer>``)."""
    tag = TASK_TAGS.get(task)
    if task in COORDINATE_TASKS:
        frames = frame_points(items)
        if not frames:
            text = "".join(_texts(items)).strip()
            if text:
                return text  # already written out
            raise RowError("assistant", f"'{task}' answer has no frameN coordinates")
        if len(frames) > 1:
            listed = ", ".join(f"frame{n}" for n, _ in frames)
            raise RowError(
                "assistant",
                f"the answer lists {len(frames)} frames ({listed}); the <{tag}> output format (and its rewards) "
                "holds one key frame: keep one frameN per record",
            )
        if task == "segment" and any(len(points) != 2 for _, points in frames):
            raise RowError("assistant", "a 'segment' answer needs exactly 2 points (min, max) per frame")
        if task == "affordance" and any(len(points) != 1 for _, points in frames):
            raise RowError("assistant", "an 'affordance' answer needs exactly 1 point per frame")
        ((n, points),) = frames
        return (
            f"<{tag}><frame {n}> "
            + ", ".join(f"({format_number(x)}, {format_number(y)})" for x, y in points)
            + f"</{tag}>"
        )
    if task == "counting":
        return f"<{tag}>{_count(items)}</{tag}>"
    text = "".join(_texts(items)).strip()
    if not text:
        raise RowError("assistant", "empty answer")
    return text


def wrap_answer(body: str) -> str:
    return body if "<answer>" in body else f"<answer>{body}</answer>"


# --------------------------------------------------------------------------- records


@dataclass
class Converted:
    task: str
    rl: dict
    cot: dict | None  # None when only the RL stage is written


@dataclass
class PreprocessResult:
    written: dict[str, Path] = field(default_factory=dict)  # "train/trajectory_rl" -> path
    counts: dict[str, int] = field(default_factory=dict)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)


def _role(turn: dict) -> str:
    return str(turn.get("role", "")).strip().lower()


def _expand_frames(items: list, field_name: str) -> list:
    """Video items with a list of frames become one image item per frame; video files are refused."""
    out = []
    for j, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "video":
            frames = item.get("video")
            if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
                raise RowError(
                    f"{field_name}[{j}]", "video items must list their frames (extract frames from video files first)"
                )
            out.extend({"type": "image", "image": f} for f in frames)
        else:
            out.append(item)
    return out


def convert_record(
    raw: Any,
    *,
    index: int,
    task_type: str | None = None,
    data_source: str | None = None,
    simple: bool = False,
    keep_images: bool = False,
    system_prompt: str | None = None,
    format_hint: bool = True,
    cot_layout: str = "auto",
    need_cot: bool = True,
) -> Converted:
    """One raw record -> (GRPO row, SFT row). Raises :class:`RowError` naming what is wrong.

    ``need_cot=False`` (only the RL stage is written): no SFT row is built, so a record without a ``Thinking``
    turn is fine -- the RL stage needs no chain of thought.

    ``cot_layout``: ``rynnbrain`` = ``{Thinking}\\n#### {solution}``, ``think`` =
    ``<think>{Thinking}</think>{solution}``; ``auto`` = ``rynnbrain`` for converted RynnBrain records,
    ``think`` for rows that were already in a supported format.
    """
    if cot_layout not in COT_LAYOUTS:
        raise ValueError(f"cot_layout must be one of {COT_LAYOUTS}, got {cot_layout!r}")
    if not isinstance(raw, dict):
        raise RowError("<row>", f"a record must be a JSON object, got {type(raw).__name__}")
    task = canonical_task(raw.get("task_type") if isinstance(raw.get("task_type"), str) else task_type)
    known = set(TASK_TAGS) | _package_tasks()
    if task is None:
        raise RowError("task_type", "no task type: pass --task_type or give rows a 'task_type'")
    if task not in known:
        raise RowError("task_type", f"unknown task type '{task}' (known: {', '.join(sorted(known))})")
    data_source = data_source or task
    row_id = raw.get("id", f"{data_source}-{index}")
    conversation = raw.get("conversation")
    if not (isinstance(conversation, list) and task in TASK_TAGS):
        # a row of a supported format (VLM-R1, EasyR1, ...): normalised, solution verbatim
        row = normalise_row(raw)
        common = {
            "system": (system_prompt if system_prompt is not None else row["system"]) or None,
            "row_id": row_id,
            "task_type": task,
            "accu_reward_method": row["accu_reward_method"],
            "data_source": data_source,
        }
        thinking = _thinking_text(conversation) if isinstance(conversation, list) else raw.get("thinking")
        layout = "think" if cot_layout == "auto" else cot_layout
        rl = vlm_r1_row(row["question"], row["solution"], row["image_path"], **common)
        if not need_cot:
            return Converted(task, rl, None)
        cot_answer = _cot_answer(row["solution"], thinking, simple, layout)
        return Converted(task, rl, vlm_r1_row(row["question"], cot_answer, row["image_path"], **common))

    user = next((t for t in conversation if isinstance(t, dict) and _role(t) == "user"), None)
    if user is None:
        raise RowError("conversation", "no 'user' turn")
    assistant = next((t for t in conversation if isinstance(t, dict) and _role(t) == "assistant"), None)
    if assistant is None:
        raise RowError("conversation", "no 'assistant' turn")
    system = next((t for t in conversation if isinstance(t, dict) and _role(t) == "system"), None)
    thinking_turn = next((t for t in conversation if isinstance(t, dict) and _role(t) in ("thinking", "think")), None)

    user_items = user.get("content")
    user_items = [{"type": "text", "text": user_items}] if isinstance(user_items, str) else list(user_items or [])
    user_items = _expand_frames(user_items, "conversation.user.content")
    if keep_images and thinking_turn is not None and isinstance(thinking_turn.get("content"), list):
        user_items += [i for i in thinking_turn["content"] if isinstance(i, dict) and i.get("type") == "image"]
    hint = FORMAT_HINTS.get(task) if format_hint else None
    if hint and not any("output format" in t.lower() or hint in t for t in _texts(user_items)):
        last = next((i for i in reversed(range(len(user_items))) if _texts(user_items[i])), None)
        if last is not None:
            user_items[last] = {"type": "text", "text": _texts(user_items[last])[0].rstrip()}
        user_items.append({"type": "text", "text": ("\n" if last is not None else "") + hint})

    solution = wrap_answer(answer_body(assistant.get("content"), task))
    problem = coordinate_problem(solution) if task in COORDINATE_TASKS else None
    if problem:
        raise RowError("assistant", problem)
    # the user turn is read by the package's one RynnBrain reader, so GRPO sees exactly these rows
    row = normalise_row({"conversation": [{"role": "user", "content": user_items}], "solution": solution})
    if system_prompt is not None:
        system_text = system_prompt
    elif system is not None:
        system_text = "".join(_texts(system.get("content"))).strip()
    else:
        system_text = system_prompts().get(task, "")
    thinking = "".join(_texts(thinking_turn.get("content"))).strip() if thinking_turn is not None else None
    layout = "rynnbrain" if cot_layout == "auto" else cot_layout
    common = {"system": system_text or None, "row_id": row_id, "task_type": task, "data_source": data_source}
    rl = vlm_r1_row(row["question"], solution, row["image_path"], **common)
    if not need_cot:
        return Converted(task, rl, None)
    cot = vlm_r1_row(row["question"], _cot_answer(solution, thinking, simple, layout), row["image_path"], **common)
    return Converted(task, rl, cot)


def _thinking_text(conversation: list) -> str | None:
    turn = next((t for t in conversation if isinstance(t, dict) and _role(t) in ("thinking", "think")), None)
    return "".join(_texts(turn.get("content"))).strip() if turn is not None else None


def _cot_answer(solution: str, thinking: str | None, simple: bool, layout: str) -> str:
    if "<think>" in solution or "####" in solution:  # already a full answer
        return solution
    if not simple and not thinking:
        raise RowError("Thinking", "no 'Thinking' turn for the chain of thought (pass --simple for answer-only rows)")
    if layout == "rynnbrain":
        return f"#### {solution}" if simple else f"{thinking}\n#### {solution}"
    return solution if simple else f"<think>{thinking}</think>{solution}"


def _package_tasks() -> set[str]:
    from vlm_grpo.modules.base import DEFAULT_TEMPLATES

    return set(DEFAULT_TEMPLATES)


def split_indices(n: int, train_percent: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded shuffle, first ``round(n * train_percent / 100)`` to train; each part in file order."""
    if not 0 <= train_percent <= 100:
        raise ValueError(f"--train_split must be a percentage in [0, 100], got {train_percent}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = round(n * train_percent / 100)
    return sorted(order[:cut]), sorted(order[cut:])


def preprocess(
    input_paths: Sequence[str | Path],
    output_dir: str | Path,
    *,
    task_type: str | None = None,
    data_source: str | None = None,
    train_split: float = 100.0,
    seed: int = 42,
    stages: Sequence[str] = ("rl", "cot"),
    simple: bool = False,
    keep_images: bool = False,
    system_prompt: str | None = None,
    format_hint: bool = True,
    cot_layout: str = "auto",
    output_format: str = "jsonl",
    skip_bad_rows: bool = False,
    overwrite: bool = False,
) -> PreprocessResult:
    """Convert, split and write; bad records are collected (all of them) and stop the run unless skipped."""
    result = PreprocessResult()
    records: list[Record] = [r for path in input_paths for r in iter_records(path)]
    converted: list[Converted] = []
    for index, record in enumerate(records):
        if record.error:
            result.bad.append((record.source, record.error))
            continue
        try:
            converted.append(
                convert_record(
                    record.value,
                    index=index,
                    task_type=task_type,
                    data_source=data_source,
                    simple=simple,
                    keep_images=keep_images,
                    system_prompt=system_prompt,
                    format_hint=format_hint,
                    cot_layout=cot_layout,
                    need_cot="cot" in stages,
                )
            )
        except RowError as exc:
            result.bad.append((record.source, f"field '{exc.field}': {exc}"))
    if result.bad and not skip_bad_rows:
        return result
    train, test = split_indices(len(converted), train_split, seed)
    parts: dict[str, list[dict]] = defaultdict(list)
    for split, indices in (("train", train), ("test", test)):
        for i in indices:
            item = converted[i]
            for stage in stages:
                parts[f"{split}/{item.task}_{stage}_{split}"].append(getattr(item, stage))
    out = Path(output_dir).expanduser()
    targets = {key: out / f"{key}.{output_format}" for key in sorted(parts)}
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"Refusing to overwrite {', '.join(existing)} (pass -y / --yes to overwrite)")
    for key, path in targets.items():
        result.written[key] = write_rows(path, parts[key])
        result.counts[key] = len(parts[key])
    return result
