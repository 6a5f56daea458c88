"""Hand-computed tables for the built-in accuracy, format and IoU rewards."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from vlm_grpo.rewards import REWARDS, SafeReward
from vlm_grpo.rewards.accuracy import ACCURACY_METHODS, accuracy_reward, normalize_text, single_number
from vlm_grpo.rewards.format import extract_answer, extract_tag, format_reward, make_format_reward
from vlm_grpo.rewards.grounding import (
    box_iou,
    clip_box,
    first_size,
    iou_reward,
    parse_boxes,
    rescale_box,
    solution_box,
)

# Completion texts no reward may raise on.
WEIRD_TEXTS = [
    "",
    " ",
    "<answer>",
    "</answer>",
    "</answer><answer>",
    "<answer></answer>",
    "<answer>3",
    "<think>unclosed <answer>[1, 2, 3, 4]",
    "<answer>" * 20_000,
    "<think>" * 20_000 + "</answer>",
    "x" * 300_000,
    "9^9^9^9",
    "<answer>9^9^9^9^9</answer>",
    "<answer>" + "9" * 100 + "^" + "9" * 100 + "</answer>",
    "<answer>" + "1" * 5000 + "</answer>",
    "\\frac{" * 1000,
    "\\boxed{" * 500,
    "$$$$\\\\{{}}}}[[]]",
    "[1e999, 0, 1e999, 5]",
    "[" + "9" * 400 + ", 0, 5, 5]",
    "[-5, -5, -1, -1]",
    "ünïcödé 🤖 <answer>数字 三</answer> \u2212\u200b\x00",
    "<ANSWER>3</ANSWER>",
    "NaN inf -inf",
]


# ----------------------------------------------------------------------------------------------- accuracy

ACCURACY_CASES = [
    # (completion, solution, accu_reward_method, expected)
    ("<think>..</think><answer> 3 </answer>", "<answer>3</answer>", None, 1.0),
    ("<think>..</think><answer> 3 </answer>", "<answer> 3 </answer>", "default", 1.0),
    ("<answer>4</answer>", "<answer>3</answer>", None, 0.0),
    ("3.0", "3", "numeric", 1.0),
    ("3.0000001", "3", "numeric", 1.0),  # relative error 3.3e-8 < 1e-6
    ("3.001", "3", "numeric", 0.0),
    ("1,000", "1000", "numeric", 1.0),
    ("about 7 apples", "7", "numeric", 1.0),
    ("7 apples and 8 pears", "7", "numeric", 0.0),  # two numbers: no single number
    ("x^3", "3", "numeric", 0.0),  # 3 is an exponent, not the answer
    ("\\frac{1}{2}", "0.5", "math", 1.0),
    ("The answer is \\boxed{1/2}", "\\frac{1}{2}", "math", 1.0),
    ("first 5 then \\boxed{2}", "2", "math", 1.0),
    ("\\frac{1}{3}", "0.5", "math", 0.0),
    ("no math here", "2", "math", 0.0),
    ("Red.", "red", "exact", 1.0),
    ("  The   Eiffel Tower! ", "the eiffel tower", "exact", 1.0),
    ("ＲＥＤ", "red", "exact", 1.0),  # NFKC folds full-width letters
    ("blue", "red", "exact", 0.0),
    ("3.5", "35", "exact", 0.0),  # inner punctuation is kept
    ("new-york", "new york", "exact", 0.0),
    ("Paris", "paris", None, 1.0),  # default: math-verify can't parse, no number -> exact match
    ("3.0", "3", None, 1.0),  # default: math-verify decides
    ("\\frac{1}{2}", "0.5", None, 1.0),
    ("x^3", "3", None, 0.0),
    ("9^9^9^9", "3", None, 0.0),  # too wild to compare safely -> falls through -> 0
    ("The answer is 3", "3", None, 1.0),  # no answer tag -> whole text
    ("<answer>2</answer> oops <answer>3</answer>", "3", None, 1.0),  # last tag wins
    ("<answer>2</answer> oops <answer>3</answer>", "2", None, 0.0),
    ("<answer>A</answer>", "<answer>a</answer>", "EXACT", 1.0),  # method names are case-insensitive
    ("", "3", None, 0.0),
    ("<answer></answer>", "3", None, 0.0),
]


@pytest.mark.parametrize(("completion", "solution", "method", "expected"), ACCURACY_CASES)
def test_accuracy_table(completion, solution, method, expected):
    assert accuracy_reward([completion], solution=[solution], accu_reward_method=[method]) == [expected]


def test_accuracy_batch_mixed_methods_and_chat_messages():
    completions = [
        [{"role": "assistant", "content": "<think>hm</think><answer>3</answer>"}],
        [{"role": "assistant", "content": [{"type": "text", "text": "<answer>Red.</answer>"}]}],
        "<answer>0.5</answer>",
    ]
    out = accuracy_reward(
        completions, solution=["3", "red", "\\frac{1}{2}"], accu_reward_method=["numeric", "exact", "math"]
    )
    assert out == [1.0, 1.0, 1.0]


def test_accuracy_missing_method_column_means_default():
    out = accuracy_reward(["<answer>3</answer>", "<answer>4</answer>"], solution=["3", "3"], task_type=["a", "b"])
    assert out == [1.0, 0.0]


def test_accuracy_unknown_method_raises_with_known_names():
    with pytest.raises(
        ValueError, match=r"Unknown accu_reward_method 'no_such_method'\. Known: .*default.*exact.*fuzzy.*math.*mcq"
    ):
        accuracy_reward(["3"], solution=["3"], accu_reward_method=["no_such_method"])


@pytest.mark.parametrize(
    ("solution", "method"),
    [("", None), ("<answer> </answer>", "exact"), ("red", "math"), ("1 or 2", "numeric"), (None, None)],
)
def test_accuracy_malformed_rows_raise(solution, method):
    with pytest.raises(ValueError):
        accuracy_reward(["3"], solution=[solution], accu_reward_method=[method])


def test_accuracy_needs_solution_column():
    with pytest.raises(ValueError, match="solution"):
        accuracy_reward(["3"])


def test_accuracy_unknown_method_through_safe_reward(caplog):
    safe = SafeReward(accuracy_reward, "accuracy")
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.rewards.base"):
        out = safe(["3", "3"], solution=["3", "3"], accu_reward_method=["default", "nope"])
    assert out == [1.0, None]
    assert safe.failures == 1
    assert "nope" in caplog.text


def test_accuracy_methods_registered():
    assert {"default", "math", "numeric", "exact"} <= set(ACCURACY_METHODS)


@pytest.mark.parametrize("method", ["default", "math", "numeric", "exact"])
def test_accuracy_never_raises_on_completion_text(method):
    solution = "3" if method != "exact" else "red"
    start = time.perf_counter()
    out = accuracy_reward(
        WEIRD_TEXTS, solution=[solution] * len(WEIRD_TEXTS), accu_reward_method=[method] * len(WEIRD_TEXTS)
    )
    assert len(out) == len(WEIRD_TEXTS) and set(out) <= {0.0, 1.0}
    assert time.perf_counter() - start < 10


def test_accuracy_works_outside_the_main_thread():
    # math-verify's signal-based timeout can't work in worker threads; the reward must still answer correctly.
    def run(_):
        return accuracy_reward(
            ["\\frac{1}{2}", "<answer>3.0</answer>", "9^9^9^9", "wrong"],
            solution=["0.5", "3", "3", "3"],
            accu_reward_method=["math", None, None, None],
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, range(4)))
    assert all(r == [1.0, 1.0, 0.0, 0.0] for r in results)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3", 3.0), ("-2.5e3", -2500.0), ("1,000", 1000.0), ("x-3", None), ("v2", None), ("2^3", None), ("1 2", None)],
)
def test_single_number(text, expected):
    assert single_number(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("Red.", "red"), ("  a \n b ", "a b"), ("(A)", "a"), ("don't", "don't"), ("3.5", "3.5"), ("U.S.", "u.s")],
)
def test_normalize_text(text, expected):
    assert normalize_text(text) == expected


# ----------------------------------------------------------------------------------------------- answer tags


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer> 3 </answer>", "3"),
        ("plain 3", "plain 3"),
        ("<answer>1</answer><answer>2</answer>", "2"),
        ("<answer>1</answer><answer>2", "1"),  # the unclosed one is no answer
        ("<Answer>x</ANSWER>", "x"),
        ("<answer>3", "<answer>3"),  # no complete tag -> whole text
        ("", ""),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_tag_missing_is_none():
    assert extract_tag("<think>a</think>", "answer") is None
    assert extract_tag("</answer><answer>", "answer") is None
    assert extract_tag("<think>a</think>", "think") == "a"


# ----------------------------------------------------------------------------------------------- format

FORMAT_CASES = [
    ("<think>a</think><answer>b</answer>", 1.0),
    ("  <think>a</think>\n\n<answer>b</answer>\n", 1.0),
    ("<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>", 1.0),
    ("<think></think><answer></answer>", 1.0),  # empty blocks are allowed
    ("<think>mentions <thinking> and <answers></think><answer>b</answer>", 1.0),  # not our tags
    ("<think>a</think><answer>b", 0.0),  # missing close
    ("<think>a<answer>b</answer>", 0.0),  # think not closed
    ("<answer>b</answer><think>a</think>", 0.0),  # reversed
    ("<think>a<think>b</think></think><answer>c</answer>", 0.0),  # nested
    ("<think>a</think><answer>b<answer>c</answer></answer>", 0.0),  # nested
    ("<think>a<answer>x</answer></think><answer>c</answer>", 0.0),  # answer inside think
    ("<think>a</think>text<answer>b</answer>", 0.0),  # text between
    ("pre <think>a</think><answer>b</answer>", 0.0),  # text before
    ("<think>a</think><answer>b</answer> post", 0.0),  # text after
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),  # repeated
    ("<answer>b</answer>", 0.0),  # think missing
    ("<think>a</think>", 0.0),  # answer missing
    ("<THINK>a</THINK><answer>b</answer>", 0.0),  # case-sensitive
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_format_table(completion, expected):
    assert format_reward([completion]) == [expected]


def test_format_chat_messages_and_extra_columns():
    completion = [{"role": "assistant", "content": "<think>a</think><answer>b</answer>"}]
    assert format_reward([completion, "nope"], solution=["x", "y"], trainer_state=None) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>b</answer><explain>c</explain>", 1.0),
        ("<think>a</think> <answer>b</answer>\n<explain>c</explain> ", 1.0),
        ("<think>a</think><answer>b</answer>", 0.0),
        ("<think>a</think><explain>c</explain><answer>b</answer>", 0.0),
        ("<think>a</think><answer>b<explain>c</explain></answer>", 0.0),
    ],
)
def test_make_format_reward_custom_tags(completion, expected):
    reward = make_format_reward(("think", "answer", "explain"), "format_explain")
    assert reward.__name__ == "format_explain"
    assert "Range" in reward.__doc__
    assert reward([completion]) == [expected]


@pytest.mark.parametrize("tags", [(), ("think", "think"), ("a>b",), "think", ("",)])
def test_make_format_reward_rejects_bad_tags(tags):
    with pytest.raises((ValueError, TypeError)):
        make_format_reward(tags, "bad")


def test_format_never_raises_and_stays_fast():
    texts = [*WEIRD_TEXTS, "<think>" + "a" * 1_000_000 + "</think><answer>b</answer>", "<think>a</think>" * 50_000]
    start = time.perf_counter()
    out = format_reward(texts)
    assert out[:-2] == [0.0] * len(WEIRD_TEXTS)
    assert out[-2:] == [1.0, 0.0]
    assert time.perf_counter() - start < 5


# ----------------------------------------------------------------------------------------------- IoU

IOU_CASES = [
    # (completion, solution, extra columns, expected)
    ("<answer>[10, 20, 50, 60]</answer>", "<answer>[10, 20, 50, 60]</answer>", {}, 1.0),
    ("<answer>[0,0,10,10]</answer>", "[5, 0, 15, 10]", {}, 50 / 150),  # half overlap
    ("<answer>[0.0, 0.0, 10.0, 10.0]</answer>", "[0,0,10,10]", {}, 1.0),
    ("<answer>[0, 0, 10, 10]</answer>", "[0, 0, 20, 20]", {}, 100 / 400),  # contained
    ("<answer>[0, 0, 10, 10]</answer>", "[20, 20, 30, 30]", {}, 0.0),  # disjoint
    ("<answer>[0, 0, 10, 10]</answer>", "[10, 0, 20, 10]", {}, 0.0),  # touching edges
    (  # JSON output
        '<answer>```json\n[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}]\n```</answer>',
        "[5, 0, 15, 10]",
        {},
        1 / 3,
    ),
    (  # Qwen2.5-VL frame 224x112 for a 448x224 image: [10,10,20,20] -> [20,20,40,40]
        "<answer>[10, 10, 20, 20]</answer>",
        "[20, 20, 40, 40]",
        {"coord_sizes": [[[224, 112]]], "image_sizes": [[[448, 224]]]},
        1.0,
    ),
    (  # non-uniform scale: x * 2, y * 4 -> [20, 40, 40, 80]
        "<answer>[10, 10, 20, 20]</answer>",
        "[20, 40, 40, 80]",
        {"coord_sizes": [[[100, 100]]], "image_sizes": [[[200, 400]]]},
        1.0,
    ),
    (  # normalised 0-1000 frame on a 500x250 image: [100,200,300,400] -> [50,50,150,100]
        "<answer>[100, 200, 300, 400]</answer>",
        "[50, 50, 150, 100]",
        {"coord_sizes": [[[1000, 1000]]], "image_sizes": [[[500, 250]]]},
        1.0,
    ),
    (  # only image_sizes: no rescale (box already in original pixels)
        "<answer>[10, 10, 20, 20]</answer>",
        "[10, 10, 20, 20]",
        {"image_sizes": [[[448, 224]]]},
        1.0,
    ),
    (  # only coord_sizes: no rescale
        "<answer>[10, 10, 20, 20]</answer>",
        "[10, 10, 20, 20]",
        {"coord_sizes": [[[224, 112]]]},
        1.0,
    ),
    (  # partly outside the 100x100 image: clipped to [50, 50, 100, 100]
        "<answer>[50, 50, 150, 150]</answer>",
        "[50, 50, 100, 100]",
        {"image_sizes": [[[100, 100]]]},
        1.0,
    ),
    (  # negative coordinates clipped to 0: [0, 0, 10, 10]
        "<answer>[-10, -10, 10, 10]</answer>",
        "[0, 0, 10, 10]",
        {"image_sizes": [[[100, 100]]]},
        1.0,
    ),
    (  # fully outside the image: degenerate after clipping
        "<answer>[150, 150, 200, 200]</answer>",
        "[50, 50, 100, 100]",
        {"image_sizes": [[[100, 100]]]},
        0.0,
    ),
    ("<answer>[10, 10, 10, 20]</answer>", "[0, 0, 20, 20]", {}, 0.0),  # zero width
    ("<answer>[20, 20, 10, 10]</answer>", "[0, 0, 20, 20]", {}, 0.0),  # reversed corners
    ("<answer>[0, 0, 10, 10] no, [5, 0, 15, 10]</answer>", "[5, 0, 15, 10]", {}, 1.0),  # last box wins
    ("<think>[5, 0, 15, 10]</think><answer>[0, 0, 10, 10]</answer>", "[0, 0, 10, 10]", {}, 1.0),  # answer tag only
    ("I think it is [0, 0, 10, 10]", "[0, 0, 10, 10]", {}, 1.0),  # no tag -> whole text
    ("<answer>no box here</answer>", "[0, 0, 10, 10]", {}, 0.0),
    ("<answer>[1, 2, 3]</answer>", "[0, 0, 10, 10]", {}, 0.0),
    ("<answer>[0, 0, 10, 10]</answer>", [5, 0, 15, 10], {}, 1 / 3),  # solution given as a list
]


@pytest.mark.parametrize(("completion", "solution", "extra", "expected"), IOU_CASES)
def test_iou_table(completion, solution, extra, expected):
    out = iou_reward([completion], solution=[solution], **extra)
    assert out == [pytest.approx(expected)]


def test_iou_batch_uses_each_rows_sizes():
    out = iou_reward(
        ["[10, 10, 20, 20]", "[10, 10, 20, 20]", "[10, 10, 20, 20]"],
        solution=["[20, 20, 40, 40]", "[10, 10, 20, 20]", "[20, 20, 40, 40]"],
        coord_sizes=[[[224, 112]], None, [[224, 112], [50, 50]]],
        image_sizes=[[[448, 224]], [[448, 224]], [[448, 224], [100, 100]]],
    )
    assert out == [1.0, 1.0, 1.0]


def test_iou_does_not_apply_to_rows_without_a_box():
    # A counting row in a mixed REC + counting set: no reward (None), not a failure.
    assert iou_reward(["[0, 0, 10, 10]", "[0, 0, 10, 10]"], solution=["<answer>3</answer>", "[0, 0, 10, 10]"]) == [
        None,
        1.0,
    ]


@pytest.mark.parametrize("solution", ["[10, 10, 5, 20]", None, [1, 2]])
def test_iou_malformed_solution_raises(solution):
    with pytest.raises(ValueError):
        iou_reward(["[0, 0, 10, 10]"], solution=[solution])


def test_iou_bad_size_raises():
    with pytest.raises(ValueError):
        iou_reward(["[0, 0, 10, 10]"], solution=["[0, 0, 10, 10]"], image_sizes=[[[0, 10]]], coord_sizes=[[[5, 5]]])


def test_iou_needs_solution_column():
    with pytest.raises(ValueError, match="solution"):
        iou_reward(["[0, 0, 10, 10]"])


def test_iou_never_raises_on_completion_text():
    n = len(WEIRD_TEXTS)
    out = iou_reward(WEIRD_TEXTS, solution=["[0, 0, 10, 10]"] * n, image_sizes=[[[100, 100]]] * n)
    assert len(out) == n and all(0.0 <= v <= 1.0 for v in out)
    # "[-5, -5, -1, -1]" is fully outside the image -> 0; "<think>unclosed <answer>[1, 2, 3, 4]" -> whole text
    assert out[WEIRD_TEXTS.index("[-5, -5, -1, -1]")] == 0.0
    assert out[WEIRD_TEXTS.index("<think>unclosed <answer>[1, 2, 3, 4]")] == pytest.approx(4 / 100)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1, 2, 3, 4]", [(1.0, 2.0, 3.0, 4.0)]),
        ("[1.5,2.5,3,4] and [ 5 , 6 , 7 , 8 ]", [(1.5, 2.5, 3.0, 4.0), (5.0, 6.0, 7.0, 8.0)]),
        ('{"bbox_2d": [-1, 0, 1e2, .5]}', [(-1.0, 0.0, 100.0, 0.5)]),
        ("[1, 2, 3, 4, 5]", []),
        ("[1, 2, 3]", []),
        ("[[1, 2, 3, 4]]", [(1.0, 2.0, 3.0, 4.0)]),
        ("[1e999, 0, 1, 1]", []),
        ("", []),
    ],
)
def test_parse_boxes(text, expected):
    assert parse_boxes(text) == expected


def test_box_helpers():
    assert box_iou((0, 0, 10, 10), (5, 0, 15, 10)) == pytest.approx(1 / 3)
    assert box_iou((0, 0, 10, 10), (0, 0, 10, 10)) == 1.0
    assert box_iou((0, 0, 0, 0), (0, 0, 0, 0)) == 0.0
    assert rescale_box((10, 10, 20, 20), (224, 112), (448, 224)) == (20, 20, 40, 40)
    assert clip_box((-5, 5, 120, 90), (100, 80)) == (0, 5, 100, 80)
    assert first_size([[448, 224], [10, 10]]) == (448.0, 224.0)
    assert first_size([448, 224]) == (448.0, 224.0)
    assert first_size(None) is None and first_size([]) is None
    assert solution_box("<answer>[1, 2, 3, 4]</answer>") == (1.0, 2.0, 3.0, 4.0)


# ----------------------------------------------------------------------------------------------- registry


def test_builtin_rewards_registered_and_documented():
    assert REWARDS.get("accuracy") is accuracy_reward
    assert REWARDS.get("format") is format_reward
    assert REWARDS.get("iou") is iou_reward
    for fn in (accuracy_reward, format_reward, iou_reward):
        assert "Range" in fn.__doc__ or "[0, 1]" in fn.__doc__
