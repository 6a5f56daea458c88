"""Merge per-task files (``train/*.jsonl``, ``test/*.parquet``, ...) into ``train.*`` / ``test.*``.

The per-task files stay where they are. Files named in the preprocess layout (``<task>_<stage>_<split>.*``)
are merged one stage at a time (``--stage rl`` / ``--stage cot``); a folder holding several stages is
refused without ``--stage``. Files are merged only when their schemas agree: one file type,
one row format (VLM-R1 / RynnBrain / EasyR1), and every column of one kind in all files (a column
that is a string in one file and a list in another is a conflict, reported with both files). Columns
missing from some files are allowed (absent there).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo.data.formats import RowError, detect_format
from vlm_grpo.data.records import SUPPORTED_SUFFIXES, iter_records, write_rows


class SchemaConflict(ValueError):
    """Files that cannot be merged into one, with the reason."""


def _kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


@dataclass
class FileSchema:
    path: Path
    row_format: str | None = None
    columns: dict[str, str] = field(default_factory=dict)  # column -> kind
    rows: list[dict] = field(default_factory=list)


def file_schema(path: Path) -> FileSchema:
    schema = FileSchema(path)
    for record in iter_records(path):
        if record.error:
            raise SchemaConflict(f"{record.source}: {record.error}; fix the file before merging")
        row = record.value
        if not isinstance(row, dict):
            raise SchemaConflict(f"{record.source}: a row must be a JSON object, got {type(row).__name__}")
        try:
            row_format = detect_format(row)
        except RowError as exc:
            raise SchemaConflict(f"{record.source}: {exc}") from None
        if schema.row_format not in (None, row_format):
            raise SchemaConflict(f"{record.source}: a {row_format} row in a file of {schema.row_format} rows")
        schema.row_format = row_format
        for column, value in row.items():
            kind = _kind(value)
            if kind is None:
                continue
            seen = schema.columns.setdefault(column, kind)
            if seen != kind:
                raise SchemaConflict(
                    f"{record.source}: column '{column}' is a {kind} here but a {seen} in earlier rows"
                )
        schema.rows.append(row)
    return schema


def check_compatible(schemas: Sequence[FileSchema]) -> None:
    suffixes = {s.path.suffix.lower() for s in schemas}
    if len(suffixes) > 1:
        raise SchemaConflict(
            "Cannot merge files of different types ("
            + ", ".join(f"{s.path.name}" for s in schemas)
            + "); convert them to one type first"
        )
    formats = {s.row_format for s in schemas if s.row_format}
    if len(formats) > 1:
        shown = "; ".join(f"{s.path}: {s.row_format}" for s in schemas if s.row_format)
        raise SchemaConflict(f"Schema conflict: files hold different row formats ({shown})")
    first: dict[str, tuple[str, Path]] = {}
    for schema in schemas:
        for column, kind in schema.columns.items():
            if column not in first:
                first[column] = (kind, schema.path)
            elif first[column][0] != kind:
                seen_kind, seen_path = first[column]
                raise SchemaConflict(
                    f"Schema conflict in column '{column}': {seen_kind} in {seen_path} but {kind} in {schema.path}. "
                    "Make the column the same type in every file (or rename it) and merge again."
                )


@dataclass
class MergeResult:
    written: dict[str, Path] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, list[Path]] = field(default_factory=dict)


_STAGE_NAME = re.compile(r".+_(?P<stage>[A-Za-z0-9]+)_(?P<split>[A-Za-z0-9]+)")


def file_stage(path: Path) -> str | None:
    """``trajectory_rl_train.jsonl`` -> ``rl`` (the preprocess layout ``<task>_<stage>_<split>``), else None."""
    match = _STAGE_NAME.fullmatch(path.stem)
    return match.group("stage") if match and match.group("split") == path.parent.name else None


def split_files(input_dir: Path, split: str, stage: str | None = None) -> list[Path]:
    folder = input_dir / split
    if not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
    if stage is not None:
        return [p for p in files if file_stage(p) == stage]
    stages = sorted({s for s in map(file_stage, files) if s})
    if len(stages) > 1:
        raise SchemaConflict(
            f"{folder} holds files of several stages ({', '.join(stages)}): merge one at a time with "
            f"--stage {stages[0]} (and its own --output_dir)"
        )
    return files


def merge(
    input_dir: str | Path,
    output_dir: str | Path | None = None,
    *,
    splits: Sequence[str] = ("train", "test"),
    stage: str | None = None,
    overwrite: bool = False,
) -> MergeResult:
    """``input_dir/<split>/*`` -> ``output_dir/<split>.<ext>`` for each split that has files."""
    input_dir = Path(input_dir).expanduser()
    output_dir = Path(output_dir).expanduser() if output_dir else input_dir
    plans: dict[str, tuple[Path, list[FileSchema]]] = {}
    for split in splits:
        files = split_files(input_dir, split, stage)
        if not files:
            continue
        schemas = [file_schema(p) for p in files]
        check_compatible(schemas)
        plans[split] = (output_dir / f"{split}{files[0].suffix.lower()}", schemas)
    if not plans:
        raise FileNotFoundError(
            f"No data files under {input_dir}/{{{','.join(splits)}}}/ (expected *{', *'.join(SUPPORTED_SUFFIXES)})"
        )
    existing = [str(target) for target, _ in plans.values() if target.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"Refusing to overwrite {', '.join(existing)} (pass -y / --yes to overwrite)")
    result = MergeResult()
    for split, (target, schemas) in plans.items():
        rows = [row for schema in schemas for row in schema.rows]
        result.written[split] = write_rows(target, rows)
        result.counts[split] = len(rows)
        result.inputs[split] = [s.path for s in schemas]
    return result
