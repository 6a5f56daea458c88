"""Images decoded only for the rows a GRPO step generates from.

TRL's GRPO loader hands every micro-step a whole generation batch (``per_device_train_batch_size x
steps_per_generation`` rows) and generates from it only every ``steps_per_generation x num_iterations`` micro-steps;
the other fetches are dropped unread. With EasyR1's recipe (80 micro-steps per generation, 320 rows each) decoding
at fetch time decodes every image 80 times (about 45 s per optimizer step for 512² PNGs on an H200 machine). The
training loader (:func:`deferred_view`) therefore yields rows whose ``images`` are a :class:`PendingImages`, and
:func:`decode_pending` decodes them, with the same skip-and-replace rule for images that no longer decode, when the
trainer generates from the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_grpo.data.jsonl import LazyImageTransform, batch_rows


@dataclass(frozen=True)
class PendingImages:
    """A row's images, not decoded yet: the raw row they are read from (small, so loader workers pickle it)."""

    row: dict


class DeferredImageTransform:
    """``datasets`` transform: ``LazyImageTransform``'s columns, with :class:`PendingImages` for ``images``."""

    def __init__(self, transform: LazyImageTransform) -> None:
        self.transform = transform

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        rows = batch_rows(batch)
        return self.transform.columns(list(batch), [(row, PendingImages(row)) for row in rows])


def deferred_view(dataset: Any) -> tuple[Any, LazyImageTransform] | None:
    """``(dataset whose rows carry PendingImages, the transform that decodes them)`` for a dataset made by
    ``to_datasets`` (its transform is exactly :class:`LazyImageTransform`); None for any other dataset, which is
    then read as it is."""
    format_ = getattr(dataset, "format", None) or {}
    transform = (format_.get("format_kwargs") or {}).get("transform")
    if format_.get("type") != "custom" or type(transform) is not LazyImageTransform:
        return None
    return dataset.with_transform(DeferredImageTransform(transform)), transform


def decode_pending(rows: list[dict], transform: LazyImageTransform | None) -> list[dict]:
    """``rows`` with every :class:`PendingImages` decoded; a row whose images no longer decode becomes its
    replacement row, all columns, as the immediate transform would have returned it."""
    if transform is None or not any(isinstance(r.get("images"), PendingImages) for r in rows):
        return rows
    out = []
    for x in rows:
        pending = x.get("images")
        if not isinstance(pending, PendingImages):
            out.append(x)
            continue
        row, images = transform.decode(pending.row)
        columns = transform.columns(list(pending.row), [(row, images)])
        out.append({**x, **{name: values[0] for name, values in columns.items()}})
    return out


class DeferredImagesMixin:
    """For a GRPO trainer: the training loader yields :class:`PendingImages`, decoded when a step generates."""

    #: What decodes the training loader's pending images (set by ``get_train_dataloader``).
    _pending_transform: LazyImageTransform | None = None

    def get_train_dataloader(self) -> Any:
        view = deferred_view(self.train_dataset)
        if view is None:
            return super().get_train_dataloader()
        dataset, self._pending_transform = self.train_dataset, view[1]
        self.train_dataset = view[0]
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset = dataset

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        return super()._generate_and_score_completions(decode_pending(inputs, self._pending_transform))
