"""``check`` (validate a data file the way training will read it) and ``format`` (write it canonically).

Both read through ``read_any_rows`` -> ``read_rows`` (JSON, fields, image files, ``<image>`` count) and,
with a model, ``prepare_rows`` (coordinate frames, ``--max_prompt_length``): the checks training runs,
not a second implementation. ``check`` adds what only a data tool needs: task types the package does not
know, coordinates outside 0-1000, and statistics (image tokens, text lengths, rows per task).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo.data.chatml import chatml_row
from vlm_grpo.data.images import ImageError, decode_rgb, pixel_limit
from vlm_grpo.data.jsonl import BadRow, _source_order, prompt_lengths, row_image_tokens, validate_rows
from vlm_grpo.data.preprocess import TASK_TAGS, canonical_task, coordinate_problem
from vlm_grpo.data.records import iter_records, read_any_rows, sft_messages, vlm_r1_row, write_rows
from vlm_grpo.data.sources import read_sources

logger = logging.getLogger(__name__)


def known_task_types(module: Any = None, extra: Sequence[str] = ()) -> set[str]:
    """Task types some part of the package understands: question templates, RynnBrain tasks, the reward
    module's prompts (when present), the model family's own templates, and ``extra``."""
    from vlm_grpo.data.preprocess import system_prompts
    from vlm_grpo.modules.base import DEFAULT_TEMPLATES

    known = set(DEFAULT_TEMPLATES) | set(TASK_TAGS) | set(system_prompts()) | set(extra)
    if module is not None:
        known |= set(getattr(module, "templates", {}) or {})
    return known


def distribution(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

    return {
        "count": len(ordered),
        "min": ordered[0],
        "mean": round(sum(ordered) / len(ordered), 2),
        "p50": pct(50),
        "p90": pct(90),
        "p99": pct(99),
        "max": ordered[-1],
    }


@dataclass
class CheckReport:
    files: list[str]
    rows: int = 0
    bad: list[BadRow] = field(default_factory=list)
    per_task: dict[str, int] = field(default_factory=dict)
    bad_per_task: dict[str, int] = field(default_factory=dict)
    images: int = 0
    image_tokens: dict[str, float] = field(default_factory=dict)
    text_length: dict[str, float] = field(default_factory=dict)
    text_length_unit: str = "characters"
    model: str | None = None
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (row, the earlier row it repeats)

    @property
    def ok(self) -> bool:
        return not self.bad

    def as_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "model": self.model,
            "rows": self.rows,
            "good_rows": self.rows - len(self.bad),
            "bad_rows": len(self.bad),
            "bad": [{"source": b.source, "field": b.field, "reason": b.reason} for b in self.bad],
            "per_task": self.per_task,
            "bad_per_task": self.bad_per_task,
            "images": self.images,
            "duplicates": [{"source": a, "repeats": b} for a, b in self.duplicates],
            "image_tokens_per_row": self.image_tokens,
            f"text_length_{self.text_length_unit}": self.text_length,
        }

    def render(self, max_report: int = 50) -> str:
        lines = [
            f"Checked {self.rows} row(s) in {len(self.files)} file(s)" + (f" for {self.model}" if self.model else "")
        ]
        if self.bad:
            lines.append(f"BAD ROWS: {len(self.bad)}")
            lines += [f"  {b}" for b in self.bad[:max_report]]
            if len(self.bad) > max_report:
                lines.append(f"  ... and {len(self.bad) - max_report} more (--max_report N shows more)")
        lines.append("Rows per task (good / bad):")
        for task in sorted(set(self.per_task) | set(self.bad_per_task)):
            lines.append(f"  {task:<16} {self.per_task.get(task, 0):>7} / {self.bad_per_task.get(task, 0)}")
        lines.append(f"Images: {self.images}")
        if self.duplicates:
            lines.append(
                f"Duplicates (trained on as often as they appear): {len(self.duplicates)} row(s) repeat an earlier row"
            )
            lines += [f"  {a} repeats {b}" for a, b in self.duplicates[:max_report]]
        if self.image_tokens:
            lines.append("Image tokens per row: " + _fmt(self.image_tokens))
        lines.append(f"Text length ({self.text_length_unit}): " + _fmt(self.text_length))
        lines.append("RESULT: " + ("OK" if self.ok else f"{len(self.bad)} bad row(s)"))
        return "\n".join(lines)


def _fmt(dist: dict[str, float]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dist.items())


def load_module_and_processor(model: str, vlm_module: str | None = None, **limits: Any) -> tuple[Any, Any]:
    from vlm_grpo.modules import ImageLimits, get_vlm_module

    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().is_dir():
        raise ValueError(f"--model {model}: no such folder (a local model folder or a Hub id)")
    module = get_vlm_module(model, vlm_module, ImageLimits(**limits))
    return module, module.load_processor(model)


def semantic_problems(rows: list[dict], known: set[str]) -> tuple[list[dict], list[BadRow]]:
    """Rows with a task type nobody knows, or coordinates outside 0-1000."""
    good, bad = [], []
    for row in rows:
        task = row.get("task_type")
        if task is not None and canonical_task(task) not in known:
            bad.append(
                BadRow(row["source"], "task_type", f"unknown task type '{task}' (known: {', '.join(sorted(known))})")
            )
            continue
        problem = coordinate_problem(row["solution"])
        if problem:
            bad.append(BadRow(row["source"], "solution", problem))
            continue
        good.append(row)
    return good, bad


def _task_of_source(paths: Sequence[str]) -> dict[str, str]:
    """source -> task_type of every raw record (to count bad rows per task)."""
    tasks = {}
    for path in paths:
        for record in iter_records(path):
            if isinstance(record.value, dict) and isinstance(record.value.get("task_type"), str):
                tasks[record.source] = record.value["task_type"]
    return tasks


def decode_problems(rows: list[dict], limit: int, num_threads: int = 8) -> tuple[list[dict], list[BadRow]]:
    """Decode every image in full (what training does at draw time): truncated or damaged files are bad rows.

    Training reads only headers up front and skips such a row when it draws it; the check finds them all."""

    def problem(row: dict) -> BadRow | None:
        for i, path in enumerate(row["image_path"]):
            try:
                decode_rgb(path, limit).close()
            except ImageError as exc:
                where = "" if len(row["image_path"]) == 1 else f"image {i + 1} of {len(row['image_path'])}: "
                return BadRow(row["source"], "image", where + str(exc))
        return None

    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        problems = list(pool.map(problem, rows))
    return [r for r, p in zip(rows, problems, strict=True) if p is None], [p for p in problems if p is not None]


def find_duplicates(rows: Sequence[dict]) -> list[tuple[str, str]]:
    """(row, first row) pairs of rows with the same system, question, images and solution."""
    first: dict[tuple, str] = {}
    pairs = []
    for row in rows:
        key = (row.get("system"), row["question"], tuple(row["image_path"]), row["solution"])
        if key in first:
            pairs.append((row["source"], first[key]))
        else:
            first[key] = row["source"]
    return pairs


def check(
    data_file_paths: Sequence[str],
    image_folders: Sequence[str] | None = None,
    *,
    model: str | None = None,
    vlm_module: str | None = None,
    max_prompt_length: int | None = None,
    task_type: str | None = None,
    extra_task_types: Sequence[str] = (),
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    max_anyres_num: int | None = None,
    num_threads: int = 8,
) -> CheckReport:
    files = [str(p) for p in data_file_paths]
    report = CheckReport(files=files, model=model)
    # the same reader as training: JSONL / JSON / parquet (embedded image bytes), saved datasets, verl rows
    rows, bad = read_sources(
        files, image_folders or None, task_type=task_type, num_threads=num_threads, max_pixels=max_pixels
    )
    rows, damaged = decode_problems(rows, pixel_limit(max_pixels), num_threads)
    bad.extend(damaged)
    module = processor = None
    if model:
        module, processor = load_module_and_processor(
            model, vlm_module, min_pixels=min_pixels, max_pixels=max_pixels, max_anyres_num=max_anyres_num
        )
    rows, wrong = semantic_problems(rows, known_task_types(module, extra_task_types))
    bad.extend(wrong)
    if module is not None and rows:  # coord_sizes, the processor's limits and --max_prompt_length, as in training
        rows = validate_rows(rows, bad, module, processor, max_prompt_length=max_prompt_length)
    report.duplicates = find_duplicates(rows)
    report.bad = sorted(bad, key=_source_order)
    report.rows = len(rows) + len(report.bad)
    report.per_task = dict(sorted(Counter(r.get("task_type") or "default" for r in rows).items()))
    raw_tasks = _task_of_source(files) if report.bad else {}
    report.bad_per_task = dict(
        sorted(Counter(raw_tasks.get(b.source) or task_type or "default" for b in report.bad).items())
    )
    report.images = sum(len(r["image_path"]) for r in rows)
    if module is not None:
        tokens = [row_image_tokens(module, processor, r["image_sizes"]) for r in rows]
        report.image_tokens = distribution(tokens)
        report.text_length = distribution(prompt_lengths(rows, module, processor)) if rows else distribution([])
        report.text_length_unit = "prompt tokens, images included"
    else:
        report.text_length = distribution([len(r["question"]) + len(r["solution"]) for r in rows])
    return report


# --------------------------------------------------------------------------- format

_FORMAT_KEYS = {
    "conversations",
    "conversation",
    "problem",
    "answer",
    "images",
    "image",
    "id",
    "system",
    "task_type",
    "accu_reward_method",
    "solution",
    "image_sizes",
    "text_sequence_length",
}


@dataclass
class FormatResult:
    rows: list[dict] = field(default_factory=list)
    bad: list[BadRow] = field(default_factory=list)
    path: Path | None = None


def text_sequence_lengths(rows: Sequence[dict], module: Any, processor: Any, nproc: int = 1) -> list[int]:
    """Tokens of each row's whole conversation (system, prompt, answer) after the chat template, images excluded."""
    tokenizer = getattr(processor, "tokenizer", processor)

    def chunk_lengths(chunk: Sequence[dict]) -> list[int]:
        texts = [
            processor.apply_chat_template(
                sft_messages(r, module.question_template(r.get("task_type")), with_images=False), tokenize=False
            )
            for r in chunk
        ]
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]

    size = max(1, math.ceil(len(rows) / max(1, nproc)))
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    with ThreadPoolExecutor(max_workers=max(1, nproc)) as pool:
        return [n for part in pool.map(chunk_lengths, chunks) for n in part]


FORMAT_LAYOUTS = ("vlm_r1", "chatml")


def format_rows(
    data_file_paths: Sequence[str],
    save_path: str | Path | None,
    *,
    model: str,
    image_folders: Sequence[str] | None = None,
    vlm_module: str | None = None,
    task_type: str | None = None,
    nproc: int | None = None,
    overwrite: bool = False,
    skip_bad_rows: bool = False,
    layout: str = "vlm_r1",
    write: bool = True,
) -> FormatResult:
    """Normalise rows into the canonical format with absolute image paths, ``image_sizes`` ([w, h] each) and
    ``text_sequence_length``; other top-level fields of the input rows are kept. ``layout="chatml"`` writes
    RynnBrain's formatted rows instead (:mod:`vlm_grpo.data.chatml`). ``write=False``: the rows only (no file)."""
    if layout not in FORMAT_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(FORMAT_LAYOUTS)}, got {layout!r}")
    save_path = Path(save_path) if save_path else None
    if write and save_path is None:
        raise ValueError("no output path to write the formatted rows to")
    if write and save_path.exists() and not overwrite:
        raise FileExistsError(f"Refusing to overwrite {save_path} (pass -y / --yes to overwrite)")
    nproc = nproc or os.cpu_count() or 1
    files = [str(p) for p in data_file_paths]
    result = FormatResult()
    rows, result.bad = read_any_rows(files, image_folders or None, task_type=task_type, num_threads=nproc)
    if result.bad and not skip_bad_rows:
        return result
    module, processor = load_module_and_processor(model, vlm_module)
    lengths = text_sequence_lengths(rows, module, processor, nproc)
    raw = {r.source: r.value for path in files for r in iter_records(path) if isinstance(r.value, dict)}
    for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        extra = {k: v for k, v in raw.get(row["source"], {}).items() if k not in _FORMAT_KEYS}
        images = [p if p.startswith("data:") else os.path.abspath(p) for p in row["image_path"]]
        if layout == "chatml":
            source = Path(row["source"].rpartition(":")[0] or row["source"]).stem
            formatted = chatml_row(
                raw.get(row["source"], {}), {**row, "image_path": images}, length, source, index, image_folders or ()
            )
            result.rows.append({**formatted, **{k: v for k, v in extra.items() if k not in formatted}})
            continue
        result.rows.append(
            vlm_r1_row(
                row["question"],
                row["solution"],
                images,
                system=row.get("system"),
                row_id=row.get("id") or None,
                task_type=row.get("task_type"),
                accu_reward_method=row.get("accu_reward_method"),
                image_sizes=row["image_sizes"],
                text_sequence_length=length,
                **extra,
            )
        )
    if write:
        result.path = write_rows(save_path, result.rows)
    return result
