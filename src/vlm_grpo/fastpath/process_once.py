"""The processor run once per distinct prompt of a batch, its outputs repeated for the copies.

A GRPO batch holds every prompt G times, and TRL runs the processor over all of those rows twice a
step: in ``_tokenize_prompts`` (for generation) and in ``_generate_and_score_completions`` (the log-prob
passes' ``pixel_values``). Image preprocessing dominates both calls: at 896 px, 16 rows took 140 ms on
an H100 host's 16 cores against 11 ms for their 2 distinct rows, and the 16 rows' ``pixel_values`` took
45 ms more to reach the GPU (5 ms for 2).

:class:`ProcessOnce` stands in for the processor during one batch (``process_prompts_once``). A batched
call runs on the distinct rows, and its outputs are repeated into exactly the tensors the full call returns
(tested for every family): left padding is the same because the longest row is among the distinct ones.
Rows are compared by value: text, message structure, and images by mode, size, palette and pixels. A call
whose outputs it cannot lay out per row (videos, tiles the output does not count, a key it does not know)
runs on every row, with one info line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import BatchFeature

from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)

# One entry per row (padded to the batch's width), one per image, or rows of pixels per image.
ROW_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})
IMAGE_KEYS = frozenset({"image_grid_thw"})
PIXEL_KEYS = frozenset({"pixel_values"})
_CONTENT_TYPES = frozenset({"text", "image"})


def _is_image(value: Any) -> bool:
    return isinstance(value, Image.Image)


def _shape_key(value: Any) -> Hashable:
    """A cheap hashable summary: rows with different keys differ; equal keys are compared in full."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _shape_key(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_shape_key(v) for v in value)
    if _is_image(value):
        return ("image", value.mode, value.size)
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return ("array", tuple(value.shape), str(value.dtype))
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    return ("object", type(value).__qualname__)


class RowMatcher:
    """Finds a batch's distinct rows; keeps each image's bytes for the batch so a second call compares cheaply."""

    def __init__(self) -> None:
        self._pixels: dict[int, tuple[Any, bytes]] = {}  # id -> (image kept alive so the id stays its own, bytes)

    def _bytes(self, image: Any) -> bytes:
        entry = self._pixels.get(id(image))
        if entry is None or entry[0] is not image:
            entry = (image, image.tobytes())
            self._pixels[id(image)] = entry
        return entry[1]

    def equal(self, a: Any, b: Any) -> bool:
        if a is b:
            return True
        if _is_image(a) or _is_image(b):
            return (
                _is_image(a)
                and _is_image(b)
                and a.mode == b.mode
                and a.size == b.size
                and a.getpalette() == b.getpalette()
                and self._bytes(a) == self._bytes(b)
            )
        if type(a) is not type(b):
            return False
        if isinstance(a, Mapping):
            return a.keys() == b.keys() and all(self.equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(self.equal(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, np.ndarray):
            return a.dtype == b.dtype and np.array_equal(a, b)
        if isinstance(a, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        try:
            return bool(a == b)
        except Exception:  # an object without a usable ==: treat as distinct (no sharing, never wrong)
            return False

    def distinct(self, rows: Sequence[Any]) -> tuple[list[int], list[int]]:
        """(leaders, index): the first row of each distinct value, and for every row its leader's position."""
        leaders: list[int] = []
        index: list[int] = []
        buckets: dict[Hashable, list[int]] = {}
        for row, value in enumerate(rows):
            bucket = buckets.setdefault(_shape_key(value), [])
            match = next((pos for pos in bucket if self.equal(rows[leaders[pos]], value)), None)
            if match is None:
                match = len(leaders)
                bucket.append(match)
                leaders.append(row)
            index.append(match)
        return leaders, index


def _take(value: Any, positions: list[int], device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if device is not None:
            value = value.to(device)
        return value.index_select(0, torch.tensor(positions, dtype=torch.long, device=value.device))
    return [value[p] for p in positions]


def repeat_rows(
    out: Mapping[str, Any], index: list[int], leader_images: list[int], device: Any = None
) -> BatchFeature | None:
    """The leaders' outputs laid out for every row (row r is leader ``index[r]``); None if a key's layout is unknown.

    ``leader_images``: the number of images of each leader, in order. ``device``: where the repeated tensors go
    (None: where they are).
    """
    n_images = sum(leader_images)
    first_image = np.cumsum([0, *leader_images]).tolist()
    grid = out.get("image_grid_thw")
    if grid is not None and len(grid) != n_images:  # checked first: the pixel layout below is read from it
        return None
    units = torch.as_tensor(grid).prod(-1).tolist() if grid is not None else [1] * n_images  # [1]: one per image
    first_unit = np.cumsum([0, *units]).tolist()
    image_rows = [i for lead in index for i in range(first_image[lead], first_image[lead + 1])]
    unit_rows = [u for i in image_rows for u in range(first_unit[i], first_unit[i + 1])]
    # Per key: the leaders' entries each row takes, and how many entries the leaders' output must hold.
    layouts = {
        **dict.fromkeys(ROW_KEYS, (index, len(leader_images))),
        **dict.fromkeys(IMAGE_KEYS, (image_rows, n_images)),
        **dict.fromkeys(PIXEL_KEYS, (unit_rows, first_unit[-1])),
    }
    if set(out) - layouts.keys() or any(len(value) != layouts[key][1] for key, value in out.items()):
        return None
    result = {key: _take(value, layouts[key][0], device) for key, value in out.items()}
    return BatchFeature(data=result)


def _image_count(conversation: Any) -> int | None:
    """Images of one conversation (list of messages); None for content this stand-in does not lay out."""
    if not isinstance(conversation, list):
        return None
    count = 0
    for message in conversation:
        if not isinstance(message, Mapping):
            return None
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") not in _CONTENT_TYPES:
                    return None
                count += part.get("type") == "image"
    return count


class ProcessOnce:
    """The processor for one batch, with batched calls run on the distinct rows only.

    Everything else (attributes, decoding, the image processor, ...) is the processor's own.
    ``device``: where ``__call__`` puts its repeated tensors (the caller moves them there next);
    ``apply_chat_template`` returns them where the processor does.
    """

    def __init__(self, processor: Any, device: Any = None) -> None:
        self._processor = processor
        self._device = device
        self._rows = RowMatcher()

    def __getattr__(self, name: str) -> Any:
        if name in ("_processor", "_device", "_rows"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._processor, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        images, text = kwargs.get("images"), kwargs.get("text")
        per_row = (
            not args
            and isinstance(text, list)
            and isinstance(images, list)
            and len(images) == len(text) > 1
            and all(x is None or isinstance(x, list) for x in images)
            and all(kwargs.get(k) is None for k in ("videos", "audio"))
        )
        if not per_row:
            return self._processor(*args, **kwargs)

        def call(rows: list[int] | None) -> Any:
            if rows is None:
                return self._processor(**kwargs)
            return self._processor(**{**kwargs, "images": [images[r] for r in rows], "text": [text[r] for r in rows]})

        counts = [len(x or []) for x in images]
        return self._once(list(zip(text, images, strict=True)), counts, call, self._device)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        counts = [_image_count(c) for c in conversation] if isinstance(conversation, list) else [None]
        if args or not (kwargs.get("tokenize") and kwargs.get("return_dict")) or len(counts) < 2 or None in counts:
            return self._processor.apply_chat_template(conversation, *args, **kwargs)

        def call(rows: list[int] | None) -> Any:
            chosen = conversation if rows is None else [conversation[r] for r in rows]
            return self._processor.apply_chat_template(chosen, **kwargs)

        return self._once(conversation, counts, call, None)

    def _once(self, rows: list[Any], counts: list[int], call: Callable[[list[int] | None], Any], device: Any) -> Any:
        """``call(leaders)`` repeated per row; ``call(None)`` (every row) when nothing repeats or cannot be laid out."""
        leaders, index = self._rows.distinct(rows)
        if len(leaders) == len(rows):
            return call(None)
        out = call(leaders)
        repeated = repeat_rows(out, index, [counts[r] for r in leaders], device)
        if repeated is None:
            keys = ", ".join(sorted(out))
            warn_once(
                logger,
                f"process_prompts_once: the processor's outputs ({keys}) cannot be laid out per row here; "
                "this batch is processed row by row",
                logging.INFO,
            )
            return call(None)
        return repeated
