"""Image-path JSONL datasets: checked up front, decoded lazily.

Every row is validated before training starts (JSON, fields, image files, ``<image>`` count,
prompt length) and problems are reported together with ``file:line``. The dataset then holds
only paths and sizes; pixels are decoded when the trainer asks for a sample.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_grpo.data.formats import IMAGE_TOKEN, DataError, RowError, count_placeholders, normalise_row
from vlm_grpo.data.images import ImageError, decode_rgb, image_size, pixel_limit
from vlm_grpo.data.images import open_image as open_image  # re-exported: serve and rewards open images here

logger = logging.getLogger(__name__)

MAX_REPORTED = 20


@dataclass(frozen=True)
class BadRow:
    source: str
    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source}: field '{self.field}': {self.reason}"


class DataValidationError(DataError):
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
    if path.startswith("data:") or os.path.isabs(path):
        return path
    return str(folder / path)


def _check_images(row: dict, source: str, limit: int | None) -> BadRow | None:
    """Header of every image (size, and the pixel limit before anything is decoded)."""
    sizes = []
    for i, path in enumerate(row["image_path"]):
        try:
            sizes.append(list(image_size(path, limit)))
        except ImageError as exc:
            where = "" if len(row["image_path"]) == 1 else f"image {i + 1} of {len(row['image_path'])}: "
            return BadRow(source, "image", where + str(exc))
    row["image_sizes"] = sizes
    return None


def check_data_file(file: str) -> None:
    """A :class:`DataError` for a data file that is missing, a directory or unreadable."""
    if os.path.isdir(file):
        raise DataError("is a directory, not a data file; pass the .jsonl / .json / .parquet files in it", file)
    if not os.path.exists(file):
        raise DataError("data file not found; check the path (':' separates several files)", file)
    if not os.access(file, os.R_OK):
        raise DataError("data file is not readable (permissions)", file)


def iter_lines(file: str) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, None) for each non-blank line of a JSONL file, or (line number, None, why) for a
    line that is not UTF-8. A UTF-8 byte-order mark on line 1 and CRLF line ends are accepted."""
    check_data_file(file)
    with open(file, "rb") as handle:
        for lineno, raw in enumerate(handle, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                byte = f"0x{raw[exc.start]:02x}"
                yield lineno, None, f"not valid UTF-8 (byte {byte} at column {exc.start + 1}); save the file as UTF-8"
                continue
            if text.strip():
                yield lineno, text, None


def pair_files_and_folders(
    data_file_paths: str | Sequence[str], image_folders: str | Sequence[str] | None
) -> list[tuple[str, Path]]:
    """(data file, image folder) pairs: one folder per file, one for all, or each file's own folder."""
    files = split_paths(data_file_paths)
    folders = split_paths(image_folders)
    if not files:
        raise DataError("No data files given: pass --data_file_paths a.jsonl[:b.jsonl]")
    if folders and len(folders) not in (1, len(files)):
        raise DataError(
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
    max_pixels: int | None = None,
) -> tuple[list[dict], list[BadRow]]:
    """Parse and check every row of every file; returns (good rows, bad rows).

    Images are checked from their headers only; one with more than ``pixel_limit(max_pixels)`` pixels is a
    bad row (the limit of ``--max_pixels``, so the check and training agree). A file without rows is a bad
    row of its own (source: the file).
    """
    rows: list[dict] = []
    bad: list[BadRow] = []
    for file, folder in pair_files_and_folders(data_file_paths, image_folders):
        seen = 0
        images_first = 0
        for lineno, line, problem in iter_lines(file):
            seen += 1
            source = f"{file}:{lineno}"
            if problem is not None:
                bad.append(BadRow(source, "<encoding>", problem))
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append(BadRow(source, "<json>", f"bad JSON: {exc.msg} at column {exc.colno}"))
                continue
            notes: dict[str, Any] = {}
            try:
                row = normalise_row(raw, notes)
            except RowError as exc:
                bad.append(BadRow(source, exc.field, str(exc)))
                continue
            if not row["solution"].strip():
                bad.append(BadRow(source, "solution", "empty solution: rewards have nothing to compare with"))
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
            images_first += bool(notes)
            row["image_path"] = [_resolve_image(p, folder) for p in row["image_path"]]
            row["accu_reward_method"] = row["accu_reward_method"] or reward_method
            row["task_type"] = row["task_type"] or task_type
            row["source"] = source
            rows.append(row)
        if images_first:
            logger.info(
                "%s: %d row(s) have images but no '%s' marker: their images were put before the question, as "
                "VLM-R1 does",
                file,
                images_first,
                IMAGE_TOKEN,
            )
        if seen == 0:
            bad.append(BadRow(file, "<file>", "the file holds no rows (it is empty or blank)"))
    limit = pixel_limit(max_pixels)
    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        image_errors = list(pool.map(lambda r: _check_images(r, r["source"], limit), rows))
    bad.extend(e for e in image_errors if e is not None)
    good = [r for r, e in zip(rows, image_errors, strict=True) if e is None]
    return good, sorted(bad, key=_source_order)


def _source_order(b: BadRow) -> tuple[str, int]:
    file, _, line = b.source.rpartition(":")
    return (file, int(line)) if line.isdigit() else (b.source, 0)


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


def batch_rows(batch: dict[str, list]) -> list[dict]:
    """A ``datasets`` batch (columns of lists) as one dict per row."""
    return [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]


class LazyImageTransform:
    """``datasets`` transform: adds ``prompt`` (chat messages) and ``images`` (decoded RGB) on access.

    An image that no longer decodes (the file changed on disk after the check) does not stop the run: the
    row is skipped with a warning naming its ``file:line`` and the count so far, and the next row of the
    same dataset whose images decode takes its place (always the same one, so a GRPO group stays whole).
    """

    def __init__(self, module: Any, pool: Any = None) -> None:
        self.module = module
        self.pool = pool  # the untransformed dataset replacements come from (default: see _pool_of)
        limits = getattr(module, "limits", None)
        self.limit = pixel_limit(getattr(limits, "max_pixels", None))
        self.skipped: dict[str, str] = {}  # source -> why
        self._replacement: dict[str, tuple[dict, list]] = {}

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        return self.columns(list(batch), [self.decode(r) for r in batch_rows(batch)])

    def columns(self, names: list[str], decoded: list[tuple[dict, Any]]) -> dict[str, list]:
        """The transform's output for ``(row, images)`` pairs: the raw ``names`` columns, ``prompt``, ``images``."""
        batch = {column: [row[column] for row, _ in decoded] for column in names}
        out = dict(batch)
        out["prompt"] = [build_messages(r, question_template(r, self.module)) for r, _ in decoded]
        out["images"] = [images for _, images in decoded]
        if "image_grids" in batch:  # VLM-R1's reward kwarg: [t, h, w] for a one-image row, else one per image
            grids = [g or [] for g in out["image_grids"]]  # None for rows read before the column existed
            out["image_grid_thw"] = [g[0] if len(g) == 1 else (g or None) for g in grids]
        return out

    def _images(self, row: dict) -> list:
        return [decode_rgb(p, self.limit) for p in row["image_path"]]

    def decode(self, row: dict) -> tuple[dict, list]:
        """``(row, its images)``; for a row whose images no longer decode, its replacement and that row's."""
        source = row.get("source")
        if source in self._replacement:
            return self._replacement[source]
        try:
            return row, self._images(row)
        except ImageError as exc:
            self.skipped[source] = str(exc)
            replacement = self._replace(row)
            logger.warning(
                "Skipped %s: %s (the image changed after the data was checked). %s takes its place; "
                "%d row(s) skipped so far. Run `vlm-grpo-data check` on the data to find every such row.",
                source,
                exc,
                replacement[0].get("source"),
                len(self.skipped),
            )
            return replacement

    def _replace(self, row: dict) -> tuple[dict, list]:
        source = row.get("source")
        pool = self.pool if self.pool is not None else _pool_of(source)
        if pool is None:
            raise DataError(f"image cannot be decoded: {self.skipped[source]}", source)
        sources = pool["source"]  # read only when an image fails
        start = sources.index(source) if source in sources else -1
        for step in range(1, len(sources) + 1):
            candidate = pool[(start + step) % len(sources)]
            if candidate["source"] in self.skipped:
                continue
            try:
                result = candidate, self._images(candidate)
            except ImageError as exc:
                self.skipped[candidate["source"]] = str(exc)
                continue
            self._replacement[source] = result
            return result
        raise DataError(
            f"no row of this dataset has images that still decode ({len(self.skipped)} skipped); "
            "run `vlm-grpo-data check` on the data",
            source,
        )


#: the latest untransformed datasets made by ``to_datasets``: where a transform built elsewhere (SFT's, which
#: replaces ours) finds replacement rows
_POOLS: deque[Any] = deque(maxlen=8)


def _pool_of(source: str | None) -> Any:
    for pool in reversed(_POOLS):
        if source in pool["source"]:
            return pool
    return None


def row_image_tokens(module: Any, processor: Any, sizes: Sequence[Sequence[int]]) -> int:
    """Prompt tokens of one row's images (the adapter's ``row_image_tokens``; duck-typed stand-ins: the sum)."""
    own = getattr(module, "row_image_tokens", None)  # a VLMModule has it
    return own(processor, sizes) if own else sum(module.num_image_tokens(processor, w, h) for w, h in sizes)


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
            lengths.append(len(tok) + row_image_tokens(module, processor, r["image_sizes"]))
    return lengths


def validate_rows(
    rows: list[dict],
    bad: list[BadRow],
    module: Any,
    processor: Any,
    *,
    max_prompt_length: int | None = None,
    mm_max_length: int | None = None,
) -> list[dict]:
    """Model-dependent checks and columns (coordinate frames, image tokens, prompt length); rows that fail
    join ``bad`` (kept sorted) and the rest are returned. Shared by training and ``vlm-grpo-data check``."""
    sized = []
    image_grid = getattr(module, "image_grid", None)  # a VLMModule has it; duck-typed stand-ins may not
    for row in rows:
        try:  # the processor refuses some shapes (e.g. aspect ratio over 200): a bad row, not a crash
            row["coord_sizes"] = [list(module.coord_size(processor, w, h)) for w, h in row["image_sizes"]]
            image_tokens = row_image_tokens(module, processor, row["image_sizes"])
            grids = [image_grid(processor, w, h) for w, h in row["image_sizes"]] if image_grid else []
            row["image_grids"] = [list(g) for g in grids if g is not None]
        except ValueError as exc:
            bad.append(BadRow(row["source"], "image", f"the processor refuses this image: {exc}"))
            continue
        if mm_max_length is not None and image_tokens > mm_max_length:
            bad.append(
                BadRow(
                    row["source"],
                    "image",
                    f"{len(row['image_sizes'])} image(s) take {image_tokens} image tokens, more than "
                    f"--mm_max_length {mm_max_length} (lower --max_pixels or drop frames)",
                )
            )
            continue
        sized.append(row)
    kept = sized
    if max_prompt_length is not None and sized:
        lengths = prompt_lengths(sized, module, processor)
        kept = []
        for row, length in zip(sized, lengths, strict=True):
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
    return kept


def prepare_rows(
    rows: list[dict],
    bad: list[BadRow],
    module: Any,
    processor: Any,
    *,
    max_prompt_length: int | None = None,
    mm_max_length: int | None = None,
    skip_bad_rows: bool = False,
) -> list[dict]:
    """Add model-dependent columns, apply the length limits, then fail or skip on bad rows."""
    total = len(rows) + len(bad)  # an empty file counts as one bad row
    kept = validate_rows(rows, bad, module, processor, max_prompt_length=max_prompt_length, mm_max_length=mm_max_length)
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
        files = sorted({b.source.rpartition(":")[0] or b.source for b in bad if b.source})
        raise DataError(
            f"No usable rows left in the training data: all {total} row(s) are bad"
            + (f" (files: {', '.join(files)})" if files else "")
            + "; see the skipped rows above, or run `vlm-grpo-data check` on the files"
        )
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
        "image_grids",
        "accu_reward_method",
        "task_type",
        "source",
        "format_prompt",
    )
    dataset = Dataset.from_dict({c: [r.get(c) for r in rows] for c in columns})
    dataset = _with_extra_columns(dataset, rows)
    if not val_split_ratio:
        return _drawable(dataset, module), None
    if not 0 < val_split_ratio < 1:
        raise ValueError(f"--val_split_ratio must be in [0, 1), got {val_split_ratio}")
    split = dataset.train_test_split(test_size=val_split_ratio, seed=seed)
    return _drawable(split["train"], module), _drawable(split["test"], module)


def _drawable(dataset: Any, module: Any) -> Any:
    _POOLS.append(dataset)
    return dataset.with_transform(LazyImageTransform(module, pool=dataset))


def _with_extra_columns(dataset: Any, rows: list[dict]) -> Any:
    """A row's own columns beyond the canonical ones (verl's ``data_source``, ``extra_info``, ...; see
    ``data/sources.py``) as ``Json`` columns, so rewards receive them exactly as written (None where absent)."""
    from datasets import Json

    feature = Json()
    for name in sorted({k for r in rows for k in r.get("extra") or {}}):
        values = [feature.encode_example((r.get("extra") or {}).get(name)) for r in rows]
        dataset = dataset.add_column(name, values, feature=feature)
    return dataset
