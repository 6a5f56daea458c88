"""Hand-computed tables for the grounding/detection rewards: iou threshold variant, od_ap, od_ap50, od_length and
weighted_sum (greedy matching at IoU 0.5: 0.7 · mean IoU + 0.3 · (1 − (miss + false alarm) / 2))."""

from __future__ import annotations

import json
import time

import pytest

from vlm_grpo.rewards import build_reward_funcs
from vlm_grpo.rewards.detection import (
    Detection,
    coco_ap,
    greedy_match,
    od_ap50_reward,
    od_ap_reward,
    od_length_reward,
    parse_detections,
    solution_detections,
    weighted_sum_reward,
)
from vlm_grpo.rewards.grounding import iou_reward, iou_threshold_reward


def objs(*items: tuple) -> str:
    """``objs(([0, 0, 10, 10], "cat"), ...)`` -> the Qwen2.5-VL JSON answer."""
    return json.dumps([{"bbox_2d": box, "label": label} for box, label in items])


CAT = ([0, 0, 10, 10], "cat")
DOG = ([20, 20, 40, 40], "dog")
GT = f"<answer>{objs(CAT, DOG)}</answer>"
SIZE = {"image_sizes": [[[100, 100]]], "coord_sizes": [[[100, 100]]]}

# (name, completion, solution, columns, od_ap, od_ap50, od_length, weighted_sum); image 100x100 unless stated.
DETECTION_CASES = [
    ("both exact", f"<answer>{objs(CAT, DOG)}</answer>", GT, SIZE, 1.0, 1.0, 1.0, 1.0),
    # cat: AP 1, dog: AP 0 -> 0.5; weighted: 1 match IoU 1, miss 1/2 -> 0.7 + 0.3 * (1 - 0.25)
    ("one missed", f"<answer>{objs(CAT)}</answer>", GT, SIZE, 0.5, 0.5, 0.5, 0.925),
    # bird is no ground-truth label: a false positive ranked after the cat (AP cat 1, dog 0);
    # weighted: labels differ, so only the cat matches: miss 1/2, false alarm 1/2 -> 0.7 + 0.3 * 0.5
    (
        "unmatched label last",
        f"<answer>{objs(CAT, ([20, 20, 40, 40], 'bird'))}</answer>",
        GT,
        SIZE,
        0.5,
        0.5,
        0.5,
        0.85,
    ),
    # bird ranked first is a false positive before the true positive of each class: precision 1/2 everywhere;
    # od_length 0.5 * 2/3; weighted: 2 matches IoU 1, false alarm 1/3 -> 0.7 + 0.3 * (1 - 1/6)
    (
        "unmatched label first",
        f"<answer>{objs(([20, 20, 40, 40], 'bird'), CAT, DOG)}</answer>",
        GT,
        SIZE,
        0.5,
        0.5,
        1 / 3,
        0.95,
    ),
    # cat box [0,0,10,20]: IoU 100/200 = 0.5 -> a hit only at threshold 0.50 (1 of 10): AP cat 0.1, dog 1.0;
    # weighted: matches 0.5 and 1.0 -> 0.7 * 0.75 + 0.3
    ("loose box", f"<answer>{objs(([0, 0, 10, 20], 'cat'), DOG)}</answer>", GT, SIZE, 0.55, 1.0, 0.55, 0.825),
    # duplicate cat: a trailing false positive doesn't lower AP; od_length 1 * 2/3; weighted fa 1/3
    ("two boxes same object", f"<answer>{objs(CAT, CAT, DOG)}</answer>", GT, SIZE, 1.0, 1.0, 2 / 3, 0.95),
    # outside the image: clipped to a zero-area box at (100, 100) -> false positive
    (
        "box outside image",
        f"<answer>{objs(([150, 150, 200, 200], 'cat'), DOG)}</answer>",
        GT,
        SIZE,
        0.5,
        0.5,
        0.5,
        0.85,
    ),
    ("zero-area box", f"<answer>{objs(([5, 5, 5, 10], 'cat'), DOG)}</answer>", GT, SIZE, 0.5, 0.5, 0.5, 0.85),
    ("reversed corners", f"<answer>{objs(([10, 10, 0, 0], 'cat'), DOG)}</answer>", GT, SIZE, 0.5, 0.5, 0.5, 0.85),
    # no answer tag: the whole completion is read
    ("no answer tag", f"Here: {objs(CAT, DOG)}", GT, SIZE, 1.0, 1.0, 1.0, 1.0),
    ("nothing predicted", "<answer>no objects</answer>", GT, SIZE, 0.0, 0.0, 0.0, 0.15),  # miss 1 -> 0.3 * 0.5
    # labelled ground truth: unlabelled boxes are unmatched labels (false positives); miss 1, false alarm 1 -> 0
    ("boxes without labels", "<answer>[0, 0, 10, 10] [20, 20, 40, 40]</answer>", GT, SIZE, 0.0, 0.0, 0.0, 0.0),
    # model frame 50x50 for a 100x100 image: boxes x2
    (
        "rescaled",
        f"<answer>{objs(([0, 0, 5, 5], 'cat'), ([10, 10, 20, 20], 'dog'))}</answer>",
        GT,
        {"image_sizes": [[[100, 100]]], "coord_sizes": [[[50, 50]]]},
        1.0,
        1.0,
        1.0,
        1.0,
    ),
    # Python-dict quotes, label case/spacing normalised, truncated list still yields its complete objects
    (
        "loose json",
        "<answer>[{'bbox_2d': [0, 0, 10, 10], 'label': 'Cat'}, "
        '{"bbox_2d": [20, 20, 40, 40], "label": " DOG "}, {"bb',
        GT,
        SIZE,
        1.0,
        1.0,
        1.0,
        1.0,
    ),
    # ground truth without labels: class-agnostic
    ("class agnostic", f"<answer>{objs(([0, 0, 10, 10], 'x'))}</answer>", "[0, 0, 10, 10]", SIZE, 1.0, 1.0, 1.0, 1.0),
    # empty ground truth
    ("empty gt, empty pred", "<answer>[]</answer>", "<answer>[]</answer>", SIZE, 1.0, 1.0, 1.0, 1.0),
    ("empty gt, a box", f"<answer>{objs(CAT)}</answer>", "[]", SIZE, 0.0, 0.0, 0.0, 0.15),  # fa 1 -> 0.3 * 0.5
]


@pytest.mark.parametrize(
    ("completion", "solution", "columns", "ap", "ap50", "length", "wsum"),
    [case[1:] for case in DETECTION_CASES],
    ids=[case[0] for case in DETECTION_CASES],
)
def test_detection_table(completion, solution, columns, ap, ap50, length, wsum):
    kwargs = {"solution": [solution], **columns}
    assert od_ap_reward([completion], **kwargs) == [pytest.approx(ap, abs=1e-9)]
    assert od_ap50_reward([completion], **kwargs) == [pytest.approx(ap50, abs=1e-9)]
    assert od_length_reward([completion], **kwargs) == [pytest.approx(length, abs=1e-9)]
    assert weighted_sum_reward([completion], **kwargs) == [pytest.approx(wsum, abs=1e-9)]


def test_scores_set_the_ranking():
    gt = [Detection((0, 0, 10, 10), "cat")]
    wrong_first = [Detection((50, 50, 60, 60), "cat", 0.9), Detection((0, 0, 10, 10), "cat", 0.3)]
    right_first = [Detection((50, 50, 60, 60), "cat", 0.3), Detection((0, 0, 10, 10), "cat", 0.9)]
    assert coco_ap(wrong_first, gt, (100, 100)) == pytest.approx(0.5)
    assert coco_ap(right_first, gt, (100, 100)) == pytest.approx(1.0)
    text = '[{"bbox_2d": [50, 50, 60, 60], "label": "cat", "score": 0.9}, {"bbox_2d": [0, 0, 10, 10], "label": "cat"}]'
    assert [d.score for d in parse_detections(text)] == [0.9, 1.0]


def test_rows_without_boxes_get_none_and_bad_rows_raise():
    for fn in (od_ap_reward, od_ap50_reward, od_length_reward, weighted_sum_reward):
        assert fn(["[0, 0, 1, 1]", "[0, 0, 1, 1]"], solution=["<answer>3</answer>", "[0, 0, 1, 1]"]) == [None, 1.0]
        with pytest.raises(ValueError, match="Degenerate"):
            fn(["[0, 0, 1, 1]"], solution=["[5, 5, 5, 9]"])  # zero-area ground truth
        with pytest.raises(ValueError, match="solution"):
            fn(["[0, 0, 1, 1]"])
        with pytest.raises(ValueError):
            fn(["[0, 0, 1, 1]"], solution=["[0, 0, 1, 1]"], image_sizes=[[[0, 5]]], coord_sizes=[[[5, 5]]])


def test_greedy_match_prefers_higher_iou():
    gts = [Detection((0, 0, 10, 10)), Detection((5, 0, 15, 10))]
    preds = [Detection((4, 0, 14, 10)), Detection((0, 0, 10, 10))]
    # pred 1 / gt 0 IoU 1.0 first; pred 0 / gt 1 IoU 90/110 next
    assert greedy_match(preds, gts) == [(1, 0, 1.0), (0, 1, pytest.approx(90 / 110))]


def test_weighted_sum_parameters_from_reward_kwargs():
    (reward,) = build_reward_funcs(
        ["weighted_sum"], reward_kwargs={"weighted_sum": {"iou_weight": 1.0, "iou_threshold": 0.3}}
    )
    # IoU of [0,0,10,10] with [0,0,10,30] is 1/3 >= 0.3 -> matched, reward = mean IoU
    assert reward([objs(([0, 0, 10, 10], "cat"))], solution=[objs(([0, 0, 10, 30], "cat"))]) == [pytest.approx(1 / 3)]


def test_solution_detections():
    assert solution_detections("<answer>[]</answer>") == []
    assert solution_detections("```json\n[]\n```") == []
    assert solution_detections("no boxes") is None
    assert solution_detections(objs(CAT)) == [Detection((0.0, 0.0, 10.0, 10.0), "cat", 1.0)]


def test_pathological_predictions_stay_fast_and_bounded():
    many = (
        "<answer>"
        + objs(*[([i % 90, i % 90, i % 90 + 10, i % 90 + 10], f"l{i % 7}") for i in range(5000)])
        + "</answer>"
    )
    texts = [many, "{" * 200_000, "[" + "9" * 10_000 + ", 0, 5, 5]", "[1e999, 0, 5, 5]", '{"bbox_2d": [NaN, 0, 5, 5]}']
    start = time.perf_counter()
    for fn in (od_ap_reward, od_ap50_reward, od_length_reward, weighted_sum_reward):
        out = fn(texts, solution=[GT] * len(texts), **{k: v * len(texts) for k, v in SIZE.items()})
        assert all(0.0 <= v <= 1.0 for v in out)
    assert time.perf_counter() - start < 20


IOU_THRESHOLD_CASES = [
    ("<answer>[0, 0, 10, 10]</answer>", "[0, 0, 10, 10]", 1.0),
    ("<answer>[0, 0, 10, 20]</answer>", "[0, 0, 10, 10]", 1.0),  # IoU exactly 0.5 >= 0.5
    ("<answer>[0, 0, 10, 10]</answer>", "[5, 0, 15, 10]", 0.0),  # IoU 1/3
    ("<answer>no box</answer>", "[0, 0, 10, 10]", 0.0),
]


@pytest.mark.parametrize(("completion", "solution", "expected"), IOU_THRESHOLD_CASES)
def test_iou_threshold_table(completion, solution, expected):
    assert iou_threshold_reward([completion], solution=[solution]) == [expected]


def test_iou_threshold_kwarg():
    assert iou_reward(["[0, 0, 10, 10]"], solution=["[5, 0, 15, 10]"], threshold=0.3) == [1.0]
    assert iou_reward(["[0, 0, 10, 10]"], solution=["[5, 0, 15, 10]"]) == [pytest.approx(1 / 3)]
    (reward,) = build_reward_funcs(["iou"], reward_kwargs={"iou": {"threshold": 0.9}})
    assert reward(["[0, 0, 10, 10]"], solution=["[0, 0, 10, 11]"]) == [1.0]  # IoU 100/110
    with pytest.raises(ValueError):
        iou_reward(["[0, 0, 10, 10]"], solution=["[0, 0, 10, 10]"], threshold=1.5)
