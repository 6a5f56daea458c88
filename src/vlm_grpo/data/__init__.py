"""Data: row formats, validation and lazy image-path datasets."""

from vlm_grpo.data.formats import IMAGE_TOKEN, DataError, RowError, normalise_row
from vlm_grpo.data.images import ImageError
from vlm_grpo.data.jsonl import (
    BadRow,
    DataValidationError,
    LazyImageTransform,
    build_messages,
    prepare_rows,
    read_rows,
    split_paths,
    to_datasets,
    validate_rows,
)

__all__ = [
    "IMAGE_TOKEN",
    "BadRow",
    "DataError",
    "DataValidationError",
    "ImageError",
    "LazyImageTransform",
    "RowError",
    "build_messages",
    "normalise_row",
    "prepare_rows",
    "read_rows",
    "split_paths",
    "to_datasets",
    "validate_rows",
]
