"""RynnBrain parsers and rewards on hand-computed cases (coordinates 0–1000, ``<frame i>`` tags)."""

from __future__ import annotations

import json
import math
import time

import pytest

from vlm_grpo.rewards import SafeReward, build_reward_funcs
from vlm_grpo.rewards.rynnbrain import (
    SpatialAnswer,
    discrete_frechet,
    dtw_mean_distance,
    infer_task,
    parse_counting,
    parse_solution,
    parse_spatial,
    point_in_polygon,
    polygon_iou,
    rynn_affordance_reward,
    rynn_area_reward,
    rynn_counting_reward,
    rynn_general_reward,
    rynn_segment_reward,
    rynn_trajectory_reward,
)
from vlm_grpo.tasks import RYNNBRAIN_OUTPUT_FORMATS as OUTPUT_FORMATS
from vlm_grpo.tasks import RYNNBRAIN_SYSTEM_PROMPTS as SYSTEM_PROMPTS
from vlm_grpo.tasks import RYNNBRAIN_TASKS as TASKS


def answer(tag: str, body: str) -> str:
    return f"Reasoning about the frames. #### <answer><{tag}>{body}</{tag}></answer>"


def test_system_prompts_cover_every_task():
    assert set(SYSTEM_PROMPTS) == set(TASKS) == set(OUTPUT_FORMATS)
    assert SYSTEM_PROMPTS["trajectory"].startswith("You are an embodied agent.")
    assert "####" in SYSTEM_PROMPTS["general"]


# ----------------------------------------------------------------------------------------------- parsers


@pytest.mark.parametrize(
    ("text", "tag", "expected"),
    [
        (
            answer("trajectory", "<frame 3> (450, 320), (480, 350)"),
            "trajectory",
            SpatialAnswer(3, ((450, 320), (480, 350))),
        ),
        ("<affordance><frame1>[325.5, 480]</affordance>", "affordance", SpatialAnswer(1, ((325.5, 480.0),))),
        ("<area> (1, 2) </area>", "area", SpatialAnswer(None, ((1.0, 2.0),))),  # no frame
        ("<area><frame 2> (-5, 2000) </area>", "area", SpatialAnswer(2, ((0.0, 1000.0),))),  # clipped to 0–1000
        ("<area><frame 2> (nan, 2), (1e999, 3), (4, 5)</area>", "area", SpatialAnswer(2, ((4.0, 5.0),))),
        ("<AREA><frame 2> (1, 2)</AREA>", "area", SpatialAnswer(2, ((1.0, 2.0),))),  # tags case-insensitive
        ("<area><frame 2> (1, 2)", "area", None),  # unclosed
        ("<object>(1, 2)</object> #### no tag after the marker", "object", None),  # only after the last ####
        ("", "area", None),
    ],
)
def test_parse_spatial(text, tag, expected):
    assert parse_spatial(text, tag) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<counting>3</counting>", 3),
        ("#### <answer><counting> 12 </counting></answer>", 12),
        ("<counting>3.0</counting>", 3),
        ("<counting>three</counting>", None),
        ("3", None),
        ("<counting>" + "9" * 10_000 + "</counting>", None),
    ],
)
def test_parse_counting(text, expected):
    assert parse_counting(text) == expected


@pytest.mark.parametrize(
    ("solution", "tag", "expected"),
    [
        ('{"frame3": [[450, 320], [480, 350]]}', "trajectory", SpatialAnswer(3, ((450, 320), (480, 350)))),
        ('{"frame1": [[325, 480]]}{"frame2": [[1, 2]]}', "affordance", SpatialAnswer(1, ((325, 480),))),
        (
            '{"frame1": [[325, 480]], "region": [[300, 400], [400, 400], [400, 500]]}',
            "affordance",
            SpatialAnswer(1, ((325, 480),), ((300, 400), (400, 400), (400, 500))),
        ),
        ("[5, 0, 15, 10]", "object", SpatialAnswer(None, ((5, 0), (15, 10)))),
        (answer("object", "<frame 1> (5, 0), (15, 10)"), "object", SpatialAnswer(1, ((5, 0), (15, 10)))),
        ('#### <answer>{"frame 2": [[1, 2]]}</answer>', "area", SpatialAnswer(2, ((1, 2),))),
    ],
)
def test_parse_solution(solution, tag, expected):
    assert parse_solution(solution, tag) == expected


@pytest.mark.parametrize("solution", ["", "no points here", None, '{"frame1": []}'])
def test_parse_solution_rejects_unreadable(solution):
    with pytest.raises(ValueError):
        parse_solution(solution, "trajectory")


def test_distances():
    line = [(0, 0), (10, 0), (20, 0)]
    assert discrete_frechet(line, line) == 0
    assert discrete_frechet(line, [(0, 5), (10, 5), (20, 5)]) == 5
    assert discrete_frechet(line, [(0, 0), (20, 0)]) == 10  # (10, 0) couples with an end point
    assert dtw_mean_distance(line, [(0, 0), (20, 0)]) == pytest.approx(10 / 3)  # path of 3 steps: 0 + 10 + 0
    assert math.isinf(discrete_frechet([], line)) and math.isinf(dtw_mean_distance(line, []))


def test_polygons():
    square = [(0, 0), (100, 0), (100, 100), (0, 100)]
    assert point_in_polygon((50, 50), square) and point_in_polygon((100, 50), square)  # boundary counts
    assert not point_in_polygon((150, 50), square) and not point_in_polygon((1, 1), square[:2])
    assert polygon_iou(square, square) == pytest.approx(1.0)
    assert polygon_iou([(0, 0), (50, 0), (50, 100), (0, 100)], square) == pytest.approx(0.5)
    assert polygon_iou([(0, 0), (100, 0), (0, 100)], square) == pytest.approx(0.5, abs=0.01)  # rasterised
    assert polygon_iou([(200, 200), (300, 200), (300, 300)], square) == 0.0


# ----------------------------------------------------------------------------------------------- rewards

TRAJ_GT = '{"frame3": [[450, 320], [480, 350], [520, 400]]}'
TRAJ = "<frame 3> (450, 320), (480, 350), (520, 400)"
TRAJECTORY_CASES = [
    # (completion, kwargs, expected) -- 0.2 * [frame ok] + 0.8 * max(0, 1 - d / 250)
    (answer("trajectory", TRAJ), {}, 1.0),
    (answer("trajectory", TRAJ.replace("frame 3", "frame 2")), {}, 0.8),  # frame mismatch
    (answer("trajectory", TRAJ.replace("<frame 3>", "")), {}, 0.8),  # frame missing
    (answer("trajectory", "<frame 3> (450, 370), (480, 400), (520, 450)"), {}, 0.2 + 0.8 * 0.8),  # d = 50
    # an extra point (520, 500): Fréchet 100 -> 0.2 + 0.8 * 0.6; DTW path 0+0+0+100 over 4 steps = 25
    (answer("trajectory", TRAJ + ", (520, 500)"), {}, 0.68),
    (answer("trajectory", TRAJ + ", (520, 500)"), {"metric": "dtw"}, 0.2 + 0.8 * 0.9),
    (answer("trajectory", "<frame 3> (950, 320), (980, 350), (1000, 400)"), {}, 0.2),  # d >= 250
    (answer("trajectory", "<frame 3>"), {}, 0.0),  # no points
    ("I think it goes right", {}, 0.0),  # no tag
    (answer("trajectory", TRAJ), {"max_distance": 100, "frame_weight": 0.5}, 1.0),
]


@pytest.mark.parametrize(("completion", "kwargs", "expected"), TRAJECTORY_CASES)
def test_trajectory_table(completion, kwargs, expected):
    assert rynn_trajectory_reward([completion], solution=[TRAJ_GT], **kwargs) == [pytest.approx(expected)]


REGION = [[300, 400], [400, 400], [400, 500], [300, 500]]
AFFORDANCE_CASES = [
    # (completion, solution, expected) -- max(0, 1 - d / 100); with region 0.5 * that + 0.5 * inside
    (answer("affordance", "<frame 1> (325, 480)"), '{"frame1": [[325, 480]]}', 1.0),
    (answer("affordance", "<frame 1> (375, 480)"), '{"frame1": [[325, 480]]}', 0.5),  # d = 50
    (answer("affordance", "<frame 1> (325, 600)"), '{"frame1": [[325, 480]]}', 0.0),  # d = 120
    (answer("affordance", "<frame 2> (325, 480)"), '{"frame1": [[325, 480]]}', 0.0),  # frame mismatch
    (answer("affordance", "(325, 480)"), '{"frame1": [[325, 480]]}', 0.0),  # frame missing
    (answer("affordance", "(325, 480)"), "[325, 480]", 1.0),  # solution without a frame: not checked
    (answer("affordance", "<frame 1> (0, 0), (325, 480)"), '{"frame1": [[325, 480]]}', 0.0),  # first point counts
    (answer("affordance", "<frame 1> (110, 0)"), '{"frame1": [[325, 480], [100, 0]]}', 0.9),  # nearest true point
    (answer("affordance", "<frame 1> (375, 480)"), json.dumps({"frame1": [[325, 480]], "region": REGION}), 0.75),
    (answer("affordance", "<frame 1> (425, 480)"), json.dumps({"frame1": [[325, 480]], "region": REGION}), 0.0),
    (answer("affordance", "<frame 1> (350, 450)"), json.dumps({"frame1": [], "region": REGION}), 1.0),  # region only
    ("no answer", '{"frame1": [[325, 480]]}', 0.0),
]


@pytest.mark.parametrize(("completion", "solution", "expected"), AFFORDANCE_CASES)
def test_affordance_table(completion, solution, expected):
    assert rynn_affordance_reward([completion], solution=[solution]) == [pytest.approx(expected)]


SQUARE = '{"frame1": [[0, 0], [100, 0], [100, 100], [0, 100]]}'
AREA_CASES = [
    (answer("area", "<frame 1> (10, 10), (50, 50), (200, 200)"), {}, 2 / 3),
    (answer("area", "<frame 1> (100, 50)"), {}, 1.0),  # on the boundary
    (answer("area", "<frame 2> (10, 10)"), {}, 0.0),  # frame mismatch
    (answer("area", "<frame 1>"), {}, 0.0),
    (answer("area", "<frame 1> (0, 0), (50, 0), (50, 100), (0, 100)"), {"mode": "iou"}, 0.5),
    (answer("area", "<frame 1> (0, 0), (50, 0)"), {"mode": "iou"}, 0.0),  # not a polygon
]


@pytest.mark.parametrize(("completion", "kwargs", "expected"), AREA_CASES)
def test_area_table(completion, kwargs, expected):
    assert rynn_area_reward([completion], solution=[SQUARE], **kwargs) == [pytest.approx(expected)]


COUNTING_CASES = [
    # (completion, solution, graded, expected)
    (answer("counting", "4"), "<counting>4</counting>", False, 1.0),
    (answer("counting", "3"), "<counting>4</counting>", False, 0.0),
    (answer("counting", "3"), "4", True, 0.75),  # 1 - 1/4
    (answer("counting", "10"), "#### <answer>4</answer>", True, 0.0),  # 1 - 6/4 < 0
    (answer("counting", "1"), "0", True, 0.0),  # 1 - 1/max(0, 1)
    (answer("counting", "three"), "3", True, 0.0),
    ("3", "3", False, 0.0),  # no tag
]


@pytest.mark.parametrize(("completion", "solution", "graded", "expected"), COUNTING_CASES)
def test_counting_table(completion, solution, graded, expected):
    assert rynn_counting_reward([completion], solution=[solution], graded=graded) == [pytest.approx(expected)]


SEGMENT_CASES = [
    # (completion, solution, expected) -- IoU in 0–1000 space
    (answer("object", "<frame 1> (0, 0), (10, 10)"), '{"frame1": [[5, 0], [15, 10]]}', 1 / 3),  # 50 / 150
    (answer("object", "<frame 1> (5, 0), (15, 10)"), "[5, 0, 15, 10]", 1.0),
    (answer("object", "<frame 1> (15, 10), (5, 0)"), "[5, 0, 15, 10]", 0.0),  # reversed corners
    (answer("object", "<frame 1> (5, 0), (5, 10)"), "[5, 0, 15, 10]", 0.0),  # zero area
    (answer("object", "<frame 2> (5, 0), (15, 10)"), '{"frame1": [[5, 0], [15, 10]]}', 0.0),  # frame mismatch
    (answer("object", "<frame 1> (5, 0)"), "[5, 0, 15, 10]", 0.0),  # one corner
    (answer("object", "<frame 1> (990, 990), (1200, 1300)"), "[990, 990, 1000, 1000]", 1.0),  # clipped to 1000
]


@pytest.mark.parametrize(("completion", "solution", "expected"), SEGMENT_CASES)
def test_segment_table(completion, solution, expected):
    assert rynn_segment_reward([completion], solution=[solution]) == [pytest.approx(expected)]


def test_general_delegates_to_accuracy_after_the_marker():
    completions = ["Let me think: 40 + 2 #### 42", "x #### <answer>41</answer>", "#### (B)", "the answer is 42"]
    out = rynn_general_reward(
        completions,
        solution=["#### 42", "<answer>42</answer>", "B", "42"],
        accu_reward_method=[None, None, "mcq", None],
    )
    assert out == [1.0, 0.0, 1.0, 1.0]


def test_rewards_skip_rows_of_other_tasks():
    completions = [answer("counting", "4"), "#### 42"]
    out = rynn_counting_reward(completions, solution=["4", "42"], task_type=["counting", "general"])
    assert out == [1.0, None]
    assert rynn_trajectory_reward(completions, solution=["4", "42"], task_type=["Counting", "general"]) == [None, None]


def test_rynnbrain_dispatches_by_task_type():
    rows = [
        (answer("trajectory", TRAJ), TRAJ_GT, "trajectory", 1.0),
        (answer("counting", "3"), "4", "counting", 0.75),  # graded through the per-task options
        (answer("object", "<frame 1> (5, 0), (15, 10)"), answer("object", "<frame 1> (5, 0), (15, 10)"), None, 1.0),
        ("#### 42", "#### 42", None, 1.0),  # inferred general
        ("whatever", '{"frame1": [[1, 2]]}', None, None),  # ambiguous JSON without a task type
        ("whatever", "x", "rec", None),  # not a RynnBrain task
    ]
    (reward,) = build_reward_funcs(["rynnbrain"], reward_kwargs={"rynnbrain": {"counting": {"graded": True}}})
    out = reward([r[0] for r in rows], solution=[r[1] for r in rows], task_type=[r[2] for r in rows])
    assert out == [pytest.approx(r[3]) if r[3] is not None else None for r in rows]


def test_infer_task():
    assert infer_task("<answer><object>(1,2),(3,4)</object></answer>") == "segment"
    assert infer_task("<counting>3</counting>") == "counting"
    assert infer_task('{"frame1": [[1, 2]]}') is None
    assert infer_task("Paris") == "general"


def test_malformed_rows_are_isolated():
    safe = SafeReward(rynn_trajectory_reward, "rynn_trajectory")
    out = safe([answer("trajectory", TRAJ)] * 2, solution=[TRAJ_GT, "no points"])
    assert out == [1.0, None] and safe.failures == 1
    with pytest.raises(ValueError, match="metric"):
        rynn_trajectory_reward(["x"], solution=[TRAJ_GT], metric="euclid")
    with pytest.raises(ValueError):
        rynn_area_reward([answer("area", "<frame 1> (1, 1)")], solution=['{"frame1": [[0, 0], [1, 1]]}'])
    with pytest.raises(ValueError):
        rynn_segment_reward(["x"], solution=["[5, 5, 5, 10]"])


def test_long_trajectories_are_capped_and_fast():
    long = answer("trajectory", "<frame 3> " + ", ".join(f"({i % 1000}, {i % 7})" for i in range(50_000)))
    start = time.perf_counter()
    for metric in ("frechet", "dtw"):
        (value,) = rynn_trajectory_reward([long], solution=[TRAJ_GT], metric=metric)
        assert 0.0 <= value <= 1.0
    assert time.perf_counter() - start < 5
