"""Accuracy reward limits and messages: the registry of comparison methods, number extraction edge cases, the
math-verify timeout and expression guard, row/column errors a user reads, and the vqa_graded scale bounds."""

from __future__ import annotations

import threading

import pytest
import sympy

from vlm_grpo.rewards import accuracy
from vlm_grpo.rewards.accuracy import (
    ACCURACY_METHODS,
    accuracy_method,
    accuracy_reward,
    normalize_text,
    single_number,
    vqa_graded_reward,
)


@pytest.fixture
def scratch_method():
    """A user-registered method, removed again afterwards so other tests see the stock registry."""
    yield "scratch_len_parity"
    ACCURACY_METHODS.pop("scratch_len_parity", None)


def test_user_registered_method_is_used_per_row(scratch_method):
    @accuracy_method(scratch_method)
    def parity(pred: str, gold: str) -> float:
        return 1.0 if len(pred) % 2 == len(gold) % 2 else 0.0

    assert ACCURACY_METHODS[scratch_method] is parity
    out = accuracy_reward(["ab", "abc", "7"], solution=["xy", "xy", "7"], accu_reward_method=[scratch_method, "", None])
    assert out == [1.0, 0.0, 1.0]
    # registering the very same function again is harmless (module reloads); another one under the name is an error
    assert accuracy_method(scratch_method)(parity) is parity
    with pytest.raises(ValueError, match=f"accuracy method '{scratch_method}' is already registered"):
        accuracy_method(scratch_method)(lambda pred, gold: 0.0)
    assert ACCURACY_METHODS[scratch_method] is parity


@pytest.mark.parametrize("blank", ["", "   ", "Default", " DEFAULT "])
def test_blank_or_cased_method_means_default(blank):
    assert accuracy_reward(["<answer>The answer is 42</answer>"], solution=["42"], accu_reward_method=[blank]) == [1.0]


def test_unknown_method_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown accu_reward_method 'fuzy'\. Known: .*default, exact, fuzzy, "):
        accuracy_reward(["a"], solution=["a"], accu_reward_method=["fuzy"])


def test_normalize_text_drops_punctuation_at_word_edges():
    assert normalize_text("(b) dog") == "b dog"  # first character: no letter before it
    assert normalize_text("say 'hi") == "say hi"  # a letter after it, none before
    assert normalize_text("don't new-york 3.5") == "don't new-york 3.5"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3!", None),  # factorial: part of an expression
        ("5/x", None),
        ("4X", 4.0),  # "4X zoom": only ^ _ / ! after the number disqualify it
        ("\u22125", -5.0),  # unicode minus sign
        ("\u22122.5e3", -2500.0),
        ("1e999", None),  # overflows to inf: not a number a user meant
        ("-1e308", -1e308),
    ],
)
def test_single_number_edges(text, expected):
    assert single_number(text) == expected


def test_numeric_method_with_unicode_minus():
    assert accuracy_reward(["\u22127"], solution=["-7"], accu_reward_method="numeric") == [1.0]
    assert accuracy_reward(["7"], solution=["-7"], accu_reward_method="numeric") == [0.0]


def test_math_verify_gets_the_timeout_in_the_main_thread_only(monkeypatch):
    import math_verify

    seen: list[tuple[str, object]] = []
    real_parse, real_verify = math_verify.parse, math_verify.verify

    def parse(text, **kwargs):
        seen.append(("parse", kwargs.get("parsing_timeout")))
        return real_parse(text, **kwargs)

    def verify(gold, pred, **kwargs):
        seen.append(("verify", kwargs.get("timeout_seconds")))
        return real_verify(gold, pred, **kwargs)

    monkeypatch.setattr(math_verify, "parse", parse)
    monkeypatch.setattr(math_verify, "verify", verify)
    accuracy._mv_parse_gold.cache_clear()
    assert accuracy_reward(["$\\frac{1}{2}$"], solution=["$0.5$"], accu_reward_method="math") == [1.0]
    assert seen and {t for _, t in seen} == {accuracy.MATH_VERIFY_TIMEOUT_S}
    assert {k for k, _ in seen} == {"parse", "verify"}

    seen.clear()
    accuracy._mv_parse_gold.cache_clear()
    out: list = []
    worker = threading.Thread(target=lambda: out.append(accuracy_reward(["$3$"], solution=["$3$"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]
    assert seen and {t for _, t in seen} == {None}  # signal-based timeouts cannot work off the main thread


def _sum_of_symbols(k: int) -> sympy.Expr:
    return sympy.Add(*sympy.symbols(f"s0:{k}"))


def test_expression_guard_limits():
    x = sympy.Symbol("x")
    # node count: an Add of 400 symbols is 401 nodes (allowed), of 401 symbols 402 nodes (too big)
    assert accuracy._is_tame(_sum_of_symbols(400))
    assert not accuracy._is_tame(_sum_of_symbols(401))
    # exponents and factorial arguments: 1000 allowed, 1001 not; symbolic ones fine; unevaluated towers not
    assert accuracy._is_tame(x**2) and accuracy._is_tame(x**1000)
    assert not accuracy._is_tame(x**1001)
    assert accuracy._is_tame(sympy.factorial(x))
    assert accuracy._is_tame(sympy.factorial(sympy.Integer(1000), evaluate=False))
    assert not accuracy._is_tame(sympy.factorial(sympy.Integer(1001), evaluate=False))
    assert not accuracy._is_tame(sympy.Pow(9, sympy.Pow(9, 9, evaluate=False), evaluate=False))
    # matrices: every entry checked, at most 400 of them
    assert accuracy._is_tame(sympy.Matrix(20, 20, lambda i, j: i + j))
    assert not accuracy._is_tame(sympy.Matrix(1, 401, lambda i, j: j))
    assert not accuracy._is_tame(sympy.Matrix([[1, x**1001]]))
    assert accuracy._is_tame("not sympy")
    assert not accuracy._is_tame(sympy.Pow(x, sympy.nan, evaluate=False))  # sympy cannot even compare it


def test_wild_expression_is_not_compared_but_falls_back():
    # a power tower is never handed to math-verify: the default method falls back to exact match
    assert accuracy_reward(["$x^{5000}$"], solution=["$x^{5000}$"]) == [1.0]
    assert accuracy_reward(["$x^{5000}$"], solution=["$x^{5001}$"]) == [0.0]


@pytest.mark.parametrize("reward", [accuracy_reward, vqa_graded_reward])
def test_row_errors_name_the_problem(reward):
    name = "accuracy" if reward is accuracy_reward else "vqa_graded"
    with pytest.raises(ValueError, match=rf"^The {name} reward needs a 'solution' column$"):
        reward(["a"])
    with pytest.raises(ValueError, match=r"^solution is None$"):
        reward(["a", "b"], solution=["a", None])
    with pytest.raises(ValueError, match=r"^empty solution$"):
        reward(["a"], solution=[""])
    with pytest.raises(ValueError, match=r"^Got 2 completions but 1 solutions"):
        reward(["a", "b"], solution=["a"])


def test_method_column_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"^Got 2 completions but 2 solutions and 1 accu_reward_method entries$"):
        accuracy_reward(["a", "b"], solution=["a", "b"], accu_reward_method=["exact"])


@pytest.mark.parametrize("reward", [accuracy_reward, vqa_graded_reward])
def test_non_string_solutions_are_compared_as_text(reward):
    # JSONL rows often carry numbers as numbers: 3, not "3"
    full = 1.0 if reward is accuracy_reward else 3.0
    assert reward(["<answer>3</answer>", "<answer>4</answer>"], solution=[3, 3]) == [full, 0.0]


def test_vqa_graded_scale_bounds():
    assert vqa_graded_reward(["red car", "blue"], solution=["red car", "red car"], scale=0) == [0.0, 0.0]
    assert vqa_graded_reward(["red car", "red"], solution=["red car", "red car"], scale=0.5) == [0.5, 0.25]
    for bad in (-0.01, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^vqa_graded scale must be a finite number >= 0, got"):
            vqa_graded_reward(["a"], solution=["a"], scale=bad)


def test_guard_refuses_a_big_power():
    # kept tiny and separate: it runs before any test that would hang on an unguarded expression
    x = sympy.Symbol("x")
    assert not accuracy._is_tame(x**1001)
    assert not accuracy._is_tame(sympy.Pow(2, sympy.Pow(9, 9, evaluate=False), evaluate=False))


def test_wild_expression_never_reaches_math_verify(monkeypatch):
    import math_verify

    calls: list = []
    monkeypatch.setattr(math_verify, "verify", lambda *args, **kwargs: calls.append(args) or True)
    assert accuracy.math_verify_verdict("$x^{5000}$", "$x^{5000}$") is None
    assert calls == []
