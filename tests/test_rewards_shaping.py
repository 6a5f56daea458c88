"""Hand-computed tables for the shaping rewards: cosine length (real accuracy), one_sentence, repetition, overlong."""

from __future__ import annotations

import math
import time

import pytest

from vlm_grpo.rewards import SafeReward, build_reward_funcs
from vlm_grpo.rewards.shaping import (
    count_sentences,
    length_reward,
    one_sentence_reward,
    overlong_reward,
    repetition_reward,
)

RIGHT, WRONG = "<answer>3</answer>", "<answer>4</answer>"

LENGTH_CASES = [
    # (completion, n tokens, expected) with solution "3", max_len 100:
    # correct 0.5 + 0.25 * (1 + cos(pi t)), wrong -0.5 - 0.25 * (1 + cos(pi t)), t = min(L, 100) / 100
    (RIGHT, 0, 1.0),
    (RIGHT, 50, 0.75),
    (RIGHT, 100, 0.5),
    (RIGHT, 400, 0.5),  # capped at max_len
    (WRONG, 0, -1.0),
    (WRONG, 50, -0.75),
    (WRONG, 100, -0.5),
    (RIGHT, 25, 0.5 + 0.25 * (1 + 2**-0.5)),  # cos(pi / 4)
]


@pytest.mark.parametrize(("completion", "tokens", "expected"), LENGTH_CASES)
def test_length_table(completion, tokens, expected):
    out = length_reward([completion], completion_ids=[list(range(tokens))], solution=["3"], max_len=100)
    assert out == [pytest.approx(expected)]


def test_length_uses_the_real_accuracy_of_each_sample():
    ids = [[0] * 10] * 3
    out = length_reward(
        [RIGHT, WRONG, "<answer>Red.</answer>"],
        completion_ids=ids,
        solution=["3", "3", "red"],
        accu_reward_method=[None, None, "exact"],
        max_len=10,
    )
    assert out == [pytest.approx(0.5), pytest.approx(-0.5), pytest.approx(0.5)]


def test_length_threshold_and_constants_from_reward_kwargs():
    # fuzzy accuracy 4/7: wrong with the default threshold 1.0, correct with 0.5
    kwargs = {"solution": ["sitting"], "accu_reward_method": ["fuzzy"], "completion_ids": [[]]}
    assert length_reward(["<answer>kitten</answer>"], **kwargs) == [-1.0]
    (reward,) = build_reward_funcs(
        ["length"], reward_kwargs={"length": {"correct_threshold": 0.5, "max_value_correct": 2.0, "max_len": 4}}
    )
    assert reward(["<answer>kitten</answer>"], **kwargs) == [2.0]


def test_length_without_token_ids_counts_characters():
    assert length_reward(["<answer>3</answer>"], solution=["3"], max_len=18) == [pytest.approx(0.5)]  # 18 chars


def test_length_malformed_rows_are_isolated():
    safe = SafeReward(length_reward, "length")
    one_token = 0.5 + 0.25 * (1 + math.cos(math.pi / 1000))  # default max_len 1000
    assert safe([RIGHT, RIGHT], solution=["3", ""], completion_ids=[[0], [0]]) == [pytest.approx(one_token), None]
    with pytest.raises(ValueError):
        length_reward([RIGHT], solution=["3"], max_len=0)


ONE_SENTENCE_CASES = [
    # (completion, tag kwarg, expected)
    ("<thinking>x</thinking><coarse>A dog</coarse><detailed>A brown dog with a red collar.</detailed>", {}, 0.1),
    ("<detailed>A dog. It runs.</detailed>", {}, 0.0),
    ("<detailed>A dog with 3.5 legs, e.g. odd!</detailed>", {}, 0.0),  # "e.g. odd" ends a sentence after "e.g."
    ("<detailed>A dog with 3.5 legs</detailed>", {}, 0.1),  # no final stop: still one sentence
    ("<detailed>Is it a dog?!</detailed>", {}, 0.1),
    ("<detailed>这是一只狗。它在跑。</detailed>", {}, 0.0),
    ("<detailed> ... </detailed>", {}, 0.0),  # no sentence at all
    ("<coarse>A dog.</coarse>", {}, 0.0),  # no detailed tag
    ("A dog runs.", {"tag": None}, 0.1),  # whole completion
    ("A dog runs.", {}, 0.0),
    ("<detailed>A dog runs.</detailed>", {"value": 0.5}, 0.5),
]


@pytest.mark.parametrize(("completion", "kwargs", "expected"), ONE_SENTENCE_CASES)
def test_one_sentence_table(completion, kwargs, expected):
    assert one_sentence_reward([completion], **kwargs) == [expected]


@pytest.mark.parametrize(("text", "n"), [("", 0), ("Hi", 1), ("Hi. Bye.", 2), ("U.S.A. is big.", 2), ("A…B", 1)])
def test_count_sentences(text, n):
    assert count_sentences(text) == n


REPETITION_CASES = [
    # (completion, kwargs, expected) = max_penalty * (1 - distinct / total n-grams)
    ("a b c a b c", {}, -(1 - 3 / 4)),  # 3-grams abc, bca, cab, abc
    ("a a a a", {}, -(1 - 1 / 2)),
    ("the quick brown fox jumps", {}, 0.0),
    ("a b", {}, 0.0),  # shorter than n
    ("", {}, 0.0),
    ("A b C a B c", {}, -0.25),  # case-insensitive
    ("a b a b", {"ngram_size": 2, "max_penalty": -0.5}, -0.5 * (1 - 2 / 3)),
]


@pytest.mark.parametrize(("completion", "kwargs", "expected"), REPETITION_CASES)
def test_repetition_table(completion, kwargs, expected):
    assert repetition_reward([completion], **kwargs) == [pytest.approx(expected)]


OVERLONG_CASES = [
    # (tokens, expected) with max_len 20, cache_len 5: 0 up to 15, (15 - L) / 5 up to 20, then -1
    (0, 0.0),
    (15, 0.0),
    (16, -0.2),
    (18, -0.6),
    (20, -1.0),
    (21, -1.0),
]


@pytest.mark.parametrize(("tokens", "expected"), OVERLONG_CASES)
def test_overlong_table(tokens, expected):
    assert overlong_reward(["x"], completion_ids=[[1] * tokens], max_len=20, cache_len=5) == [pytest.approx(expected)]


def test_overlong_characters_and_bad_parameters():
    assert overlong_reward(["x" * 18], max_len=20, cache_len=5) == [pytest.approx(-0.6)]
    with pytest.raises(ValueError):
        overlong_reward(["x"], max_len=10, cache_len=20)
    with pytest.raises(ValueError):
        repetition_reward(["x"], max_penalty=1.0)


def test_huge_completions_are_cheap():
    huge = "word " * 500_000
    start = time.perf_counter()
    assert repetition_reward([huge]) == [pytest.approx(-(1 - 1 / 19_998))]  # first 20,000 words
    assert one_sentence_reward([f"<detailed>{huge}</detailed>"]) == [0.1]
    assert time.perf_counter() - start < 3
