"""Property-based robustness of every registered reward: random and adversarial completions (empty, huge, unicode,
unclosed and nested tags, NaN strings, 10k-digit numbers, ...) never make a reward raise, and every value is finite
and inside the reward's documented range. Rows are well-formed, so every value must also be a number (not None).

Over the whole module at least 10,000 completions are scored (checked by the last test).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlm_grpo.rewards import REWARDS, reward_kind
from vlm_grpo.rewards.base import reward_inputs_from_kwargs
from vlm_grpo.tasks import RYNNBRAIN_TASKS as TASKS

EXAMPLES_PER_REWARD = 25
BATCH = (12, 28)
MIN_TOTAL = 10_000
SECONDS_PER_BATCH = 15.0

# Rewards served by another process (HTTP listener, LLM judge): they need a live service and are tested with one
# in their own test files; everything else registered must have an entry in ROWS below.
NETWORK_REWARDS = {"listener", "http", "llm_judge"}

ACCURACY_ROWS = [
    ("3", None),
    ("<answer>\\frac{1}{2}</answer>", "math"),
    ("(B)", "mcq"),
    ("yes", "yes_no"),
    ("Red.", "exact"),
    ("the red car", "fuzzy"),
    ("con chó", "vqa_graded"),
    ("7", "numeric"),
    ("B", "default"),
]
DET_GT = [
    '<answer>[{"bbox_2d": [0, 0, 10, 10], "label": "cat"}, {"bbox_2d": [20, 20, 40, 40], "label": "dog"}]</answer>',
    "[10, 10, 50, 50]",
    "<answer>[]</answer>",
]
RYNN_ROWS = {
    "trajectory": '{"frame3": [[450, 320], [480, 350], [520, 400]]}',
    "affordance": '{"frame1": [[325, 480]], "region": [[300, 400], [400, 400], [400, 500]]}',
    "area": '{"frame1": [[0, 0], [100, 0], [100, 100], [0, 100]]}',
    "counting": "<counting>4</counting>",
    "segment": "[5, 0, 15, 10]",
    "general": "#### 42",
}


def _cycle(values: list, n: int) -> list:
    return [values[i % len(values)] for i in range(n)]


def _accuracy_rows(n: int) -> dict[str, Any]:
    rows = _cycle(ACCURACY_ROWS, n)
    return {"solution": [r[0] for r in rows], "accu_reward_method": [r[1] for r in rows]}


def _rynn_rows(task: str | None) -> Any:
    def rows(n: int) -> dict[str, Any]:
        tasks = _cycle(list(TASKS), n) if task is None else [task] * n
        return {"solution": [RYNN_ROWS[t] for t in tasks], "task_type": tasks}

    return rows


def _text_rows(n: int) -> dict[str, Any]:
    return {"solution": ["x"] * n}


# reward name -> (columns for n rows, keyword arguments)
ROWS: dict[str, tuple[Any, dict[str, Any]]] = {
    "accuracy": (_accuracy_rows, {}),
    "vqa_graded": (lambda n: {"solution": ["<answer>con chó</answer><explain>vì nó sủa</explain>"] * n}, {}),
    "format": (_text_rows, {}),
    "format_explain": (_text_rows, {}),
    "format_speaker": (_text_rows, {}),
    "format_speaker_strict": (_text_rows, {}),
    "format_rynnbrain": (lambda n: {"task_type": _cycle([*TASKS, None], n)}, {}),
    "iou": (lambda n: {"solution": ["[10, 10, 50, 50]"] * n, "image_sizes": [[[100, 80]]] * n}, {}),
    "iou_threshold": (
        lambda n: {
            "solution": ["[10, 10, 50, 50]"] * n,
            "image_sizes": [[[100, 80]]] * n,
            "coord_sizes": [[[50, 40]]] * n,
        },
        {},
    ),
    **{
        name: (
            lambda n: {
                "solution": _cycle(DET_GT, n),
                "image_sizes": [[[100, 80]]] * n,
                "coord_sizes": [[[1000, 1000]]] * n,
            },
            {},
        )
        for name in ("od_ap", "od_ap50", "od_length", "weighted_sum")
    },
    "rynn_trajectory": (_rynn_rows("trajectory"), {}),
    "rynn_affordance": (_rynn_rows("affordance"), {}),
    "rynn_area": (_rynn_rows("area"), {}),
    "rynn_counting": (_rynn_rows("counting"), {"graded": True}),
    "rynn_segment": (_rynn_rows("segment"), {}),
    "rynn_general": (_rynn_rows("general"), {}),
    "rynnbrain": (_rynn_rows(None), {"trajectory": {"metric": "dtw"}, "area": {"mode": "iou"}}),
    "explanation": (lambda n: {"solution": ["<answer>chó</answer><explain>a dog runs fast</explain>"] * n}, {}),
    "length": (_accuracy_rows, {"max_len": 200}),
    "one_sentence": (_text_rows, {}),
    "repetition": (_text_rows, {}),
    "overlong": (_text_rows, {"max_len": 100, "cache_len": 20}),
    "accuracy_format": (_accuracy_rows, {}),
    "tool_use": (_text_rows, {}),
    "deepeyes": (_accuracy_rows, {}),
    "tool_format": (_text_rows, {}),
}

HUGE = 300_000
ADVERSARIAL = [
    "",
    " ",
    "\n\t ",
    "x" * HUGE,
    "<answer>" * 20_000,
    "</answer>" * 20_000,
    "<think><think><answer><answer>[1, 2, 3, 4]</answer></think>" * 2_000,
    "<think>" * 20_000 + "</answer>",
    "<answer>" + "<answer>" * 500 + "3" + "</answer>" * 499,
    "[" + "9" * 10_000 + ", 0, 5, 5]",
    "(" + "9" * 10_000 + ", 1)",
    "<counting>" + "9" * 10_000 + "</counting>",
    "<answer>" + "1" * 10_000 + "</answer>",
    "#### " + "9" * 10_000,
    "####" * 25_000,
    "{" * 100_000,
    "[" * 100_000,
    "(" * 100_000,
    "#### <answer><trajectory><frame 1>" + " (1,2)," * 12_000 + " x",
    "#### <answer><trajectory><frame 1> (1,2)" + " " * 90_000 + "x",
    "<area><frame 1>" + "".join(f"({i % 1000}, {i * 7 % 1000}) " for i in range(20_000)) + "</area>",
    "<answer>"
    + json.dumps([{"bbox_2d": [i % 90, i % 70, i % 90 + 9, i % 70 + 9], "label": f"l{i % 5}"} for i in range(3_000)])
    + "</answer>",
    '{"bbox_2d": [NaN, 0, 5, 5], "label": "cat"} {"bbox_2d": [Infinity, -Infinity, 1e999, 5]}',
    "NaN",
    "nan inf -inf NaN Infinity -0 1e999 -1e999",
    "[1e999, 0, 1e999, 5] [nan, 1, 2, 3]",
    "<answer>NaN</answer><counting>NaN</counting><affordance><frame 1> (NaN, nan)</affordance>",
    "<explain>" + "word " * 100_000 + "</explain>",
    "<detailed>" + "a. " * 50_000 + "</detailed>",
    "ünïcödé 🤖 <answer>数字 三</answer> \u2212\u200b\x00 <explain>chó sủa 🐕</explain>",
    "\U0010ffff\ufeff\u202e<answer>\u0663</answer>",
    "\\frac{" * 1_000,
    "\\boxed{" * 500,
    "9^9^9^9",
    "<answer>9^9^9^9^9</answer>",
    "<answer>" + "9" * 100 + "^" + "9" * 100 + "</answer>",
    "<ANSWER>3</ANSWER><Think>x</Think>",
    "<think>a</think><answer>b<explain>c</explain></answer>",
    "<frame 99999999999999999> (1, 2)",
    "#### <answer><object><frame 1> (1000, 1000), (0, 0)</object></answer>",
    "<thinking><coarse><detailed>nested</detailed></coarse></thinking>",
    "word " * 60_000,
]

_NUMBERS = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["NaN", "nan", "inf", "-inf", "1e999", "-0", "0.5", "1000", "9" * 400, "\u0663"]),
)
_POINT = st.tuples(_NUMBERS, _NUMBERS).map(lambda p: f"({p[0]}, {p[1]})")
_BOX = st.lists(_NUMBERS, min_size=4, max_size=4).map(lambda b: "[" + ", ".join(b) + "]")
_FRAGMENTS = st.sampled_from(
    [
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "<explain>",
        "</explain>",
        "<thinking>",
        "</thinking>",
        "<coarse>",
        "</coarse>",
        "<detailed>",
        "</detailed>",
        "####",
        "<trajectory>",
        "</trajectory>",
        "<affordance>",
        "</affordance>",
        "<area>",
        "</area>",
        "<counting>",
        "</counting>",
        "<object>",
        "</object>",
        "<frame 1>",
        "<frame 3>",
        "\\boxed{",
        "}",
        "{",
        '"bbox_2d": ',
        '"label": "cat"',
        '"score": ',
        ", ",
        " ",
        "\n",
        ".",
        "?",
        "。",
        "B",
        "(C)",
        "yes",
        "no",
        "con chó",
        "a dog runs fast",
        "🤖",
        "\x00",
        "\u200b",
    ]
)
_STRUCTURED = st.lists(st.one_of(_FRAGMENTS, _NUMBERS, _POINT, _BOX, st.text(max_size=12)), max_size=40).map("".join)
_TEXT = st.one_of(st.text(max_size=300), _STRUCTURED, _STRUCTURED, st.sampled_from(ADVERSARIAL))
COMPLETION = st.one_of(_TEXT, _TEXT.map(lambda t: [{"role": "assistant", "content": t}]))
BATCHES = st.lists(COMPLETION, min_size=BATCH[0], max_size=BATCH[1])

SCORED: Counter = Counter()


def _text_length(completion: Any) -> int:
    return len(completion) if isinstance(completion, str) else len(completion[0]["content"])


def _score(name: str, completions: list) -> list:
    fn = REWARDS.get(name)
    columns_for, kwargs = ROWS[name]
    n = len(completions)
    columns = columns_for(n)
    columns["completion_ids"] = [[0] * min(_text_length(c), 2_000) for c in completions]
    if reward_kind(fn) == "batch":
        inputs = reward_inputs_from_kwargs(completions, columns)
        outputs = fn(inputs, **kwargs)
        return [out["overall"] if isinstance(out, dict) else out for out in outputs]
    return list(fn(completions, **columns, **kwargs))


def test_every_registered_reward_is_covered():
    missing = set(REWARDS.names()) - set(ROWS) - NETWORK_REWARDS
    assert not missing, f"add a robustness entry (rows + range) to ROWS for: {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_reward_never_raises_and_stays_in_range(name):
    low, high = REWARDS.get(name).value_range

    @settings(
        max_examples=EXAMPLES_PER_REWARD,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(completions=BATCHES)
    def check(completions):
        start = time.perf_counter()
        values = _score(name, completions)
        elapsed = time.perf_counter() - start
        assert elapsed < SECONDS_PER_BATCH, f"{name} took {elapsed:.1f}s on a batch of {len(completions)}"
        assert len(values) == len(completions)
        for completion, value in zip(completions, values, strict=True):
            shown = repr(completion)[:200]
            assert value is not None, f"{name} gave None on a well-formed row for {shown}"
            assert isinstance(value, (int, float)) and math.isfinite(value), f"{name} gave {value!r} for {shown}"
            assert low - 1e-9 <= value <= high + 1e-9, f"{name} gave {value} outside [{low}, {high}] for {shown}"
        SCORED[name] += len(completions)

    check()


def test_every_adversarial_text_once_per_reward():
    for name in sorted(ROWS):
        low, high = REWARDS.get(name).value_range
        start = time.perf_counter()
        values = _score(name, ADVERSARIAL)
        assert time.perf_counter() - start < 4 * SECONDS_PER_BATCH, name
        assert all(v is not None and math.isfinite(v) and low - 1e-9 <= v <= high + 1e-9 for v in values), name
        SCORED[name] += len(ADVERSARIAL)


def test_at_least_ten_thousand_completions_were_scored():
    if len(SCORED) < len(ROWS):
        pytest.skip("run the whole module to count")
    print(f"\n{sum(SCORED.values())} completions scored: {dict(SCORED)}")
    assert sum(SCORED.values()) >= MIN_TOTAL, SCORED
