"""Row files of every supported kind (JSONL, JSON, parquet): read, written, and checked through ``read_rows``.

``read_rows`` (``jsonl.py``) is the one validator of the package and reads JSONL. The data commands, SFT
and evaluation also accept a JSON list (or a JSON object of records) and parquet: such a file is spilled
to a temporary JSONL, one record a line, validated by ``read_rows`` there, and every source is mapped back
to the original file, so bad rows are still reported as ``file:line`` (JSON: the line where the record
starts; parquet: the 1-based row number).

Rows are written in the package's canonical file format: VLM-R1 rows with an optional system turn, e.g.::

    {"id": "...", "image": ["a.jpg"], "conversations": [{"from": "system", "value": "..."},
     {"from": "human", "value": "<image>..."}, {"from": "gpt", "value": "<answer>...</answer>"}],
     "task_type": "counting"}
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_grpo.data.formats import DataError
from vlm_grpo.data.jsonl import BadRow, build_messages, check_data_file, iter_lines, pair_files_and_folders, read_rows

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Record:
    """One raw record of a file: its location (``file:line``) and the parsed object, or why it did not parse."""

    source: str
    value: Any = None
    error: str | None = None


def file_kind(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        expected = ", ".join(SUPPORTED_SUFFIXES)
        raise DataError(f"unsupported file type '{suffix}' (expected one of {expected})", str(path))
    return suffix[1:]


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _json_records(path: Path) -> Iterator[Record]:
    """Records of a JSON list (or of a JSON object mapping ids to records), each with the line it starts on."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        yield Record(f"{path}:{line}", error=f"not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8")
        return
    if not text.strip():
        return  # an empty file: read_rows names it
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        yield Record(f"{path}:{exc.lineno}", error=f"bad JSON: {exc.msg} at column {exc.colno}")
        return
    mapping = isinstance(data, dict) and not any(k in data for k in ("conversations", "conversation", "problem"))
    if mapping:  # {"id": record, ...} (VQA-X style): keep the key as the record id when it has none
        items = [
            ({"id": key, **value} if isinstance(value, dict) and "id" not in value else value)
            for key, value in data.items()
        ]
    elif isinstance(data, list):
        items = data
    else:  # one record
        items = [data]
    # Line numbers: walk the top-level container with raw_decode, element by element.
    decoder = json.JSONDecoder()
    starts: list[int] = []
    pos = len(text) - len(text.lstrip())
    if (mapping or isinstance(data, list)) and pos < len(text):
        closing = "]" if text[pos] == "[" else "}"
        pos += 1
        while len(starts) < len(items):
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] == closing:
                break
            if closing == "}":  # skip `"key":`
                _, pos = decoder.raw_decode(text, pos)
                while text[pos] in " \t\r\n:":
                    pos += 1
            starts.append(pos)
            _, pos = decoder.raw_decode(text, pos)
    if len(starts) != len(items):
        starts = [pos if not (mapping or isinstance(data, list)) else 0] * len(items)
    for item, start in zip(items, starts, strict=True):
        yield Record(f"{path}:{_line_of(text, start)}", value=item)


def iter_records(path: str | Path) -> Iterator[Record]:
    """Every record of a JSONL / JSON / parquet file, with its ``file:line`` (parquet: ``file:row``)."""
    path = Path(path)
    check_data_file(str(path))
    kind = file_kind(path)
    if kind == "jsonl":
        for lineno, line, problem in iter_lines(str(path)):
            if line is None:
                yield Record(f"{path}:{lineno}", error=problem)
                continue
            try:
                yield Record(f"{path}:{lineno}", value=json.loads(line))
            except json.JSONDecodeError as exc:
                yield Record(f"{path}:{lineno}", error=f"bad JSON: {exc.msg} at column {exc.colno}")
    elif kind == "json":
        yield from _json_records(path)
    else:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow's errors (ArrowInvalid, OSError) for a damaged or non-parquet file
            raise DataError(f"not a readable parquet file: {exc}", str(path)) from None
        for index, row in enumerate(table.to_pylist(), start=1):
            yield Record(f"{path}:{index}", value=_drop_nulls(row))


def _drop_nulls(value: Any) -> Any:
    """Parquet gives every row every column (None where absent) and struct fields likewise: drop those Nones,
    so a row reads back as it was written."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def read_any_rows(
    data_file_paths: str | Sequence[str],
    image_folders: str | Sequence[str] | None = None,
    **kwargs: Any,
) -> tuple[list[dict], list[BadRow]]:
    """``read_rows`` for JSONL, JSON and parquet files alike; sources always point into the original files."""
    rows: list[dict] = []
    bad: list[BadRow] = []
    for file, folder in pair_files_and_folders(data_file_paths, image_folders):
        check_data_file(file)
        if file_kind(file) == "jsonl":
            good, wrong = read_rows([file], [str(folder)], **kwargs)
        else:
            good, wrong = _read_via_jsonl(file, str(folder), **kwargs)
        rows.extend(good)
        bad.extend(wrong)
    return rows, bad


def _read_via_jsonl(file: str, folder: str, **kwargs: Any) -> tuple[list[dict], list[BadRow]]:
    records = list(iter_records(file))
    with tempfile.TemporaryDirectory(prefix="vlm_grpo_rows_") as tmp:
        spill = os.path.join(tmp, "rows.jsonl")
        with open(spill, "w", encoding="utf-8") as handle:
            for record in records:
                # a record that did not parse stays a bad line, so read_rows reports it in its place
                handle.write("{\n" if record.error else json.dumps(record.value, ensure_ascii=False) + "\n")
        good, wrong = read_rows([spill], [folder], **kwargs)

    def original(source: str) -> str:
        return records[int(source.rpartition(":")[2]) - 1].source

    for row in good:
        row["source"] = original(row["source"])
    wrong = [
        BadRow(file, b.field, b.reason)
        if b.field == "<file>"
        else BadRow(original(b.source), b.field, records[int(b.source.rpartition(":")[2]) - 1].error or b.reason)
        for b in wrong
    ]
    return good, wrong


def vlm_r1_row(
    question: str,
    solution: str,
    images: Sequence[str] | str | None = None,
    *,
    system: str | None = None,
    row_id: Any = None,
    task_type: str | None = None,
    accu_reward_method: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A row in the canonical file format (VLM-R1 with an optional system turn); ``None`` fields are left out."""
    conversations = [{"from": "system", "value": system}] if system else []
    conversations += [{"from": "human", "value": question}, {"from": "gpt", "value": solution}]
    row: dict[str, Any] = {}
    if row_id is not None:
        row["id"] = row_id
    row["image"] = list(images) if isinstance(images, (list, tuple)) else images if images else []
    row["conversations"] = conversations
    if task_type is not None:
        row["task_type"] = task_type
    if accu_reward_method is not None:
        row["accu_reward_method"] = accu_reward_method
    row.update({k: v for k, v in extra.items() if v is not None})
    return row


def write_rows(path: str | Path, rows: Sequence[dict]) -> Path:
    """Write rows as JSONL, a JSON list or parquet (by the suffix); creates the parent folder."""
    path = Path(path)
    kind = file_kind(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    if kind == "jsonl":
        with open(tmp, "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    elif kind == "json":
        tmp.write_text(json.dumps(list(rows), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    os.replace(tmp, path)
    return path


def sft_messages(row: dict, template: str, with_images: bool = True) -> list[dict[str, Any]]:
    """The GRPO prompt of a row (``build_messages``) answered by its solution: what SFT trains on."""
    answer = {"role": "assistant", "content": [{"type": "text", "text": row["solution"]}]}
    return [*build_messages(row, template, with_images=with_images), answer]
