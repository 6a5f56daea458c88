"""Image-path JSONL datasets: checked up front, decoded lazily.

Every row is validated before training starts (JSON, fields, image files, ``<image>`` count,
prompt length) and problems are reported together with ``file:line``. The dataset then holds
only paths and sizes; pixels are decoded when the trainer asks for a sample.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vlm_grpo.data.formats import IMAGE_TOKEN, RowError, count_placeholders, normalise_row

logger = logging.getLogger(__name__)

MAX_REPORTED = 20


@dataclass(frozen=True)
class BadRow:
    source: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: field '{self.field}': {self.reason}"


class DataValidationError(ValueError):
    """Raised with every bad row listed (first ``MAX_REPORTED``) and the total count."""

    def __init__(self, bad_rows: Sequence[BadRow], total_rows: int) -> None:
        self.bad_rows = list(bad_rows)
        shown = "\n".join(f"  {b}" for b in self.bad_rows[:MAX_REPORTED])
        more = len(self.bad_rows) - MAX_REPORTED
        super().__init__(
            f"Found {len(self.bad_rows)} bad row(s) out of {total_rows} "
            f"(showing the first {min(len(self.bad_rows), MAX_REPORTED)}):\n{shown}"
            + (f"\n  ... and {more} more" if more > 0 else "")
            + "\nFix these rows, or pass --skip_bad_rows to skip them (the skipped count is logged)."
        )


def split_paths(value: str | Sequence[str] | None) -> list[str]:
    """VLM-R1's ``a.jsonl:b.jsonl`` convention; lists (from YAML) pass through."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return [p for item in items for p in str(item).split(":") if p]


def _resolve_image(path: str, folder: Path) -> str:
    if path.startswith("data:image/") or os.path.isabs(path):
        return path
    return str(folder / path)


def open_image(path: str) -> Image.Image:
    """A file path or a ``data:image/...;base64,`` URI (EasyR1 rows carry those)."""
    if path.startswith("data:image/"):
        return Image.open(io.BytesIO(base64.b64decode(path.split(",", 1)[1])))
    return Image.open(path)


def _image_size(path: str) -> tuple[int, int]:
    """Reads only the header: no pixels are decoded while validating."""
    with open_image(path) as image:
        return image.size


def _check_images(row: dict, source: str) -> BadRow | None:
    for path in row["image_path"]:
        if not path.startswith("data:image/") and not os.path.isfile(path):
            return BadRow(source, "image", f"image file not found: {path}")
    try:
        row["image_sizes"] = [list(_image_size(p)) for p in row["image_path"]]
    except Exception as exc:
        return BadRow(source, "image", f"unreadable image: {exc}")
    return None


def pair_files_and_folders(
    data_file_paths: str | Sequence[str], image_folders: str | Sequence[str] | None
) -> list[tuple[str, Path]]:
    """(data file, image folder) pairs: one folder per file, one for all, or each file's own folder."""
    files = split_paths(data_file_paths)
    folders = split_paths(image_folders)
    if not files:
        raise ValueError("No data files given: pass --data_file_paths a.jsonl[:b.jsonl]")
    if folders and len(folders) not in (1, len(files)):
        raise ValueError(
            f"--image_folders has {len(folders)} entries for {len(files)} data files; give one per file or one for all"
        )
    return [
        (file, Path(folders[index if len(folders) > 1 else 0]) if folders else Path(file).parent)
        for index, file in enumerate(files)
    ]


def read_rows(
    data_file_paths: Sequence[str],
    image_folders: Sequence[str] | None = None,
    *,
    reward_method: str | None = None,
    task_type: str | None = None,
    num_threads: int = 8,
) -> tuple[list[dict], list[BadRow]]:
    """Parse and check every row of every file; returns (good rows, bad rows)."""
    rows: list[dict] = []
    bad: list[BadRow] = []
    for file, folder in pair_files_and_folders(data_file_paths, image_folders):
        if not os.path.isfile(file):
            raise FileNotFoundError(f"Data file not found: {file}")
        with open(file, encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                source = f"{file}:{lineno}"
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    bad.append(BadRow(source, "<json>", f"bad JSON: {exc.msg} at column {exc.colno}"))
                    continue
                try:
                    row = normalise_row(raw)
                except RowError as exc:
                    bad.append(BadRow(source, exc.field, str(exc)))
                    continue
                n_markers = count_placeholders(row["question"])
                if n_markers != len(row["image_path"]):
                    bad.append(
                        BadRow(
                            source,
                            "image",
                            f"the prompt has {n_markers} '{IMAGE_TOKEN}' placeholder(s) but the row has "
                            f"{len(row['image_path'])} image(s)",
                        )
                    )
                    continue
                row["image_path"] = [_resolve_image(p, folder) for p in row["image_path"]]
                row["accu_reward_method"] = row["accu_reward_method"] or reward_method
                row["task_type"] = row["task_type"] or task_type
                row["source"] = source
                rows.append(row)
    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        image_errors = list(pool.map(lambda r: _check_images(r, r["source"]), rows))
    bad.extend(e for e in image_errors if e is not None)
    good = [r for r, e in zip(rows, image_errors, strict=True) if e is None]
    return good, sorted(bad, key=_source_order)


def _source_order(b: BadRow) -> tuple[str, int]:
    file, _, line = b.source.rpartition(":")
    return (file, int(line) if line.isdigit() else 0)


# --------------------------------------------------------------------------- prompts


def build_messages(row: dict, template: str, with_images: bool = True) -> list[dict[str, Any]]:
    """Chat messages with an image item exactly where each ``<image>`` marker stands."""
    text = template.replace("{question}", row["question"])
    content: list[dict[str, Any]] = []
    for i, chunk in enumerate(text.split(IMAGE_TOKEN)):
        if i > 0 and with_images:
            content.append({"type": "image"})
        if chunk.strip():
            content.append({"type": "text", "text": chunk.strip()})
    messages = []
    if row.get("system"):
        messages.append({"role": "system", "content": [{"type": "text", "text": row["system"]}]})
    messages.append({"role": "user", "content": content})
    return messages


def question_template(row: dict, module: Any) -> str:
    """The family's task template, or the question as is when ``--format_prompt`` rendered it."""
    return "{question}" if row.get("format_prompt") else module.question_template(row.get("task_type"))


class LazyImageTransform:
    """``datasets`` transform: adds ``prompt`` (chat messages) and ``images`` (decoded RGB) on access."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out = dict(batch)
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        out["prompt"] = [build_messages(r, question_template(r, self.module)) for r in rows]
        out["images"] = [[open_image(p).convert("RGB") for p in r["image_path"]] for r in rows]
        return out


def prompt_lengths(rows: Sequence[dict], module: Any, processor: Any, batch_size: int = 256) -> list[int]:
    """Prompt tokens (text after the chat template + image tokens) without decoding any pixels."""
    lengths: list[int] = []
    tokenizer = getattr(processor, "tokenizer", processor)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        texts = [
            processor.apply_chat_template(
                build_messages(r, question_template(r, module), with_images=False),
                tokenize=False,
                add_generation_prompt=True,
            )
            for r in chunk
        ]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        for r, tok in zip(chunk, ids, strict=True):
            lengths.append(len(tok) + sum(module.num_image_tokens(processor, w, h) for w, h in r["image_sizes"]))
    return lengths


def prepare_rows(
    rows: list[dict],
    bad: list[BadRow],
    module: Any,
    processor: Any,
    *,
    max_prompt_length: int | None = None,
    skip_bad_rows: bool = False,
) -> list[dict]:
    """Add model-dependent columns, apply the prompt-length limit, then fail or skip on bad rows."""
    for row in rows:
        row["coord_sizes"] = [list(module.coord_size(processor, w, h)) for w, h in row["image_sizes"]]
    kept = rows
    if max_prompt_length is not None and rows:
        lengths = prompt_lengths(rows, module, processor)
        kept = []
        for row, length in zip(rows, lengths, strict=True):
            if length > max_prompt_length:
                bad.append(
                    BadRow(
                        row["source"],
                        "prompt",
                        f"prompt is {length} tokens (text + image tokens), longer than "
                        f"--max_prompt_length {max_prompt_length}",
                    )
                )
            else:
                kept.append(row)
        bad.sort(key=_source_order)
    total = len(rows) + len([b for b in bad if b.field != "prompt"])
    if bad:
        if not skip_bad_rows:
            raise DataValidationError(bad, total)
        logger.warning(
            "Skipped %d bad row(s) out of %d (--skip_bad_rows). First ones:\n%s",
            len(bad),
            total,
            "\n".join(f"  {b}" for b in bad[:MAX_REPORTED]),
        )
    if not kept:
        raise ValueError("No usable rows left in the training data")
    return kept


def to_datasets(rows: list[dict], module: Any, val_split_ratio: float = 0.0, seed: int = 42):
    """(train, eval or None): ``datasets.Dataset`` objects of paths whose samples decode images on access."""
    from datasets import Dataset

    columns = (
        "id",
        "question",
        "system",
        "solution",
        "image_path",
        "image_sizes",
        "coord_sizes",
        "accu_reward_method",
        "task_type",
        "source",
        "format_prompt",
    )
    dataset = Dataset.from_dict({c: [r.get(c) for r in rows] for c in columns})
    dataset = _with_extra_columns(dataset, rows)
    transform = LazyImageTransform(module)
    if not val_split_ratio:
        return dataset.with_transform(transform), None
    if not 0 < val_split_ratio < 1:
        raise ValueError(f"--val_split_ratio must be in [0, 1), got {val_split_ratio}")
    split = dataset.train_test_split(test_size=val_split_ratio, seed=seed)
    return split["train"].with_transform(transform), split["test"].with_transform(transform)


def _with_extra_columns(dataset: Any, rows: list[dict]) -> Any:
    """A row's own columns beyond the canonical ones (verl's ``data_source``, ``extra_info``, ...; see
    ``data/sources.py``) as ``Json`` columns, so rewards receive them exactly as written (None where absent)."""
    from datasets import Json

    feature = Json()
    for name in sorted({k for r in rows for k in r.get("extra") or {}}):
        values = [feature.encode_example((r.get("extra") or {}).get(name)) for r in rows]
        dataset = dataset.add_column(name, values, feature=feature)
    return dataset
