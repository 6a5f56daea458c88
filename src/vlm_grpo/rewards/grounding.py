"""Grounding rewards (IoU of a predicted box), the box helpers detection rewards reuse, and the point / polygon
geometry of RynnBrain's trajectory and area rewards."""

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


Point = tuple[float, float]


def point_distance(a: Point, b: Point) -> float:
    return math.hypot(a[0] - b[0], a[1] - b[1])


def discrete_frechet(p: Sequence[Point], q: Sequence[Point]) -> float:
    """Discrete Fréchet distance between two polylines (Eiter & Mannila); ``inf`` if either is empty."""
    if not p or not q:
        return math.inf
    prev = [0.0] * len(q)
    for i, a in enumerate(p):
        cur = [0.0] * len(q)
        for j, b in enumerate(q):
            d = point_distance(a, b)
            if i == 0 and j == 0:
                cur[j] = d
            elif i == 0:
                cur[j] = max(cur[j - 1], d)
            elif j == 0:
                cur[j] = max(prev[0], d)
            else:
                cur[j] = max(min(prev[j], prev[j - 1], cur[j - 1]), d)
        prev = cur
    return prev[-1]


def dtw_mean_distance(p: Sequence[Point], q: Sequence[Point]) -> float:
    """Dynamic time warping: the cost (sum of matched-point distances) of the optimal warping path divided by the
    number of its steps, i.e. the mean matched-point distance; ties prefer the shorter path. ``inf`` if empty."""
    if not p or not q:
        return math.inf
    inf = (math.inf, 0)
    prev: list[tuple[float, int]] = [inf] * len(q)
    for i, a in enumerate(p):
        cur: list[tuple[float, int]] = [inf] * len(q)
        for j, b in enumerate(q):
            d = point_distance(a, b)
            if i == 0 and j == 0:
                best = (0.0, 0)
            else:
                options = []
                if i > 0:
                    options.append(prev[j])
                if j > 0:
                    options.append(cur[j - 1])
                if i > 0 and j > 0:
                    options.append(prev[j - 1])
                best = min(options)
            cur[j] = (best[0] + d, best[1] + 1)
        prev = cur
    cost, steps = prev[-1]
    return cost / steps


def point_in_polygon(point: Point, polygon: Sequence[Point]) -> bool:
    """Even-odd rule; points on the boundary (within 1e-9) count as inside. ``False`` for fewer than 3 vertices."""
    if len(polygon) < 3:
        return False
    x, y = point
    inside = False
    n = len(polygon)
    for k in range(n):
        (x1, y1), (x2, y2) = polygon[k], polygon[(k + 1) % n]
        # on the segment?
        cross = (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1)
        if abs(cross) <= 1e-9 * max(1.0, abs(x2 - x1) + abs(y2 - y1)) and (
            min(x1, x2) - 1e-9 <= x <= max(x1, x2) + 1e-9 and min(y1, y2) - 1e-9 <= y <= max(y1, y2) + 1e-9
        ):
            return True
        if (y1 > y) != (y2 > y):
            x_cross = x1 + (y - y1) * (x2 - x1) / (y2 - y1)
            if x < x_cross:
                inside = not inside
    return inside


POLYGON_GRID = 256


def polygon_iou(a: Sequence[Point], b: Sequence[Point], grid: int = POLYGON_GRID) -> float:
    """IoU of two polygons (even-odd fill), rasterised on a ``grid`` × ``grid`` lattice of cell centres over the
    bounding box of both (so exact up to about 1/grid of that box). 0.0 when either has fewer than 3 vertices or
    the union is empty."""
    if len(a) < 3 or len(b) < 3:
        return 0.0
    import numpy as np

    xs = [p[0] for p in (*a, *b)]
    ys = [p[1] for p in (*a, *b)]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 <= x0 or y1 <= y0:
        return 0.0
    gx = x0 + (np.arange(grid) + 0.5) * (x1 - x0) / grid
    gy = y0 + (np.arange(grid) + 0.5) * (y1 - y0) / grid
    px, py = np.meshgrid(gx, gy)

    def fill(poly: Sequence[Point]) -> Any:
        inside = np.zeros(px.shape, dtype=bool)
        n = len(poly)
        for k in range(n):
            (ax, ay), (bx, by) = poly[k], poly[(k + 1) % n]
            if ay == by:
                continue
            crosses = (ay > py) != (by > py)
            x_cross = ax + (py - ay) * (bx - ax) / (by - ay)
            inside ^= crosses & (px < x_cross)
        return inside

    fa, fb = fill(a), fill(b)
    union = np.count_nonzero(fa | fb)
    return float(np.count_nonzero(fa & fb) / union) if union else 0.0
