"""Grounding geometry: boxes in normalised and pixel frames, size and solution parsing, the iou reward's limits,
and the point / polygon / trajectory measures RynnBrain's rewards build on (checked against textbook definitions
written out here and hand-worked values)."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from vlm_grpo.rewards.grounding import (
    box_area,
    box_iou,
    clip_box,
    discrete_frechet,
    dtw_mean_distance,
    first_size,
    iou_reward,
    point_in_polygon,
    polygon_iou,
    solution_box,
)

# ------------------------------------------------------------------------------------------------ boxes


def test_sub_pixel_boxes_in_a_normalised_frame():
    # models that answer in [0, 1] coordinates: areas below one must not be rounded up
    assert box_area((0.0, 0.0, 0.5, 0.25)) == 0.125
    assert box_iou((0.1, 0.1, 0.5, 0.5), (0.1, 0.1, 0.3, 0.5)) == pytest.approx(0.5)
    assert clip_box((0.1, 0.2, 0.5, 0.6), (1.0, 1.0)) == (0.1, 0.2, 0.5, 0.6)
    assert iou_reward(["[0.1, 0.1, 0.3, 0.5]"], solution=["[0.1, 0.1, 0.5, 0.5]"]) == [pytest.approx(0.5)]


def test_normalised_coordinate_frame_is_rescaled_to_pixels():
    # coord_sizes [1, 1]: the model answers in [0, 1]; image 200 x 100 pixels
    out = iou_reward(
        ["[0.1, 0.2, 0.5, 0.6]", "[0.1, 0.2, 0.3, 0.6]"],
        solution=["[20, 20, 100, 60]"] * 2,
        coord_sizes=[[[1, 1]]] * 2,
        image_sizes=[[[200, 100]]] * 2,
    )
    assert out == [pytest.approx(1.0), pytest.approx(0.5)]


@pytest.mark.parametrize("box", ["[-10, 0, -5, 10]", "[0, -10, 10, -5]", "[120, 0, 130, 10]"])
def test_box_entirely_outside_the_image_scores_zero(box):
    assert iou_reward([box], solution=["[0, 0, 10, 10]"], image_sizes=[[[100, 100]]]) == [0.0]


def test_sizes_given_as_width_height_dicts():
    assert first_size({"width": 640, "height": 480}) == (640.0, 480.0)
    assert first_size([{"width": 640, "height": 480}, {"width": 1, "height": 1}]) == (640.0, 480.0)
    out = iou_reward(
        ["[0, 0, 50, 50]"],
        solution=["[0, 0, 100, 100]"],
        coord_sizes=[[{"width": 100, "height": 100}]],
        image_sizes=[{"width": 200, "height": 200}],
    )
    assert out == [1.0]


def test_first_size_limits_and_messages():
    assert first_size([1, 1]) == (1.0, 1.0)
    assert first_size([0.5, 0.5]) == (0.5, 0.5)
    for bad in ([640, 0], [0, 480], [640, -1], [float("inf"), 480]):
        with pytest.raises(ValueError, match=r"^Expected a positive \[width, height\] size, got"):
            first_size(bad)
    for bad in ([640, 480, 3], ["wide", 480]):
        with pytest.raises(ValueError, match=r"^Expected a \[width, height\] size, got"):
            first_size(bad)


def test_solution_box_forms():
    assert solution_box([[0, 0, 1, 1], [2, 2, 5, 5], [10, 10, 20, 20]]) == (10.0, 10.0, 20.0, 20.0)
    assert solution_box("<answer>[0, 0, 1, 1] then [2, 3, 4, 5]</answer>") == (2.0, 3.0, 4.0, 5.0)
    for bad in ("no box here", [], 5, [0, 0, "a", 1], [0, 0, 1]):
        with pytest.raises(ValueError, match=r"^No \[x1, y1, x2, y2\] box in the solution"):
            solution_box(bad)
    long = "x" * 300
    with pytest.raises(ValueError) as err:
        solution_box(long)
    assert repr("x" * 200) in str(err.value) and repr("x" * 201) not in str(err.value)


@pytest.mark.parametrize("bad", [[5, 0, 5, 10], [0, 5, 10, 5], [6, 0, 5, 10]])
def test_degenerate_solution_box(bad):
    with pytest.raises(ValueError, match=r"^Degenerate solution box .* \(expected x1 < x2 and y1 < y2\)$"):
        solution_box(bad)


def test_iou_threshold_limits_and_degenerate_predictions():
    gt = "[0, 0, 10, 10]"
    # threshold 0 is allowed: any real box passes, a degenerate or missing one still scores 0
    preds = ["[50, 50, 60, 60]", "[5, 0, 5, 10]", "[0, 5, 10, 5]", "[10, 0, 5, 10]", "no box"]
    assert iou_reward(preds, solution=[gt] * 5, threshold=0.0) == [1.0, 0.0, 0.0, 0.0, 0.0]
    # threshold 1 is allowed: only an exact box passes
    assert iou_reward(["[0, 0, 10, 10]", "[0, 0, 10, 9]"], solution=[gt] * 2, threshold=1.0) == [1.0, 0.0]
    for bad in (-0.01, 1.01):
        with pytest.raises(ValueError, match=r"^iou threshold must be in \[0, 1\], got"):
            iou_reward(["[0, 0, 1, 1]"], solution=[gt], threshold=bad)
    with pytest.raises(ValueError, match=r"^The iou reward needs a 'solution' column$"):
        iou_reward(["[0, 0, 1, 1]"])


def test_box_far_right_of_x1_but_above_y():
    # a box whose y2 is below its x1 is still a real box: [20, 0, 30, 10]
    assert iou_reward(["[20, 0, 30, 10]"], solution=["[20, 0, 30, 10]"]) == [1.0]


# ------------------------------------------------------------------------------------------------ polygons

L_SHAPE = [(0, 0), (4, 0), (4, 2), (2, 2), (2, 4), (0, 4)]


@pytest.mark.parametrize(
    ("point", "inside"),
    [
        ((1, 1), True),
        ((3, 1), True),
        ((1, 3), True),
        ((1, 2), True),  # at the height of two vertices
        ((3, 3), False),  # the notch
        ((5, 1), False),
        ((-1, 1), False),
        ((1, 5), False),
        ((3, -1), False),
        ((-1, 2), False),  # outside, at the height of two vertices
        ((-1, 0), False),
        ((-1, 4), False),
        ((5, 2), False),
        ((4, 1), True),  # on an edge
        ((3, 2), True),
        ((2, 3), True),
        ((2, 2), True),  # reflex vertex
        ((0, 0), True),
        ((4, 0), True),
        ((0, 2), True),
        ((1, 4), True),
        ((6, 0), False),  # collinear with an edge, beyond it
        ((3, 4), False),
        ((2, 5), False),
        ((4, 3), False),
        ((0, -0.5), False),  # collinear with the left edge, below it
    ],
)
def test_point_in_l_shape(point, inside):
    assert point_in_polygon(point, L_SHAPE) is inside


def test_point_in_triangle_and_short_polygons():
    tri = [(0, 0), (4, 0), (0, 4)]
    assert point_in_polygon((1, 1), tri)
    assert point_in_polygon((2, 2), tri)  # on the hypotenuse
    assert not point_in_polygon((2.1, 2.1), tri)
    assert not point_in_polygon((3, 3), tri)
    assert not point_in_polygon((0, 0), [(0, 0), (4, 0)])


DIAMOND = [(12, 21), (13, 22), (12, 23), (11, 22)]  # |x - 12| + |y - 22| <= 1: slanted edges away from the axes


@pytest.mark.parametrize(
    ("point", "inside"),
    [
        ((12, 22), True),
        ((12.9, 22), True),
        ((12.5, 22.4), True),
        ((11.2, 21.2), False),
        ((11.4, 22.5), False),
        ((12.5, 22.5), True),
        ((12.6, 22.6), False),
        ((13.5, 22), False),
    ],
)
def test_point_in_diamond(point, inside):
    assert point_in_polygon(point, DIAMOND) is inside


def test_boundary_tolerance_scales_with_the_edge():
    # edge (100, 200) -> (104, 204) of a triangle lying above it: tolerance 1e-9 * (4 + 4) on the cross product
    # 4 * (y - 200) - 4 * (x - 100), i.e. a point 1e-9 below the edge counts as on it, 4e-9 below does not
    tri = [(100, 200), (104, 204), (100, 204)]
    assert point_in_polygon((102, 202 - 1e-9), tri)
    assert not point_in_polygon((102, 202 - 4e-9), tri)
    # short edges keep an absolute tolerance of 1e-9: cross 0.25 * (y - 0.25) - 0.25 * (x - 0.25)
    small = [(0.25, 0.25), (0.5, 0.5), (0.25, 0.5)]
    assert point_in_polygon((0.375, 0.375 - 2e-9), small)
    assert not point_in_polygon((0.375, 0.375 - 6e-9), small)


def _rect(x0: float, y0: float, x1: float, y1: float) -> list[tuple[float, float]]:
    return [(x0, y0), (x1, y0), (x1, y1), (x0, y1)]


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (_rect(10, 20, 14, 22), _rect(12, 20, 16, 22), 1 / 3),  # offset, wider than tall
        (_rect(10, 20, 12, 24), _rect(10, 22, 12, 26), 1 / 3),  # offset, taller than wide
        (_rect(0, 0, 2, 2), _rect(1, 1, 3, 3), 1 / 7),
        ([(5, 5), (7, 5), (5, 7)], _rect(5, 5, 7, 7), 0.5),  # triangle in its square
        (L_SHAPE, _rect(0, 0, 4, 4), 12 / 16),
        ([(0, 0), (4, 0), (4, 2), (0, 2)][::-1], _rect(2, 0, 6, 2), 1 / 3),  # clockwise
        (_rect(1000, 0, 1002, 2), _rect(1001, 0, 1003, 2), 1 / 3),  # far from the origin (large images)
        (_rect(0, 1000, 2, 1002), _rect(0, 1001, 2, 1003), 1 / 3),
        (DIAMOND, _rect(11, 21, 13, 23), 0.5),
    ],
)
def test_polygon_iou_matches_exact_areas(a, b, expected):
    assert polygon_iou(a, b) == pytest.approx(expected, abs=0.02)
    assert polygon_iou(b, a) == pytest.approx(expected, abs=0.02)


def test_polygon_iou_samples_cell_centres():
    # grid 2 over the box [0, 2] x [0, 2]: centres at 0.5 and 1.5 on each axis; the lower half holds 2 of the 4
    assert polygon_iou(_rect(0, 0, 2, 2), _rect(0, 0, 2, 1), grid=2) == 0.5
    assert polygon_iou(_rect(0, 0, 2, 2), _rect(0, 0, 1, 2), grid=2) == 0.5


def test_polygon_iou_degenerate_inputs():
    tri = [(0, 0), (2, 0), (0, 2)]
    assert polygon_iou(tri, [(0, 0), (1, 1)]) == 0.0
    assert polygon_iou([(0, 0), (1, 1)], tri) == 0.0
    assert polygon_iou([(1, 0), (1, 2), (1, 5)], [(1, 1), (1, 3), (1, 4)]) == 0.0  # all on a vertical line
    assert polygon_iou([(0, 1), (2, 1), (5, 1)], [(1, 1), (3, 1), (4, 1)]) == 0.0  # all on a horizontal line
    assert polygon_iou([(0, 0), (1, 1), (2, 2)], [(0, 0), (2, 2), (1, 1)]) == 0.0  # zero area, non-empty box


# ------------------------------------------------------------------------------------------------ trajectories


def _frechet_reference(p, q):
    @functools.cache
    def c(i, j):
        d = math.dist(p[i], q[j])
        if i == 0 and j == 0:
            return d
        if i == 0:
            return max(c(0, j - 1), d)
        if j == 0:
            return max(c(i - 1, 0), d)
        return max(min(c(i - 1, j), c(i - 1, j - 1), c(i, j - 1)), d)

    return c(len(p) - 1, len(q) - 1)


def _dtw_reference(p, q):
    """Every monotone warping path from (0, 0) to the end, enumerated: lowest cost, ties to the fewest steps."""
    best = (math.inf, 0)

    def walk(i, j, cost, steps):
        nonlocal best
        cost += math.dist(p[i], q[j])
        steps += 1
        if (i, j) == (len(p) - 1, len(q) - 1):
            best = min(best, (cost, steps))
            return
        for di, dj in ((1, 0), (0, 1), (1, 1)):
            if i + di < len(p) and j + dj < len(q):
                walk(i + di, j + dj, cost, steps)

    walk(0, 0, 0.0, 0)
    return best[0] / best[1]


def test_trajectory_distances_by_hand():
    p, q = [(0, 0), (1, 0), (2, 0)], [(0, 1), (2, 1)]
    assert discrete_frechet(p, q) == pytest.approx(math.sqrt(2))
    # DTW: (0,0)-(0,1) 1, (1,0)-(0,1) sqrt2 or -(2,1) sqrt2, (2,0)-(2,1) 1: cost 2 + sqrt2 over 3 steps
    assert dtw_mean_distance(p, q) == pytest.approx((2 + math.sqrt(2)) / 3)
    assert discrete_frechet([], q) == math.inf and dtw_mean_distance(p, []) == math.inf
    # a warping path may not jump from the end of one row back to the start of the next
    p, q = [(1, 5), (8, 7), (1, 4), (8, 4), (1, 8)], [(5, 8), (3, 9)]
    assert dtw_mean_distance(p, q) == pytest.approx(_dtw_reference(p, q))


def test_trajectory_distances_match_their_definitions():
    rng = random.Random(7)
    for n, m in itertools.product(range(1, 6), repeat=2):
        for _ in range(3):
            p = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(n)]
            q = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(m)]
            assert discrete_frechet(p, q) == pytest.approx(_frechet_reference(tuple(p), tuple(q)))
            assert dtw_mean_distance(p, q) == pytest.approx(_dtw_reference(p, q))
