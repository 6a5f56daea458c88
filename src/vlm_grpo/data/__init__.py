"""Data: row formats, validation and lazy image-path datasets."""

from vlm_grpo.data.formats import IMAGE_TOKEN, RowError, normalise_row
from vlm_grpo.data.jsonl import (
    BadRow,
    DataValidationError,
    LazyImageTransform,
    build_messages,
    prepare_rows,
    read_rows,
    split_paths,
    to_datasets,
)

__all__ = [
    "IMAGE_TOKEN",
    "BadRow",
    "DataValidationError",
    "LazyImageTransform",
    "RowError",
    "build_messages",
    "normalise_row",
    "prepare_rows",
    "read_rows",
    "split_paths",
    "to_datasets",
]
