"""Hand-computed tables for the format rewards of the reward library: configurable tags, ViVQA-X
(think/answer/explain), Lewis-game speaker (thinking/coarse/detailed) and RynnBrain (#### <answer><task>…)."""

from __future__ import annotations

import time

import pytest

from vlm_grpo.rewards import build_reward_funcs
from vlm_grpo.rewards.format import (
    format_explain_reward,
    format_reward,
    format_rynnbrain_reward,
    format_speaker_strict_reward,
    rynnbrain_format_score,
)

EXPLAIN_CASES = [
    ("<think>a</think><answer>chó</answer><explain>vì nó sủa</explain>", 1.0),
    ("<think>a</think>\n<answer>chó</answer>\n<explain>x</explain>\n", 1.0),
    ("<think>a</think><answer>chó</answer>", 0.0),  # explain missing
    ("<think>a</think><explain>x</explain><answer>chó</answer>", 0.0),  # out of order
    ("<think>a</think><answer>chó</answer><explain>x", 0.0),  # explain not closed
    ("<think>a</think><answer>chó<explain>x</explain></answer>", 0.0),  # nested
    ("<answer>chó</answer><explain>x</explain>", 0.0),  # think missing
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), EXPLAIN_CASES)
def test_format_explain_table(completion, expected):
    assert format_explain_reward([completion]) == [expected]


SPEAKER_CASES = [
    ("<thinking>r</thinking>\n<coarse>A dog</coarse>\n<detailed>A brown dog.</detailed>", 1.0),
    ("<thinking></thinking><coarse></coarse><detailed></detailed>", 1.0),
    ("<thinking>r</thinking><coarse>A dog</coarse>", 0.0),  # detailed missing
    ("<thinking>r</thinking><coarse>A dog<detailed>x</detailed>", 0.0),  # coarse not closed
    ("<coarse>A dog</coarse><thinking>r</thinking><detailed>x</detailed>", 0.0),  # order
    ("<thinking>r</thinking><coarse>A dog</coarse><detailed>x</detailed> extra", 0.0),  # trailing text
    ("<think>r</think><coarse>A dog</coarse><detailed>x</detailed>", 0.0),  # wrong tag name
    ("<thinking>r</thinking><coarse>a</coarse><coarse>b</coarse><detailed>x</detailed>", 0.0),  # repeated
]


@pytest.mark.parametrize(("completion", "expected"), SPEAKER_CASES)
def test_format_speaker_strict_table(completion, expected):
    assert format_speaker_strict_reward([completion]) == [expected]


def test_format_tags_are_configurable_through_reward_kwargs():
    (reward,) = build_reward_funcs(["format"], reward_kwargs={"format": {"tags": ["think", "answer", "explain"]}})
    out = reward(["<think>a</think><answer>b</answer><explain>c</explain>", "<think>a</think><answer>b</answer>"])
    assert out == [1.0, 0.0]
    assert format_reward(["<thinking>x</thinking><coarse>y</coarse>"], tags=("thinking", "coarse")) == [1.0]
    # the default tag list is untouched
    assert format_reward(["<think>a</think><answer>b</answer>"]) == [1.0]


def test_format_bad_tags_kwarg_fails_the_batch_not_the_run():
    # max_failed_batches=0: keep training; by default such a reward stops the run (tests/test_reward_kinds.py)
    (reward,) = build_reward_funcs(["format"], reward_kwargs={"format": {"tags": ["a>b"]}}, max_failed_batches=0)
    assert reward(["<think>a</think><answer>b</answer>"]) == [None]
    assert reward.failures == 1


TRAJ = "<answer><trajectory><frame 3> (450, 320), (480, 350), (520, 400)</trajectory></answer>"
RYNN_CASES = [
    # (completion, task_type, expected)
    (f"The arm moves right. #### {TRAJ}", "trajectory", 1.0),
    (f"#### {TRAJ}\n", "trajectory", 1.0),
    ("x #### <answer><trajectory><frame 3> (450, 320) (480, 350),(1,2)</trajectory></answer>", "trajectory", 1.0),
    (f"The arm moves right. {TRAJ}", "trajectory", 0.0),  # no ####
    (f"a #### b #### {TRAJ}", "trajectory", 0.0),  # two ####
    ("#### <answer><trajectory><frame 3> (450, 320)</trajectory>", "trajectory", 0.0),  # answer not closed
    ("#### <trajectory><frame 3> (450, 320)</trajectory>", "trajectory", 0.0),  # no answer tag
    ("#### <answer><trajectory>(450, 320)</trajectory></answer>", "trajectory", 0.0),  # no <frame i>
    ("#### <answer><trajectory><frame 3></trajectory></answer>", "trajectory", 0.0),  # no point
    (f"#### {TRAJ} trailing", "trajectory", 0.0),
    (f"#### {TRAJ}", "area", 0.0),  # the row's task decides the tag
    ("I count. #### <answer><counting>3</counting></answer>", "counting", 1.0),
    ("#### <answer><counting>three</counting></answer>", "counting", 0.0),
    ("#### <answer><affordance><frame 1> (325, 480)</affordance></answer>", "affordance", 1.0),
    ("#### <answer><area><frame 2> (1, 2), (3, 4), (5, 6)</area></answer>", "area", 1.0),
    ("#### <answer><object><frame 1> (10, 20), (30, 40)</object></answer>", "segment", 1.0),
    ("#### <answer><object><frame 1> (10, 20)</object></answer>", "segment", 0.0),  # one corner
    ("#### <answer><segment><frame 1> (10, 20), (30, 40)</segment></answer>", "segment", 0.0),  # tag is <object>
    ("Step by step... #### 42", "general", 1.0),
    ("Step by step... #### <answer>42</answer>", "general", 1.0),
    ("Step by step... ####   ", "general", 0.0),  # empty answer
    ("Step by step... 42", "general", 0.0),
    ("#### <answer><counting>3</counting></answer>", None, 1.0),  # no task_type: any known form
    ("#### 42", None, 1.0),
    ("42", None, 0.0),
    ("", "trajectory", 0.0),
]


@pytest.mark.parametrize(("completion", "task", "expected"), RYNN_CASES)
def test_format_rynnbrain_table(completion, task, expected):
    assert format_rynnbrain_reward([completion], task_type=[task]) == [expected]


def test_format_rynnbrain_batch_and_missing_column():
    out = format_rynnbrain_reward(["#### 42", f"#### {TRAJ}"])  # no task_type column
    assert out == [1.0, 1.0]


def test_format_rynnbrain_is_linear_on_adversarial_text():
    texts = [
        "#### <answer><trajectory><frame 1> (1,2)" + " " * 90_000 + "x",
        "#### <answer><trajectory><frame 1>" + " (1,2)," * 12_000 + " x",
        "#### <answer>" + " " * 90_000,
        "#" * 99_999,
        "<frame 1> (1, 2) " * 5_000,
    ]
    start = time.perf_counter()
    for task in ("trajectory", "segment", "general", None):
        assert [rynnbrain_format_score(t, task) for t in texts] == [0.0] * len(texts)
    assert time.perf_counter() - start < 3
