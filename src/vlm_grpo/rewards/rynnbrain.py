"""RynnBrain spatial-reasoning tasks: per-task system prompts, parsers of the ``<trajectory>`` / ``<affordance>`` /
``<area>`` / ``<counting>`` / ``<object>`` outputs, and their rewards.

Completions look like ``reasoning … #### <answer><trajectory><frame 3> (450, 320), (480, 350)</trajectory></answer>``
with coordinates normalised to 0–1000. Rewards read the text after the LAST ``####`` (the whole completion when it
has none) and, in it, the last complete ``<TAG>…</TAG>`` (tags case-insensitive); ``<frame i>`` gives the frame
(first one in the tag), ``(x, y)`` (or ``[x, y]``) the points, at most 100, each coordinate clipped to [0, 1000];
points with non-finite coordinates are skipped. The format itself is checked by ``format_rynnbrain``.

Solutions are either the same tagged text or the RynnBrain JSON answer (what the data loader keeps of an assistant
turn ``{"frame3": [[450, 320], [480, 350]]}``, several such objects possibly concatenated): ``frameN`` gives frame N
and its point list; an affordance solution may add ``"region": [[x, y], ...]`` (a polygon, also ``"polygon"``);
a segment solution may be ``[x1, y1, x2, y2]``; a counting solution may be a bare integer.

Every per-task reward returns ``None`` for rows whose ``task_type`` is set to another task (mixed datasets), and
raises ``ValueError`` for malformed rows (no solution, or a solution the task cannot read), which ``SafeReward``
turns into ``None``. A wrong frame (``<frame i>`` differing from the solution's frame, or missing while the
solution has one) gives 0.0 for affordance, area and segment; for trajectory it only loses the frame share.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vlm_grpo.rewards.base import column, completion_text
from vlm_grpo.rewards.format import extract_answer, extract_tag
from vlm_grpo.rewards.grounding import (
    Point,
    box_iou,
    discrete_frechet,
    dtw_mean_distance,
    point_distance,
    point_in_polygon,
    polygon_iou,
)
from vlm_grpo.tasks import RYNNBRAIN_TASK_TAGS

COORD_MAX = 1000.0
# Points read from one answer (trajectories are "up to 10 key points"; more is noise).
MAX_POINTS = 100
# Characters of a completion (from its end, where the final answer sits) that are parsed.
RYNN_MAX_CHARS = 100_000
_NUM = r"[-+]?(?:\d{1,30}(?:\.\d{0,30})?|\.\d{1,30})(?:[eE][-+]?\d{1,4})?"
_FRAME = re.compile(r"<frame\s*(\d{1,9})\s*>", re.IGNORECASE)
_POINT = re.compile(rf"[(\[]\s*({_NUM})\s*,\s*({_NUM})\s*[)\]]")
_INT = re.compile(r"\s*([-+]?\d{1,15})(?:\.0*)?\s*")
_FRAME_KEY = re.compile(r"frame[\s_\-]*(\d{1,9})", re.IGNORECASE)
_REGION_KEYS = ("region", "polygon", "area", "mask")


@dataclass(frozen=True)
class SpatialAnswer:
    """A parsed spatial answer: frame index (``None`` when not given), points in 0–1000 space, and for affordance
    solutions an optional region polygon."""

    frame: int | None
    points: tuple[Point, ...]
    region: tuple[Point, ...] | None = None


def final_part(text: str) -> str:
    """The text after the last ``####`` (the whole text when it has none), at most its last 100,000 characters."""
    if not isinstance(text, str):
        text = completion_text(text)
    text = text[-RYNN_MAX_CHARS:]
    cut = text.rfind("####")
    return text if cut < 0 else text[cut + 4 :]


def _clip(v: float) -> float:
    return min(COORD_MAX, max(0.0, v))


def _points(text: str) -> tuple[Point, ...]:
    out = []
    for match in _POINT.finditer(text):
        x, y = float(match.group(1)), float(match.group(2))
        if math.isfinite(x) and math.isfinite(y):
            out.append((_clip(x), _clip(y)))
            if len(out) >= MAX_POINTS:
                break
    return tuple(out)


def parse_spatial(text: str, tag: str) -> SpatialAnswer | None:
    """The spatial answer in the last complete ``<tag>…</tag>`` of :func:`final_part` of ``text``, else ``None``."""
    content = extract_tag(final_part(text), tag)
    if content is None:
        return None
    frame = _FRAME.search(content)
    return SpatialAnswer(int(frame.group(1)) if frame else None, _points(content))


def parse_counting(text: str) -> int | None:
    """The integer in the last ``<counting>…</counting>`` of :func:`final_part` of ``text`` (``"3"``, ``"3.0"``),
    else ``None``."""
    content = extract_tag(final_part(text), "counting")
    if content is None:
        return None
    match = _INT.fullmatch(content[:100])
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------- solutions


def _json_values(text: str, limit: int = 100) -> list[Any]:
    """JSON objects/arrays found in ``text`` (concatenated or separated by anything), at most ``limit``."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while len(out) < limit:
        starts = [p for p in (text.find("{", i), text.find("[", i)) if p >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        out.append(value)
        i = end
    return out


def _as_points(value: Any) -> tuple[Point, ...]:
    """``[[x, y], ...]``, ``[x, y]`` or ``[x1, y1, x2, y2]`` as points (clipped to 0–1000); ``()`` otherwise."""
    if not isinstance(value, (list, tuple)) or not value:
        return ()

    def num(v: Any) -> float | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        try:
            f = float(v)
        except OverflowError:
            return None
        return f if math.isfinite(f) else None

    if all(num(v) is not None for v in value) and len(value) in (2, 4):
        flat = [num(v) for v in value]
        return tuple((_clip(flat[i]), _clip(flat[i + 1])) for i in range(0, len(flat), 2))  # type: ignore[arg-type]
    out = []
    for item in value[:MAX_POINTS]:
        if isinstance(item, (list, tuple)) and len(item) == 2 and num(item[0]) is not None and num(item[1]) is not None:
            out.append((_clip(num(item[0])), _clip(num(item[1]))))  # type: ignore[arg-type]
    return tuple(out)


def parse_solution(solution: Any, tag: str) -> SpatialAnswer:
    """The ground truth of a spatial row (tagged text or RynnBrain JSON, see the module docstring).
    Raises ``ValueError`` when none can be read."""
    if solution is None:
        raise ValueError("solution is None")
    text = solution if isinstance(solution, str) else json.dumps(solution)
    tagged = parse_spatial(text, tag)
    if tagged is not None and tagged.points:
        return tagged
    frame: int | None = None
    points: list[Point] = []
    region: tuple[Point, ...] | None = None
    body = final_part(text)
    answer = extract_tag(body, "answer")
    for value in _json_values(answer if answer is not None else body):
        items = value if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) else [value]
        for item in items:
            if isinstance(item, dict):
                for key, val in item.items():
                    match = _FRAME_KEY.fullmatch(str(key).strip())
                    if match and not points:
                        frame, points = int(match.group(1)), list(_as_points(val))
                    elif str(key).strip().lower() in _REGION_KEYS and region is None:
                        region = _as_points(val) or None
            elif not points:
                points = list(_as_points(item))
    if not points and region is None:
        raise ValueError(f"No <{tag}> answer or frame/point JSON in the solution {text[:200]!r}")
    return SpatialAnswer(frame, tuple(points), region)


def parse_counting_solution(solution: Any) -> int:
    """The ground-truth count: ``<counting>N</counting>``, else a lone integer (after ``####`` / in ``<answer>``)."""
    if solution is None:
        raise ValueError("solution is None")
    text = solution if isinstance(solution, str) else str(solution)
    value = parse_counting(text)
    if value is None:
        match = _INT.fullmatch(extract_answer(final_part(text))[:100])
        value = int(match.group(1)) if match else None
    if value is None:
        raise ValueError(f"No count in the solution {text[:200]!r}")
    return value


# --------------------------------------------------------------------------------------------- task scores


def _frame_ok(pred: SpatialAnswer, gt: SpatialAnswer) -> bool:
    return gt.frame is None or pred.frame == gt.frame


def trajectory_score(
    pred: SpatialAnswer | None,
    gt: SpatialAnswer,
    metric: str = "frechet",
    max_distance: float = 250.0,
    frame_weight: float = 0.2,
) -> float:
    """``frame_weight · [frame matches] + (1 − frame_weight) · max(0, 1 − d / max_distance)`` where ``d`` is the
    discrete Fréchet distance (``metric="frechet"``) or the mean DTW distance (``metric="dtw"``) between the
    predicted and true point sequences in 0–1000 space. 0.0 without a ``<trajectory>`` tag or points. In [0, 1]."""
    if not gt.points:
        raise ValueError("trajectory solution has no points")
    if pred is None or not pred.points:
        return 0.0
    if metric == "frechet":
        d = discrete_frechet(pred.points, gt.points)
    elif metric == "dtw":
        d = dtw_mean_distance(pred.points, gt.points)
    else:
        raise ValueError(f"Unknown trajectory metric {metric!r} (frechet, dtw)")
    closeness = max(0.0, 1.0 - d / max_distance) if math.isfinite(d) else 0.0
    return frame_weight * float(_frame_ok(pred, gt)) + (1.0 - frame_weight) * closeness


def affordance_score(
    pred: SpatialAnswer | None, gt: SpatialAnswer, max_distance: float = 100.0, region_bonus: float = 0.5
) -> float:
    """Distance score ``max(0, 1 − d / max_distance)`` of the FIRST predicted point to the nearest true point
    (0–1000 space). With a region polygon in the solution: ``(1 − region_bonus) · distance score + region_bonus ·
    [point inside the region]`` (only the region term when the solution has no point). 0.0 without an
    ``<affordance>`` tag, without points, or on a frame mismatch. In [0, 1]."""
    if not gt.points and not gt.region:
        raise ValueError("affordance solution has neither a point nor a region")
    if pred is None or not pred.points or not _frame_ok(pred, gt):
        return 0.0
    point = pred.points[0]
    inside = float(point_in_polygon(point, gt.region)) if gt.region else None
    if not gt.points:
        return inside or 0.0
    d = min(point_distance(point, g) for g in gt.points)
    closeness = max(0.0, 1.0 - d / max_distance)
    if inside is None:
        return closeness
    return (1.0 - region_bonus) * closeness + region_bonus * inside


def area_score(pred: SpatialAnswer | None, gt: SpatialAnswer, mode: str = "points") -> float:
    """``mode="points"``: fraction of the predicted points inside the true polygon (even-odd, boundary inside);
    ``mode="iou"``: IoU of the predicted polygon (>= 3 points, else 0) with the true one (:func:`polygon_iou`).
    0.0 without an ``<area>`` tag, without points, or on a frame mismatch. In [0, 1]."""
    polygon = gt.points if len(gt.points) >= 3 else (gt.region or ())
    if len(polygon) < 3:
        raise ValueError("area solution needs a polygon of at least 3 points")
    if pred is None or not pred.points or not _frame_ok(pred, gt):
        return 0.0
    if mode == "points":
        return sum(point_in_polygon(p, polygon) for p in pred.points) / len(pred.points)
    if mode == "iou":
        return polygon_iou(pred.points, polygon)
    raise ValueError(f"Unknown area mode {mode!r} (points, iou)")


def counting_score(pred: int | None, gt: int, graded: bool = False) -> float:
    """1.0 iff the count equals the truth; with ``graded``, otherwise ``max(0, 1 − |pred − gt| / max(gt, 1))``.
    0.0 without a ``<counting>`` integer. In [0, 1]."""
    if pred is None:
        return 0.0
    if pred == gt:
        return 1.0
    if not graded:
        return 0.0
    return max(0.0, 1.0 - abs(pred - gt) / max(abs(gt), 1))


def _box(answer: SpatialAnswer) -> tuple[float, float, float, float] | None:
    if len(answer.points) < 2:
        return None
    (x1, y1), (x2, y2) = answer.points[0], answer.points[1]
    return (x1, y1, x2, y2)


def segment_score(pred: SpatialAnswer | None, gt: SpatialAnswer) -> float:
    """IoU in 0–1000 space of the predicted box (first two points: ``(X_min, Y_min), (X_max, Y_max)``) with the
    true box. 0.0 without an ``<object>`` tag, with fewer than two points, a degenerate box (X_max <= X_min or
    Y_max <= Y_min, after clipping to 0–1000), or a frame mismatch. In [0, 1]."""
    gt_box = _box(gt)
    if gt_box is None or gt_box[2] <= gt_box[0] or gt_box[3] <= gt_box[1]:
        raise ValueError(f"segment solution is not a non-degenerate box: {gt.points}")
    if pred is None or not _frame_ok(pred, gt):
        return 0.0
    box = _box(pred)
    if box is None or box[2] <= box[0] or box[3] <= box[1]:
        return 0.0
    return box_iou(box, gt_box)


# --------------------------------------------------------------------------------------------- rewards


def _positive(value: Any) -> float:
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a positive distance, got {value}")
    return value


def _unit(value: Any) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"expected a weight in [0, 1], got {value}")
    return value


def _task_of(value: Any) -> str | None:
    return value.strip().lower() if isinstance(value, str) and value.strip() else None


def _score_row(task: str, text: str, solution: Any, method: Any, options: dict[str, Any]) -> float:
    if task == "general":
        from vlm_grpo.rewards.accuracy import accuracy_reward

        if solution is None:
            raise ValueError("solution is None")
        gold = final_part(solution if isinstance(solution, str) else str(solution))
        (value,) = accuracy_reward([final_part(text)], solution=[gold], accu_reward_method=[method])
        return float(value)  # type: ignore[arg-type]
    if task == "counting":
        return counting_score(parse_counting(text), parse_counting_solution(solution), **options)
    tag = RYNNBRAIN_TASK_TAGS[task]
    gt = parse_solution(solution, tag)
    pred = parse_spatial(text, tag)
    scorer: Callable[..., float] = {
        "trajectory": trajectory_score,
        "affordance": affordance_score,
        "area": area_score,
        "segment": segment_score,
    }[task]
    return scorer(pred, gt, **options)


def _row_columns(reward: str, n: int, kwargs: dict[str, Any]) -> tuple[Sequence[Any], Sequence[Any], list[Any]]:
    """Each sample's solution, task type and accuracy method (a single method applies to every row)."""
    if kwargs.get("solution") is None:
        raise ValueError(f"The {reward} reward needs a 'solution' column")
    methods = kwargs.get("accu_reward_method")
    methods = [methods] * n if methods is None or isinstance(methods, str) else list(methods)
    return column(kwargs, "solution", n), column(kwargs, "task_type", n), methods


def _task_reward(task: str, completions: Sequence[Any], kwargs: dict[str, Any], options: dict[str, Any]) -> list:
    solutions, tasks, methods = _row_columns(f"rynn_{task}", len(completions), kwargs)
    out: list[float | None] = []
    for completion, sol, row_task, method in zip(completions, solutions, tasks, methods, strict=True):
        row = _task_of(row_task)
        if row is not None and row != task:
            out.append(None)
            continue
        out.append(_score_row(task, completion_text(completion), sol, method, options))
    return out


def rynn_trajectory_reward(
    completions: Sequence[Any],
    metric: str = "frechet",
    max_distance: float = 250.0,
    frame_weight: float = 0.2,
    **kwargs: Any,
) -> list[float | None]:
    """RynnBrain trajectory reward (:func:`trajectory_score`): ``0.2 · [frame matches] + 0.8 · max(0, 1 − d / 250)``,
    ``d`` the discrete Fréchet distance (``metric="dtw"``: mean DTW distance) between predicted and true points in
    0–1000 space. Range [0.0, 1.0]. ``None`` for rows of another ``task_type``."""
    options = {"metric": metric, "max_distance": _positive(max_distance), "frame_weight": _unit(frame_weight)}
    if metric not in ("frechet", "dtw"):
        raise ValueError(f"Unknown trajectory metric {metric!r} (frechet, dtw)")
    return _task_reward("trajectory", completions, kwargs, options)


def rynn_affordance_reward(
    completions: Sequence[Any], max_distance: float = 100.0, region_bonus: float = 0.5, **kwargs: Any
) -> list[float | None]:
    """RynnBrain affordance reward (:func:`affordance_score`): ``max(0, 1 − d / 100)`` for the distance ``d`` (0–1000
    space) of the predicted point to the nearest true point; with a region in the solution ``0.5 · that + 0.5 ·
    [inside the region]``. 0.0 on a frame mismatch. Range [0.0, 1.0]. ``None`` for rows of another ``task_type``."""
    options = {"max_distance": _positive(max_distance), "region_bonus": _unit(region_bonus)}
    return _task_reward("affordance", completions, kwargs, options)


def rynn_area_reward(completions: Sequence[Any], mode: str = "points", **kwargs: Any) -> list[float | None]:
    """RynnBrain area reward (:func:`area_score`): fraction of predicted points inside the true polygon
    (``mode="iou"``: polygon IoU). 0.0 on a frame mismatch. Range [0.0, 1.0]. ``None`` for other task types."""
    if mode not in ("points", "iou"):
        raise ValueError(f"Unknown area mode {mode!r} (points, iou)")
    return _task_reward("area", completions, kwargs, {"mode": mode})


def rynn_counting_reward(completions: Sequence[Any], graded: bool = False, **kwargs: Any) -> list[float | None]:
    """RynnBrain counting reward (:func:`counting_score`): 1.0 for the exact count, else 0.0 (``graded=True``:
    ``max(0, 1 − |pred − gt| / max(gt, 1))``). Range [0.0, 1.0]. ``None`` for rows of another ``task_type``."""
    return _task_reward("counting", completions, kwargs, {"graded": bool(graded)})


def rynn_segment_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """RynnBrain segment reward (:func:`segment_score`): IoU in 0–1000 space of the ``<object>`` box
    ``(X_min, Y_min), (X_max, Y_max)`` with the true box. 0.0 on a frame mismatch or degenerate box.
    Range [0.0, 1.0]. ``None`` for rows of another ``task_type``."""
    return _task_reward("segment", completions, kwargs, {})


def rynn_general_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """RynnBrain general-QA reward: the ``accuracy`` reward (per-row ``accu_reward_method``) on the text after the
    last ``####`` of the completion against the text after the last ``####`` of the solution (whole texts without
    one; ``<answer>`` tags inside are honoured as by ``accuracy``). Range [0.0, 1.0]. ``None`` for other task types."""
    return _task_reward("general", completions, kwargs, {})


_SOLUTION_TAGS = re.compile(r"<(trajectory|affordance|area|counting|object)\s*>", re.IGNORECASE)


def infer_task(solution: Any) -> str | None:
    """Task of a row without ``task_type``, from its solution: the first task tag it holds (``<object>`` ->
    ``segment``); ``None`` for frame/point JSON (ambiguous); ``general`` otherwise."""
    text = solution if isinstance(solution, str) else str(solution)
    match = _SOLUTION_TAGS.search(text[-RYNN_MAX_CHARS:])
    if match:
        tag = match.group(1).lower()
        return "segment" if tag == "object" else tag
    if _FRAME_KEY.search(text[:RYNN_MAX_CHARS]) and "{" in text:
        return None
    return "general"


def rynnbrain_reward(
    completions: Sequence[Any],
    trajectory: dict[str, Any] | None = None,
    affordance: dict[str, Any] | None = None,
    area: dict[str, Any] | None = None,
    counting: dict[str, Any] | None = None,
    segment: dict[str, Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """RynnBrain reward for mixed datasets: each row is scored by the reward of its ``task_type`` (``trajectory``,
    ``affordance``, ``area``, ``counting``, ``segment``, ``general``; rows without one: the task of the solution's
    tag, ``general`` for plain text, ``None`` for ambiguous frame JSON); ``None`` for other task types. Options per
    task come as dicts: ``--reward_kwargs '{"rynnbrain": {"counting": {"graded": true}, "trajectory":
    {"metric": "dtw"}}}'``. Range [0.0, 1.0]."""
    per_task = {
        "trajectory": dict(trajectory or {}),
        "affordance": dict(affordance or {}),
        "area": dict(area or {}),
        "counting": dict(counting or {}),
        "segment": dict(segment or {}),
        "general": {},
    }
    solutions, tasks, methods = _row_columns("rynnbrain", len(completions), kwargs)
    out: list[float | None] = []
    for completion, sol, row_task, method in zip(completions, solutions, tasks, methods, strict=True):
        task = _task_of(row_task)
        if task is None and sol is not None:
            task = infer_task(sol)
        if task not in per_task:
            out.append(None)
            continue
        out.append(_score_row(task, completion_text(completion), sol, method, per_task[task]))
    return out


for _fn in (
    rynn_trajectory_reward,
    rynn_affordance_reward,
    rynn_area_reward,
    rynn_counting_reward,
    rynn_segment_reward,
    rynn_general_reward,
    rynnbrain_reward,
):
    _fn.value_range = (0.0, 1.0)  # type: ignore[attr-defined]

__all__ = [
    "SpatialAnswer",
    "affordance_score",
    "area_score",
    "counting_score",
    "discrete_frechet",
    "dtw_mean_distance",
    "final_part",
    "infer_task",
    "parse_counting",
    "parse_counting_solution",
    "parse_solution",
    "parse_spatial",
    "point_in_polygon",
    "polygon_iou",
    "rynn_affordance_reward",
    "rynn_area_reward",
    "rynn_counting_reward",
    "rynn_general_reward",
    "rynn_segment_reward",
    "rynn_trajectory_reward",
    "rynnbrain_reward",
    "segment_score",
    "trajectory_score",
]
