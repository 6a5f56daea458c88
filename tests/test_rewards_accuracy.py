"""Hand-computed tables for the accuracy methods added by the reward library (mcq, yes_no, fuzzy, vqa_graded, the
multiple-choice step of default) and the ViVQA-X ``vqa_graded`` reward."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import SafeReward, build_reward_funcs
from vlm_grpo.rewards.accuracy import (
    ACCURACY_METHODS,
    accuracy_reward,
    extract_choice,
    vqa_graded_reward,
    yes_no_value,
)

ACCURACY_CASES = [
    # (completion, solution, accu_reward_method, expected)
    # --- mcq
    ("<answer>B</answer>", "B", "mcq", 1.0),
    ("<answer>(b)</answer>", "B", "mcq", 1.0),
    ("<think>hmm</think><answer>**C**</answer>", "<answer>C</answer>", "mcq", 1.0),
    ("The answer is (C) because it is red", "C", "mcq", 1.0),  # no answer tag -> whole text
    ("<answer>B. a cat</answer>", "(B) a cat", "mcq", 1.0),
    ("<answer>Answer: D.</answer>", "D", "mcq", 1.0),
    ("<answer>I pick (D) since it fits</answer>", "D", "mcq", 1.0),
    ("<answer>C</answer>", "B", "mcq", 0.0),
    ("<answer>a dog</answer>", "B", "mcq", 0.0),  # no letter
    ("<answer>the answer is A dog</answer>", "A", "mcq", 0.0),  # "A" is an article here
    ("<answer>(A) cat or (B) dog</answer>", "B", "mcq", 0.0),  # leading label A wins
    ("", "B", "mcq", 0.0),
    # --- yes_no
    ("<answer>Yes</answer>", "yes", "yes_no", 1.0),
    ("<answer>yes, it is red</answer>", "Yes.", "yes_no", 1.0),
    ("<answer>No.</answer>", "yes", "yes_no", 0.0),
    ("<answer>I would say no</answer>", "no", "yes_no", 1.0),  # the only yes/no word
    ("<answer>maybe yes, maybe no</answer>", "yes", "yes_no", 0.0),  # both words: undecided
    ("<answer>yes and no</answer>", "yes", "yes_no", 1.0),  # the first word decides
    ("<answer>maybe</answer>", "no", "yes_no", 0.0),
    ("<answer>True</answer>", "yes", "yes_no", 1.0),
    # --- fuzzy: 1 - Levenshtein / max(len) on normalised texts
    ("<answer>kitten</answer>", "sitting", "fuzzy", 4 / 7),  # distance 3, max length 7
    ("<answer>flaw</answer>", "lawn", "fuzzy", 0.5),  # distance 2, max length 4
    ("<answer>Red.</answer>", "red", "fuzzy", 1.0),
    ("<answer>abc</answer>", "xyz", "fuzzy", 0.0),
    ("<answer></answer>", "red", "fuzzy", 0.0),
    # --- vqa_graded method (normalised to [0, 1])
    ("<answer>con chó</answer>", "con chó", "vqa_graded", 1.0),
    ("<answer>Con Chó!</answer>", "con chó", "vqa_graded", 1.0),
    ("<answer>chó</answer>", "con chó", "vqa_graded", 0.5),  # 1 of 2 ground-truth words
    ("<answer>mèo</answer>", "con chó", "vqa_graded", 0.0),
    ("<answer>a red car</answer>", "red car", "vqa_graded", 0.5),  # superset: all words present, not exact
    ("<answer>the big red</answer>", "big red car", "vqa_graded", 0.5),  # 2 of 3
    ("<answer>red</answer>", "big red car", "vqa_graded", 0.0),  # 1 of 3
    # --- default: math-verify / numeric can't decide on letters -> option-letter step -> exact
    ("<answer>(B)</answer>", "B", None, 1.0),
    ("<answer>The answer is C.</answer>", "B", None, 0.0),
    ("<answer>B. a cat</answer>", "(B)", "default", 1.0),
    ("<answer>cat</answer>", "B", None, 0.0),  # no letter -> exact match -> 0
    ("<answer>b</answer>", "b", None, 1.0),  # lower-case gold is not an option label: exact match
    ("<answer>3.0</answer>", "3", None, 1.0),  # earlier steps unchanged
]


@pytest.mark.parametrize(("completion", "solution", "method", "expected"), ACCURACY_CASES)
def test_accuracy_method_table(completion, solution, method, expected):
    assert accuracy_reward([completion], solution=[solution], accu_reward_method=[method]) == [pytest.approx(expected)]


def test_all_methods_registered():
    assert {"default", "math", "numeric", "exact", "mcq", "yes_no", "fuzzy", "vqa_graded"} <= set(ACCURACY_METHODS)


@pytest.mark.parametrize(
    ("solution", "method"),
    [("a cat", "mcq"), ("red", "yes_no"), ("", "fuzzy"), ("...", "vqa_graded"), ("maybe yes, maybe no", "yes_no")],
)
def test_unusable_solutions_raise(solution, method):
    with pytest.raises(ValueError):
        accuracy_reward(["B"], solution=[solution], accu_reward_method=[method])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("B", "B"), ("(b)", "B"), ("B.", "B"), ("**C**", "C"), ("B: x", "B"), ("Option D", "D"), ("Bob", None)],
)
def test_extract_choice(text, expected):
    assert extract_choice(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("Yes.", True), ("no", False), ("false", False), ("it is yes", True), ("", None)]
)
def test_yes_no_value(text, expected):
    assert yes_no_value(text) is expected


VQA_GRADED_CASES = [
    # (completion, solution, expected with the default scale 3.0)
    ("<think>...</think><answer>con chó</answer><explain>...</explain>", "<answer>con chó</answer>", 3.0),
    ("<answer>chó</answer>", "<answer>con chó</answer><explain>vì nó sủa</explain>", 1.5),
    ("<answer>mèo</answer>", "<answer>con chó</answer>", 0.0),
    ("con chó", "<answer>con chó</answer>", 3.0),  # no answer tag: the whole completion
    ("<answer></answer>", "<answer>con chó</answer>", 0.0),
    ("", "<answer>con chó</answer>", 0.0),
]


@pytest.mark.parametrize(("completion", "solution", "expected"), VQA_GRADED_CASES)
def test_vqa_graded_table(completion, solution, expected):
    assert vqa_graded_reward([completion], solution=[solution]) == [expected]


def test_vqa_graded_scale_from_reward_kwargs():
    (reward,) = build_reward_funcs(["vqa_graded"], reward_kwargs='{"vqa_graded": {"scale": 2.0}}')
    out = reward(["<answer>con chó</answer>", "<answer>chó</answer>", "x"], solution=["con chó"] * 3)
    assert out == [2.0, 1.0, 0.0]
    assert vqa_graded_reward(["<answer>chó</answer>"], solution=["con chó"], scale=1) == [0.5]


@pytest.mark.parametrize(("solution", "scale"), [("", 3.0), ("<answer>?!</answer>", 3.0), ("con chó", -1.0)])
def test_vqa_graded_malformed(solution, scale):
    with pytest.raises(ValueError):
        vqa_graded_reward(["con chó"], solution=[solution], scale=scale)
    assert SafeReward(lambda completions, **kw: vqa_graded_reward(completions, scale=scale, **kw), "v")(
        ["con chó"], solution=[solution]
    ) == [None]
