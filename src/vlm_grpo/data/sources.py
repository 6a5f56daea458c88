"""Every place rows come from: JSONL / JSON / parquet / arrow files, ``save_to_disk`` folders, ``name@split``
from the local Hugging Face cache, with EasyR1-style column keys and verl / DeepEyes rows.

EasyR1, verl and DeepEyes ship parquet (or hub datasets) whose images are HF ``Image`` features: a struct of
``bytes`` and/or ``path``. They are read straight from Arrow (no JSON round trip); embedded bytes become
``data:image/...;base64,`` URIs, which the rest of the pipeline (header check, lazy decode) already takes, and
paths are resolved against the image folder as usual. Every row then goes through the package's checks
(``normalise_row``, the ``<image>`` count, image headers, then ``prepare_rows``), and bad rows are reported as
``source:row`` like any other file.

verl / DeepEyes rows (``prompt`` a chat list with ``<image>`` markers, ``images``,
``reward_model.ground_truth``) become rows whose solution is the ground truth; ``data_source``,
``extra_info`` and every other column the row carries are kept as dataset columns, so rewards receive them.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vlm_grpo.cli_errors import UserError
from vlm_grpo.data.formats import IMAGE_TOKEN, DataError, RowError, count_placeholders, normalise_row
from vlm_grpo.data.images import pixel_limit
from vlm_grpo.data.jsonl import BadRow, _check_images, _resolve_image, _source_order, read_rows, split_paths
from vlm_grpo.data.records import Record, iter_records, read_any_rows
from vlm_grpo.data.templates import PromptTemplate
from vlm_grpo.data.video import VideoOptions, add_video, video_value

logger = logging.getLogger(__name__)

#: columns the pipeline builds itself; a row's own column of that name is not kept as an extra column
RESERVED_COLUMNS = frozenset(
    {
        "id", "question", "system", "solution", "image_path", "image_sizes", "coord_sizes", "accu_reward_method",
        "task_type", "source", "prompt", "images", "image", "completion", "completions", "extra", "format_prompt",
    }
)  # fmt: skip
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


class SourceError(UserError, ValueError):
    """A data source that cannot be opened (absent file, dataset not in the cache, unknown split)."""


@dataclass(frozen=True)
class ColumnKeys:
    """EasyR1's ``prompt_key`` / ``answer_key`` / ``image_key`` / ``video_key``: which columns hold what."""

    prompt: str | None = None
    answer: str | None = None
    image: str | None = None
    video: str | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.prompt, self.answer, self.image, self.video))


# --------------------------------------------------------------------------- sources


def split_sources(value: str | Sequence[str] | None) -> list[str]:
    """``a.parquet:b.jsonl`` like VLM-R1's files; ``name@split`` and folders pass through."""
    return split_paths(value)


def is_hub_spec(spec: str) -> bool:
    """``org/name@split`` (or ``name@split``) that is not a local path."""
    return "@" in spec and not os.path.exists(spec) and not os.path.exists(spec.rpartition("@")[0])


def _hub_cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _hub_folder(spec: str) -> str:
    """The local snapshot folder of ``name@split`` (the HF hub cache, never the network)."""
    from huggingface_hub import snapshot_download

    name, _, split = spec.rpartition("@")
    try:
        return snapshot_download(name, repo_type="dataset", local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, HFValidationError (a malformed name), ...
        raise SourceError(
            f"dataset '{name}' (split '{split}') is not in the local Hugging Face cache ({_hub_cache_dir()}); "
            f"download it first on a machine with network access: hf download {name} --repo-type dataset "
            f"(and copy the cache folder here, or set HF_HOME)"
        ) from exc


def _load_hub(spec: str) -> Any:
    """``name@split`` from the local HF hub cache, never the network."""
    return _load_split(_hub_folder(spec), spec.rpartition("@")[2], spec)


def check_source(spec: str, flag: str = "--data_file_paths") -> None:
    """Milliseconds, before anything loads: a local file or folder exists, a ``name@split`` is in the cache."""
    if is_hub_spec(spec):
        _hub_folder(spec)
    elif not os.path.exists(spec) and not ("@" in spec and os.path.isdir(spec.rpartition("@")[0])):
        raise SourceError(f"{flag}: data file '{spec}' does not exist")


def _load_split(folder: str, split: str, spec: str) -> Any:
    import datasets

    try:
        return datasets.load_dataset(folder, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise SourceError(f"{spec}: no split '{split}' ({exc})") from exc
        raise


def _load_disk(folder: str, split: str | None, spec: str) -> Any:
    import datasets

    loaded = datasets.load_from_disk(folder)
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            if len(loaded) != 1 and "train" not in loaded:
                raise SourceError(f"{spec}: a dataset with splits {list(loaded)}; name one as '{folder}@SPLIT'")
            split = "train" if "train" in loaded else next(iter(loaded))
        if split not in loaded:
            raise SourceError(f"{spec}: no split '{split}' (splits: {', '.join(loaded)})")
        return loaded[split]
    if split is not None:
        raise SourceError(f"{spec}: '{folder}' holds one dataset without splits; drop '@{split}'")
    return loaded


def _is_saved_dataset(folder: str) -> bool:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    return any(os.path.isfile(os.path.join(folder, f)) for f in markers)


def _arrow_records(dataset: Any, name: str) -> Iterator[Record]:
    """Rows of a ``datasets.Dataset`` as stored (Image features stay ``{bytes, path}``: nothing is decoded)."""
    index = 0
    for batch in dataset.with_format("arrow").iter(batch_size=256):
        for row in batch.to_pylist():
            index += 1
            yield Record(f"{name}:{index}", value=row)


def _parquet_records(path: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    index = 0
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors (ArrowInvalid, OSError) for a damaged or non-parquet file
        raise DataError(f"not a readable parquet file: {exc}", str(path)) from None
    for batch in table.iter_batches(batch_size=256):
        for row in batch.to_pylist():
            index += 1
            yield Record(f"{path}:{index}", value=row)


def iter_source(spec: str) -> Iterator[Record]:
    """Records of one source, each named ``source:line`` (JSON files) or ``source:row`` (tables, 1-based)."""
    if is_hub_spec(spec):
        yield from _arrow_records(_load_hub(spec), spec)
        return
    path, _, split = spec.rpartition("@") if "@" in spec and not os.path.exists(spec) else (spec, "", "")
    if os.path.isdir(path):
        if not _is_saved_dataset(path):
            raise SourceError(
                f"{spec}: is a directory, not a data file (nor a folder written by datasets' save_to_disk)"
            )
        yield from _arrow_records(_load_disk(path, split or None, spec), spec)
        return
    if not os.path.isfile(path):
        raise SourceError(
            f"data source not found: {spec} (expected a file ({', '.join(FILE_SUFFIXES)}), a save_to_disk folder, "
            "or name@split of a dataset in the local Hugging Face cache)"
        )
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_records(path)
    elif suffix == ".arrow":
        import datasets

        yield from _arrow_records(datasets.Dataset.from_file(path), spec)
    elif suffix in (".jsonl", ".json"):
        yield from iter_records(path)
    else:
        raise SourceError(f"{path}: unsupported file type '{suffix}' (expected one of {', '.join(FILE_SUFFIXES)})")


# --------------------------------------------------------------------------- images


def _image_ref(value: Any, field: str) -> str:
    """A path, a data URI, raw bytes, or an HF ``Image`` struct ``{bytes, path}`` -> a string the loader opens."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data:
            return _data_uri(data)
        if isinstance(path, str) and path:
            return path
        raise RowError(field, "image has neither bytes nor a path")
    if isinstance(value, (bytes, bytearray)):
        return _data_uri(bytes(value))
    if isinstance(value, str):
        return value
    raise RowError(field, f"expected an image path, bytes or {{bytes, path}}, got {type(value).__name__}")


def _data_uri(data: bytes) -> str:
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = (image.format or "png").lower()
    except Exception:
        kind = "unknown"  # the header check reports it as an unreadable image, in its row
    return f"data:image/{kind};base64," + base64.b64encode(data).decode("ascii")


def _image_list(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [_image_ref(v, f"{field}[{i}]" if isinstance(value, (list, tuple)) else field) for i, v in enumerate(items)]


# --------------------------------------------------------------------------- row shapes


def is_verl_row(row: dict) -> bool:
    """verl / DeepEyes: ``prompt`` is a chat list and the answer sits in ``reward_model``."""
    return isinstance(row.get("prompt"), list) and ("reward_model" in row or "data_source" in row)


def _message_text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{type: text, text}, {type: image}] items
        parts = []
        for j, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                parts.append(str(item.get("text", "")))
            elif kind == "image":
                parts.append(IMAGE_TOKEN)
            else:
                raise RowError(f"{field}[{j}]", f"unsupported content item {item!r}")
        return "".join(parts)
    raise RowError(field, "message content must be a string or a list of {type, ...} items")


def _verl(row: dict) -> tuple[dict, set[str]]:
    system, question = None, None
    for i, message in enumerate(row["prompt"]):
        if not isinstance(message, dict) or "role" not in message:
            raise RowError(f"prompt[{i}]", "each message needs 'role' and 'content'")
        text = _message_text(message.get("content"), f"prompt[{i}].content")
        if message["role"] == "system":
            system = text
        elif message["role"] == "user" and question is None:
            question = text
    if question is None:
        raise RowError("prompt", "no 'user' message in 'prompt'")
    reward_model = row.get("reward_model")
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        raise RowError("reward_model.ground_truth", "missing field 'reward_model.ground_truth' (the solution)")
    image_field = "images" if "images" in row else "image"
    easy = {"problem": question, "answer": truth, "images": _image_list(row.get(image_field), image_field)}
    if system is not None:
        easy["system"] = system
    return easy, {"prompt", "reward_model", image_field}


def _keyed(row: dict, keys: ColumnKeys) -> tuple[dict, set[str]]:
    prompt_key, answer_key = keys.prompt or "problem", keys.answer or "answer"
    image_key = keys.image or ("image" if "images" not in row and "image" in row else "images")
    for key, flag in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if row.get(key) is None:
            raise RowError(key, f"missing field '{key}' (--{flag} {key})")
    easy = {"problem": row[prompt_key], "answer": row[answer_key]}
    if not isinstance(easy["problem"], str):
        raise RowError(prompt_key, f"'{prompt_key}' must be a string (--prompt_key)")
    if row.get(image_key) is not None:
        easy["images"] = _image_list(row[image_key], image_key)
    return easy, {prompt_key, answer_key, image_key}


def adapt_row(row: Any, keys: ColumnKeys = ColumnKeys()) -> tuple[Any, dict]:
    """(a row ``normalise_row`` understands, the extra columns to keep) for every supported shape."""
    if not isinstance(row, dict):
        return row, {}
    if is_verl_row(row):
        adapted, used = _verl(row)
    elif keys.given() or ("problem" in row and "conversations" not in row and "conversation" not in row):
        adapted, used = _keyed(row, keys)
    else:
        adapted, used = dict(row), set()
        for field in ("image", "images"):
            if field in adapted:
                adapted[field] = _image_list(adapted[field], field)
        return adapted, {}
    extra = {k: v for k, v in row.items() if k not in used and k not in RESERVED_COLUMNS and v is not None}
    for key in ("id", "accu_reward_method", "task_type", "system"):
        if key in row and key not in adapted:
            adapted[key] = row[key]
    return adapted, extra


def _extra_json(extra: dict, source: str) -> dict:
    """Extra columns must be JSON-like (they become ``Json`` dataset columns); bytes are not kept."""
    kept = {}
    for key, value in extra.items():
        try:
            json.dumps(value)
        except TypeError:
            logger.debug("%s: column '%s' is not JSON-like and is not passed to rewards", source, key)
            continue
        kept[key] = value
    return kept


# --------------------------------------------------------------------------- reading and checking


def _check_record(
    record: Record,
    folder: Path,
    keys: ColumnKeys,
    reward_method: str | None,
    task_type: str | None,
    template: PromptTemplate | None = None,
    video: VideoOptions | None = None,
) -> dict | BadRow:
    if record.error:
        return BadRow(record.source, "<json>", record.error)
    try:
        adapted, extra = adapt_row(record.value, keys)
        row = normalise_row(adapted)
        column, value = video_value(record.value, keys.video) if isinstance(record.value, dict) else (None, None)
        if column is not None:
            add_video(row, value, folder, video or VideoOptions())
            extra[column] = value  # rewards receive the video as the row gave it
        if template is not None:
            row["task_type"] = row["task_type"] or task_type
            row["question"] = template.render(row, record.value)
            row["format_prompt"] = template.path
    except RowError as exc:
        return BadRow(record.source, exc.field, str(exc))
    n_markers = count_placeholders(row["question"])
    if n_markers != len(row["image_path"]):
        return BadRow(
            record.source,
            "image",
            f"the prompt has {n_markers} '{IMAGE_TOKEN}' placeholder(s) but the row has {len(row['image_path'])} "
            "image(s)",
        )
    row["image_path"] = [_resolve_image(p, folder) for p in row["image_path"]]
    row["accu_reward_method"] = row["accu_reward_method"] or reward_method
    row["task_type"] = row["task_type"] or task_type
    row["source"] = record.source
    if extra:
        row["extra"] = _extra_json(extra, record.source)
    return row


def _plain_file(spec: str, keys: ColumnKeys) -> bool:
    """JSONL / JSON files without column keys or verl rows keep the package's one JSONL reader."""
    if keys.given() or Path(spec).suffix.lower() not in (".jsonl", ".json") or not os.path.isfile(spec):
        return False
    return not any(
        isinstance(r.value, dict) and (is_verl_row(r.value) or video_value(r.value, None)[0] is not None)
        for r in iter_records(spec)
    )


def read_sources(
    data_file_paths: str | Sequence[str],
    image_folders: str | Sequence[str] | None = None,
    *,
    keys: ColumnKeys = ColumnKeys(),
    reward_method: str | None = None,
    task_type: str | None = None,
    format_prompt: str | None = None,
    video: VideoOptions | None = None,
    num_threads: int = 8,
    max_pixels: int | None = None,
) -> tuple[list[dict], list[BadRow]]:
    """(good rows, bad rows) of every source; checked like ``read_rows`` (``max_pixels``: its pixel limit),
    errors as ``source:row``.
    ``format_prompt``: a Jinja template file the user prompt is rendered with (``data/templates.py``);
    ``video``: how video rows are sampled into frames (``data/video.py``)."""
    template = PromptTemplate(format_prompt) if format_prompt else None
    sources = split_sources(data_file_paths)
    if not sources:
        raise ValueError("No data files given: pass --data_file_paths a.jsonl[:b.parquet]")
    folders = split_paths(image_folders)
    if folders and len(folders) not in (1, len(sources)):
        raise ValueError(
            f"--image_folders has {len(folders)} entries for {len(sources)} data sources; give one per source or "
            "one for all"
        )
    rows: list[dict] = []
    bad: list[BadRow] = []
    for index, spec in enumerate(sources):
        folder = Path(folders[index if len(folders) > 1 else 0]) if folders else _default_folder(spec)
        options = {
            "reward_method": reward_method,
            "task_type": task_type,
            "num_threads": num_threads,
            "max_pixels": max_pixels,
        }
        if template is None and _plain_file(spec, keys):
            good, wrong = (read_rows if spec.endswith(".jsonl") else read_any_rows)([spec], [str(folder)], **options)
            rows.extend(good)
            bad.extend(wrong)
            continue
        checked = [_check_record(r, folder, keys, reward_method, task_type, template, video) for r in iter_source(spec)]
        source_rows = [c for c in checked if isinstance(c, dict)]
        bad.extend(c for c in checked if isinstance(c, BadRow))
        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            errors = list(pool.map(lambda r: _check_images(r, r["source"], pixel_limit(max_pixels)), source_rows))
        bad.extend(e for e in errors if e is not None)
        rows.extend(r for r, e in zip(source_rows, errors, strict=True) if e is None)
    return rows, sorted(bad, key=_source_order)


def _default_folder(spec: str) -> Path:
    """Relative image paths resolve against the file's folder, a saved dataset's folder, or the cwd (hub)."""
    if is_hub_spec(spec):
        return Path.cwd()
    path = spec.rpartition("@")[0] if "@" in spec and not os.path.exists(spec) else spec
    return Path(path) if os.path.isdir(path) else Path(path).parent
