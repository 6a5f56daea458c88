"""Grounding rewards (IoU of a predicted box) and the box helpers detection rewards reuse."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from vlm_grpo.rewards.base import column, completion_text
from vlm_grpo.rewards.format import extract_answer

Box = tuple[float, float, float, float]
Size = tuple[float, float]

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_BOX = re.compile(rf"\[\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*\]")


def parse_boxes(text: str) -> list[Box]:
    """Every ``[x1, y1, x2, y2]`` in ``text``, in order of appearance (ints or floats, any spacing; boxes inside
    JSON such as ``{"bbox_2d": [1, 2, 3, 4]}`` included). Boxes with non-finite numbers are skipped."""
    if not isinstance(text, str):
        return []
    boxes = []
    for match in _BOX.finditer(text):
        try:
            box = tuple(float(v) for v in match.groups())
        except ValueError:  # pragma: no cover - the regex only matches numbers
            continue
        if all(math.isfinite(v) for v in box):
            boxes.append(box)
    return boxes  # type: ignore[return-value]


def box_area(box: Box) -> float:
    """Area of ``(x1, y1, x2, y2)``; 0.0 for degenerate boxes (x2 <= x1 or y2 <= y1)."""
    return max(0.0, box[2] - box[0]) * max(0.0, box[3] - box[1])


def box_iou(a: Box, b: Box) -> float:
    """Intersection over union of two ``(x1, y1, x2, y2)`` boxes (continuous coordinates, no +1), in [0, 1];
    0.0 when the union is empty."""
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = iw * ih if iw > 0 and ih > 0 else 0.0
    union = box_area(a) + box_area(b) - inter
    if union <= 0 or not math.isfinite(union):
        return 0.0
    return min(1.0, max(0.0, inter / union))


def clip_box(box: Box, size: Size) -> Box:
    """``box`` clipped to the image ``[0, width] x [0, height]``."""
    w, h = size
    return (min(max(box[0], 0.0), w), min(max(box[1], 0.0), h), min(max(box[2], 0.0), w), min(max(box[3], 0.0), h))


def rescale_box(box: Box, from_size: Size, to_size: Size) -> Box:
    """Map ``box`` from a ``from_size = (width, height)`` coordinate frame to ``to_size``: x scaled by
    ``to_w / from_w``, y by ``to_h / from_h``."""
    sx = to_size[0] / from_size[0]
    sy = to_size[1] / from_size[1]
    return (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)


def first_size(value: Any) -> Size | None:
    """``(width, height)`` of a row's first image from an ``image_sizes`` / ``coord_sizes`` entry (a list of
    ``[w, h]``, or a single ``[w, h]``); ``None`` when absent/empty. Raises ``ValueError`` on a malformed size."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = [value.get("width"), value.get("height")]
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        return None
    first = value[0]
    if isinstance(first, (list, tuple, dict)):
        return first_size(first)
    if first is None:
        return None
    if len(value) != 2:
        raise ValueError(f"Expected a [width, height] size, got {value!r}")
    try:
        w, h = float(value[0]), float(value[1])
    except (TypeError, ValueError):
        raise ValueError(f"Expected a [width, height] size, got {value!r}") from None
    if not (w > 0 and h > 0 and math.isfinite(w) and math.isfinite(h)):
        raise ValueError(f"Expected a positive [width, height] size, got {value!r}")
    return (w, h)


def solution_box(solution: Any) -> Box:
    """The ground-truth box of a row: the last box of the solution's answer (or whole text), or a
    ``[x1, y1, x2, y2]`` list (or list of them: last one). Raises ``ValueError`` if none or degenerate."""
    box: Box | None = None
    if isinstance(solution, str):
        boxes = parse_boxes(extract_answer(solution))
        box = boxes[-1] if boxes else None
    elif isinstance(solution, (list, tuple)) and solution:
        if isinstance(solution[-1], (list, tuple)):
            return solution_box(solution[-1])
        if len(solution) == 4:
            try:
                box = tuple(float(v) for v in solution)  # type: ignore[assignment]
            except (TypeError, ValueError):
                box = None
    if box is None or not all(math.isfinite(v) for v in box):
        raise ValueError(f"No [x1, y1, x2, y2] box in the solution {str(solution)[:200]!r}")
    if box[2] <= box[0] or box[3] <= box[1]:
        raise ValueError(f"Degenerate solution box {box} (expected x1 < x2 and y1 < y2)")
    return box


def iou_reward(completions: Sequence[Any], threshold: float | None = None, **kwargs: Any) -> list[float | None]:
    """IoU reward: IoU in [0, 1] (continuous) between the completion's LAST box and the solution's box; with
    ``threshold`` (``--reward_kwargs '{"iou": {"threshold": 0.5}}'``) 1.0 when IoU >= threshold, else 0.0.

    The predicted box is the last ``[x1, y1, x2, y2]`` (ints/floats; JSON like ``{"bbox_2d": [...]}`` too) inside
    the completion's last ``<answer>…</answer>`` (the whole completion when it has no answer tag). The solution box
    is in ORIGINAL image pixels. If the row has both ``coord_sizes`` and ``image_sizes``, the predicted box is
    rescaled from the first image's coordinate frame ``coord_sizes[row][0]`` to its original size
    ``image_sizes[row][0]`` (x by W_orig / W_frame, y by H_orig / H_frame); with either missing, no rescaling.
    With ``image_sizes`` known, the predicted box is clipped to the image. 0.0 when no box parses or the box is
    degenerate (x2 <= x1 or y2 <= y1 after clipping). ``None`` (no reward, not a failure) for rows whose text
    solution holds no box: mixed datasets keep non-grounding rows out of this reward. Never raises on completion
    text; raises ``ValueError`` on malformed rows (no ``solution``, degenerate solution box, bad sizes), which
    :class:`SafeReward` turns into ``None``.
    """
    n = len(completions)
    if kwargs.get("solution") is None:
        raise ValueError("The iou reward needs a 'solution' column")
    if threshold is not None:
        threshold = float(threshold)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"iou threshold must be in [0, 1], got {threshold}")
    solutions = column(kwargs, "solution", n)
    image_sizes = column(kwargs, "image_sizes", n)
    coord_sizes = column(kwargs, "coord_sizes", n)
    rewards: list[float | None] = []
    for completion, sol, image_size, coord_size in zip(completions, solutions, image_sizes, coord_sizes, strict=True):
        if isinstance(sol, str) and not parse_boxes(extract_answer(sol)):
            rewards.append(None)  # not a grounding row (e.g. counting in a mixed set): the reward does not apply
            continue
        gt = solution_box(sol)
        image_wh = first_size(image_size)
        frame_wh = first_size(coord_size)
        boxes = parse_boxes(extract_answer(completion_text(completion)))
        if not boxes:
            rewards.append(0.0)
            continue
        box = boxes[-1]
        if image_wh is not None and frame_wh is not None:
            box = rescale_box(box, frame_wh, image_wh)
        if image_wh is not None:
            box = clip_box(box, image_wh)
        if box[2] <= box[0] or box[3] <= box[1]:
            rewards.append(0.0)
            continue
        iou = box_iou(box, gt)
        rewards.append(iou if threshold is None else float(iou >= threshold))
    return rewards


def iou_threshold_reward(completions: Sequence[Any], threshold: float = 0.5, **kwargs: Any) -> list[float | None]:
    """Thresholded IoU reward: 1.0 when the IoU of :func:`iou_reward` (same box parsing, rescaling from
    ``coord_sizes`` to ``image_sizes``, clipping) is >= ``threshold`` (default 0.5), else 0.0. Range {0.0, 1.0}.
    ``None`` for rows whose solution holds no box."""
    return iou_reward(completions, threshold=threshold, **kwargs)


iou_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
iou_threshold_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]


__all__ = [
    "Box",
    "box_area",
    "box_iou",
    "clip_box",
    "first_size",
    "iou_reward",
    "iou_threshold_reward",
    "parse_boxes",
    "rescale_box",
    "solution_box",
]
