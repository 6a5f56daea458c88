"""Detection rewards: COCO mAP (pycocotools, on the real image size), mAP with a length penalty, and a greedy
IoU-matching weighted sum. Predictions are rescaled from the model's coordinate frame (``coord_sizes``) to the
original image (``image_sizes``) exactly like the ``iou`` reward, then clipped to the image.

Detections are read from the completion's last ``<answer>…</answer>`` (the whole completion without one):

* objects ``{...}`` holding a box ``[x1, y1, x2, y2]`` (JSON such as ``{"bbox_2d": [..], "label": "cat"}``,
  Python-dict style quotes too; a truncated list still yields its complete objects); the label is the value of
  ``label`` / ``category`` / ``name`` / ``class`` (normalised: NFKC, case-folded, whitespace collapsed), the
  confidence the value of ``score`` / ``confidence`` (default 1.0);
* when no such object holds a box: every bare ``[x1, y1, x2, y2]``, without label.

The solution is read the same way (boxes in ORIGINAL image pixels). A solution whose answer is an empty JSON list
``[]`` means "no objects" (an empty ground truth); a solution without any box and without ``[]`` is not a
detection row and gets ``None`` (the reward does not apply). When the ground truth has no labels, matching is
class-agnostic (predicted labels ignored); otherwise a prediction whose label is not among the ground-truth labels
(or that has no label) is an unmatched label: a guaranteed false positive.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import threading
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any

from vlm_grpo.rewards.base import column, completion_text
from vlm_grpo.rewards.format import extract_answer
from vlm_grpo.rewards.grounding import (
    Box,
    Size,
    box_iou,
    clip_box,
    first_size,
    parse_boxes,
    rescale_box,
)

# Only this many leading characters of an answer are parsed for detections.
DETECTION_MAX_CHARS = 200_000
# COCO's maxDets: predictions beyond the first 100 (in order of appearance) are ignored by the AP rewards.
MAX_DETECTIONS = 100
# At most this many objects are read from one text (the ground truth too).
MAX_OBJECTS = 1_000

_OBJECT = re.compile(r"\{[^{}]{0,4000}\}")
_LABEL = re.compile(r"""["'](?:label|category|name|class)["']\s*:\s*(?:"([^"]{0,500})"|'([^']{0,500})')""")
_SCORE = re.compile(
    r"""["'](?:score|confidence)["']\s*:\s*([-+]?(?:\d{1,20}(?:\.\d{0,20})?|\.\d{1,20})(?:[eE][-+]?\d{1,3})?)"""
)
_EMPTY_LIST = re.compile(r"\s*(?:```(?:json)?\s*)?\[\s*\]\s*(?:```)?\s*")

# pycocotools prints progress to stdout; the swap of sys.stdout that silences it is process-wide.
_COCO_LOCK = threading.Lock()


class Detection(tuple):
    """``(box, label, score)``: ``box`` is ``(x1, y1, x2, y2)``, ``label`` a normalised string or ``None``."""

    __slots__ = ()

    def __new__(cls, box: Box, label: str | None = None, score: float = 1.0) -> Detection:
        return super().__new__(cls, (box, label, score))

    @property
    def box(self) -> Box:
        return self[0]

    @property
    def label(self) -> str | None:
        return self[1]

    @property
    def score(self) -> float:
        return self[2]


def normalize_label(label: str) -> str:
    """Labels compare after NFKC, case-folding and whitespace collapsing (``"Traffic  Light"`` ==
    ``"traffic light"``)."""
    return " ".join(unicodedata.normalize("NFKC", label).casefold().split())


def parse_detections(text: str) -> list[Detection]:
    """Detections in ``text`` (see the module docstring), in order of appearance; at most 1000."""
    if not isinstance(text, str) or not text:
        return []
    text = text[:DETECTION_MAX_CHARS]
    found: list[Detection] = []
    for match in _OBJECT.finditer(text):
        obj = match.group()
        boxes = parse_boxes(obj)
        if not boxes:
            continue
        label_match = _LABEL.search(obj)
        label = None
        if label_match is not None:
            label = normalize_label(label_match.group(1) if label_match.group(1) is not None else label_match.group(2))
        score = 1.0
        score_match = _SCORE.search(obj)
        if score_match is not None:
            value = float(score_match.group(1))
            score = value if math.isfinite(value) else 1.0
        found.append(Detection(boxes[0], label, score))
        if len(found) >= MAX_OBJECTS:
            return found
    if found:
        return found
    return [Detection(box) for box in parse_boxes(text)[:MAX_OBJECTS]]


def solution_detections(solution: Any) -> list[Detection] | None:
    """Ground-truth detections of a row; ``[]`` for an empty ground truth, ``None`` when the solution holds no box
    (not a detection row). Raises ``ValueError`` on degenerate ground-truth boxes (x2 <= x1 or y2 <= y1)."""
    if solution is None:
        raise ValueError("solution is None")
    text = extract_answer(solution if isinstance(solution, str) else str(solution))
    gts = parse_detections(text)
    if not gts:
        return [] if _EMPTY_LIST.fullmatch(text[:1000]) else None
    for det in gts:
        x1, y1, x2, y2 = det.box
        if x2 <= x1 or y2 <= y1:
            raise ValueError(f"Degenerate ground-truth box {det.box} (expected x1 < x2 and y1 < y2)")
    return gts


def _prepare(
    completion: Any, sol: Any, image_size: Any, coord_size: Any
) -> tuple[list[Detection], list[Detection] | None, Size | None]:
    """(predictions in original-image pixels, ground truth or None, image size or None) of one row."""
    gts = solution_detections(sol)
    image_wh = first_size(image_size)
    frame_wh = first_size(coord_size)
    preds = parse_detections(extract_answer(completion_text(completion)))
    out = []
    for det in preds:
        box = det.box
        if image_wh is not None and frame_wh is not None:
            box = rescale_box(box, frame_wh, image_wh)
        if image_wh is not None:
            box = clip_box(box, image_wh)
        if not all(math.isfinite(v) for v in box):
            box = (0.0, 0.0, 0.0, 0.0)
        out.append(Detection(box, det.label, det.score))
    return out, gts, image_wh


# --------------------------------------------------------------------------------------------- COCO AP


def coco_ap(
    preds: Sequence[Detection], gts: Sequence[Detection], image_size: Size | None = None, iou_50_only: bool = False
) -> float:
    """COCO average precision of one image's predictions, computed with pycocotools' ``COCOeval`` (bbox):
    AP averaged over IoU thresholds 0.50:0.05:0.95 (``iou_50_only``: AP at IoU 0.50), area "all", at most 100
    detections, mean over the ground-truth categories. In [0, 1].

    ``image_size`` ``(width, height)`` is the real image size written into the COCO image record (the boxes must
    already be in that image's pixels). Empty ground truth: 1.0 without predictions, else 0.0. No predictions:
    0.0. Ground truth without labels: one class-agnostic category. Otherwise predictions whose label is not a
    ground-truth label are false positives of every category: each is entered, at its rank (score, then order of
    appearance), as a detection that overlaps no ground-truth box.
    """
    if not gts:
        return 0.0 if preds else 1.0
    if not preds:
        return 0.0
    import numpy as np
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    agnostic = any(g.label is None for g in gts)
    cat_ids: dict[str | None, int] = {}
    for g in gts:
        key = None if agnostic else g.label
        cat_ids.setdefault(key, len(cat_ids) + 1)
    if image_size is not None:
        width, height = image_size
    else:
        width = max(1.0, max(g.box[2] for g in gts), max(p.box[2] for p in preds))
        height = max(1.0, max(g.box[3] for g in gts), max(p.box[3] for p in preds))
    # A 1x1 box left of every ground-truth box: IoU 0 with all of them (used for unmatched labels).
    far_x = min(g.box[0] for g in gts) - 11.0
    far_box = [far_x, min(g.box[1] for g in gts), 1.0, 1.0]

    def xywh(box: Box) -> list[float]:
        w, h = max(0.0, box[2] - box[0]), max(0.0, box[3] - box[1])
        return [box[0], box[1], w, h]

    image = {"id": 1, "width": width, "height": height}
    categories = [{"id": cid, "name": str(label)} for label, cid in cat_ids.items()]
    gt_anns = []
    for k, g in enumerate(gts, start=1):
        bbox = xywh(g.box)
        cid = cat_ids[None if agnostic else g.label]
        gt_anns.append(
            {"id": k, "image_id": 1, "category_id": cid, "bbox": bbox, "area": bbox[2] * bbox[3], "iscrowd": 0}
        )
    dt_anns = []
    for p in preds[:MAX_DETECTIONS]:
        key = None if agnostic else p.label
        if key in cat_ids:
            targets = [(cat_ids[key], xywh(p.box))]
        else:  # unmatched label: a false positive in every category
            targets = [(cid, far_box) for cid in cat_ids.values()]
        for cid, bbox in targets:
            dt_anns.append(
                {
                    "id": len(dt_anns) + 1,
                    "image_id": 1,
                    "category_id": cid,
                    "bbox": bbox,
                    "area": bbox[2] * bbox[3],
                    "iscrowd": 0,
                    "score": p.score,
                }
            )
    with _COCO_LOCK, contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = {"images": [image], "categories": categories, "annotations": gt_anns}
        coco_gt.createIndex()
        coco_dt = COCO()
        coco_dt.dataset = {"images": [image], "categories": categories, "annotations": dt_anns}
        coco_dt.createIndex()
        evaluator = COCOeval(coco_gt, coco_dt, "bbox")
        evaluator.params.imgIds = [1]
        evaluator.params.maxDets = [MAX_DETECTIONS]
        evaluator.params.areaRng = [[0.0, 1e12]]
        evaluator.params.areaRngLbl = ["all"]
        if iou_50_only:
            evaluator.params.iouThrs = np.array([0.5])
        evaluator.evaluate()
        evaluator.accumulate()
    precision = evaluator.eval["precision"][:, :, :, 0, 0]  # [iou thresholds, recall points, categories]
    valid = precision[precision > -1]
    if valid.size == 0:
        return 0.0
    value = round(float(np.mean(valid)), 12)  # 101 recall points: keep 1.0 from becoming 0.9999999999999998
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


def _rows(completions: Sequence[Any], kwargs: dict[str, Any]) -> Iterator[tuple]:
    """(predictions, ground truths or None, image size) per sample, parsed, rescaled and clipped."""
    n = len(completions)
    if kwargs.get("solution") is None:
        raise ValueError("Detection rewards need a 'solution' column")
    columns = (column(kwargs, name, n) for name in ("solution", "image_sizes", "coord_sizes"))
    for completion, sol, image_size, coord_size in zip(completions, *columns, strict=True):
        yield _prepare(completion, sol, image_size, coord_size)


def _ap_rewards(completions: Sequence[Any], kwargs: dict[str, Any], iou_50_only: bool, length: bool) -> list:
    rewards: list[float | None] = []
    for preds, gts, image_wh in _rows(completions, kwargs):
        if gts is None:
            rewards.append(None)
            continue
        value = coco_ap(preds, gts, image_wh, iou_50_only=iou_50_only)
        if length and preds and gts:
            value *= min(1.0, len(gts) / len(preds))
        rewards.append(value)
    return rewards


def od_ap_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """COCO mAP reward: AP over IoU 0.50:0.05:0.95 of the completion's detections against the solution's, via
    pycocotools on the real image size (:func:`coco_ap`). Range [0.0, 1.0].

    Predicted boxes are rescaled from ``coord_sizes`` to ``image_sizes`` and clipped to the image (as ``iou``);
    labels are matched after normalisation; a predicted label absent from the ground truth is a false positive
    (not dropped); only the first 100 predictions count. Empty ground truth (``[]``): 1.0 when nothing is predicted,
    else 0.0. ``None`` for rows whose solution holds no box. Zero-area / reversed / outside-the-image predictions
    are false positives. Raises ``ValueError`` on malformed rows (no solution column, degenerate ground-truth box,
    bad sizes).
    """
    return _ap_rewards(completions, kwargs, iou_50_only=False, length=False)


def od_ap50_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """COCO AP at IoU 0.50, otherwise exactly :func:`od_ap_reward`. Range [0.0, 1.0]."""
    return _ap_rewards(completions, kwargs, iou_50_only=True, length=False)


def od_length_reward(completions: Sequence[Any], ap50: bool = False, **kwargs: Any) -> list[float | None]:
    """mAP with an over-prediction penalty: ``od_ap × min(1, n_gt / n_pred)`` where ``n_pred`` counts every parsed
    prediction and ``n_gt`` the ground-truth boxes (``ap50=True``: ``od_ap50`` instead of ``od_ap``). Empty ground
    truth: 1.0 when nothing is predicted, else 0.0. Range [0.0, 1.0]. ``None`` for rows without boxes."""
    return _ap_rewards(completions, kwargs, iou_50_only=bool(ap50), length=True)


# --------------------------------------------------------------------------------------------- weighted sum


def greedy_match(
    preds: Sequence[Detection], gts: Sequence[Detection], iou_threshold: float = 0.5, class_aware: bool = True
) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching: all (prediction, ground truth) pairs with IoU >= ``iou_threshold`` (and equal
    labels when ``class_aware`` and the ground truth has labels), taken in decreasing IoU order (ties: earlier
    prediction, then earlier ground truth), each box used once. Returns ``(pred index, gt index, iou)`` triples."""
    check_labels = class_aware and all(g.label is not None for g in gts)
    pairs = []
    for i, p in enumerate(preds):
        for j, g in enumerate(gts):
            if check_labels and p.label != g.label:
                continue
            iou = box_iou(p.box, g.box)
            if iou >= iou_threshold and iou > 0:
                pairs.append((-iou, i, j))
    pairs.sort()
    used_p: set[int] = set()
    used_g: set[int] = set()
    matches = []
    for neg_iou, i, j in pairs:
        if i in used_p or j in used_g:
            continue
        used_p.add(i)
        used_g.add(j)
        matches.append((i, j, -neg_iou))
    return matches


def weighted_sum_score(
    preds: Sequence[Detection],
    gts: Sequence[Detection],
    iou_threshold: float = 0.5,
    iou_weight: float = 0.7,
    class_aware: bool = True,
) -> float:
    """``iou_weight · mean IoU + (1 − iou_weight) · (1 − (miss rate + false-alarm rate) / 2)`` after
    :func:`greedy_match`: mean IoU over the matched pairs (0 without a match), miss rate = unmatched ground truth /
    ground truth (0 when there is none), false-alarm rate = unmatched predictions / predictions (0 when there are
    none). Both lists empty: 1.0. In [0, 1]."""
    if not preds and not gts:
        return 1.0
    matches = greedy_match(preds, gts, iou_threshold, class_aware)
    mean_iou = sum(m[2] for m in matches) / len(matches) if matches else 0.0
    miss = (len(gts) - len(matches)) / len(gts) if gts else 0.0
    false_alarm = (len(preds) - len(matches)) / len(preds) if preds else 0.0
    value = iou_weight * mean_iou + (1.0 - iou_weight) * (1.0 - (miss + false_alarm) / 2.0)
    return min(1.0, max(0.0, value))


def weighted_sum_reward(
    completions: Sequence[Any],
    iou_threshold: float = 0.5,
    iou_weight: float = 0.7,
    class_aware: bool = True,
    **kwargs: Any,
) -> list[float | None]:
    """Detection weighted sum: greedy IoU matching at IoU >= 0.5 (labels must agree when the ground truth has
    labels), then ``0.7 · mean IoU of the matches + 0.3 · (1 − (miss rate + false-alarm rate) / 2)``
    (:func:`weighted_sum_score`). Range [0.0, 1.0]. Same parsing, rescaling and clipping as ``od_ap``; at most
    1000 predictions are read. Both empty: 1.0. ``None`` for rows whose solution holds no box. ``iou_threshold``,
    ``iou_weight`` and ``class_aware`` come from ``--reward_kwargs``."""
    iou_threshold, iou_weight = float(iou_threshold), float(iou_weight)
    if not (0.0 <= iou_threshold <= 1.0 and 0.0 <= iou_weight <= 1.0):
        raise ValueError("weighted_sum needs iou_threshold and iou_weight in [0, 1]")
    rewards: list[float | None] = []
    for preds, gts, _ in _rows(completions, kwargs):
        if gts is None:
            rewards.append(None)
            continue
        rewards.append(weighted_sum_score(preds, gts, iou_threshold, iou_weight, bool(class_aware)))
    return rewards


for _fn in (od_ap_reward, od_ap50_reward, od_length_reward, weighted_sum_reward):
    _fn.value_range = (0.0, 1.0)  # type: ignore[attr-defined]

__all__ = [
    "Detection",
    "coco_ap",
    "greedy_match",
    "normalize_label",
    "od_ap50_reward",
    "od_ap_reward",
    "od_length_reward",
    "parse_detections",
    "solution_detections",
    "weighted_sum_reward",
    "weighted_sum_score",
]
