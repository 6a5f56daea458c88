"""Accuracy reward: does the completion's answer match the solution?

Per row, the ``accu_reward_method`` column picks the comparison (``default`` when missing/None/empty).
New methods can be added with ``@accuracy_method("name")``: a function ``(pred: str, gold: str) -> float``
getting the extracted, stripped answer texts; it should raise ``ValueError`` for unusable ``gold`` (malformed row).
"""

from __future__ import annotations

import functools
import math
import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

from vlm_grpo.rewards.base import completion_text
from vlm_grpo.rewards.format import extract_answer

# math-verify only sees this many trailing characters of an answer (final answers sit at the end).
MATH_VERIFY_MAX_CHARS = 2000
# Seconds math-verify may spend per parse / comparison (signal based: only honoured in the main thread).
MATH_VERIFY_TIMEOUT_S = 3
# Sympy expressions beyond these sizes are not handed to math-verify's comparison (it may hang on them).
_MAX_EXPR_NODES = 400
_MAX_EXPONENT = 1000

ACCURACY_METHODS: dict[str, Callable[[str, str], float]] = {}


def accuracy_method(name: str) -> Callable[[Callable[[str, str], float]], Callable[[str, str], float]]:
    """Decorator registering a comparison ``(pred, gold) -> float`` under ``accu_reward_method == name``."""

    def decorator(fn: Callable[[str, str], float]) -> Callable[[str, str], float]:
        if name in ACCURACY_METHODS and ACCURACY_METHODS[name] is not fn:
            raise ValueError(f"accuracy method '{name}' is already registered")
        ACCURACY_METHODS[name] = fn
        return fn

    return decorator


# --------------------------------------------------------------------------------------------- helpers


def normalize_text(text: str) -> str:
    """Normalisation for exact match: NFKC, case-folded, punctuation removed (kept only *between* two letters/
    digits, so ``3.5``, ``don't`` and ``new-york`` survive while ``Red.`` becomes ``red``), whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).casefold()
    out = []
    last = len(text) - 1
    for i, ch in enumerate(text):
        if unicodedata.category(ch).startswith("P"):
            inner = 0 < i < last and text[i - 1].isalnum() and text[i + 1].isalnum()
            out.append(ch if inner else " ")
        else:
            out.append(ch)
    return " ".join("".join(out).split())


_NUMBER = re.compile(r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+\u2212]?\.\d+")


def single_number(text: str) -> float | None:
    """The number in ``text`` if it holds exactly one (``1,000`` is one thousand, ``-2.5e3`` one number), else
    ``None``. A lone number that is part of an expression (``x^3``, ``a_2``, ``1/x``, ``x-3``, ``v2``) doesn't count."""
    matches = _NUMBER.finditer(text)
    match = next(matches, None)
    if match is None or next(matches, None) is not None:
        return None
    before = text[match.start() - 1] if match.start() > 0 else ""
    after = text[match.end()] if match.end() < len(text) else ""
    if (before and (before.isalnum() or before in "^_/\\.")) or (after and after in "^_/!"):
        return None
    try:
        value = float(match.group().replace(",", "").replace("\u2212", "-"))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _timeout() -> int | None:
    # math-verify's timeout uses signal.alarm, which only works in the main thread; elsewhere run without one
    # (the length cap and the expression guard below keep inputs tame).
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _mv_parse(text: str) -> tuple:
    try:
        from math_verify import parse
        from math_verify.errors import TimeoutException
    except ImportError:  # pragma: no cover - math-verify is a dependency
        return ()
    try:
        return tuple(parse(text[-MATH_VERIFY_MAX_CHARS:], parsing_timeout=_timeout()))
    except (Exception, TimeoutException):
        return ()


@functools.lru_cache(maxsize=4096)
def _mv_parse_gold(text: str) -> tuple:
    # Solutions repeat num_generations times per batch: parse each once.
    return _mv_parse(text)


def _is_tame(value: Any) -> bool:
    """False for sympy objects math-verify could spend unbounded time on (huge trees, power towers, 10^9!)."""
    try:
        from sympy import Basic, Pow, factorial
        from sympy.core.traversal import postorder_traversal
        from sympy.matrices import MatrixBase
    except ImportError:  # pragma: no cover
        return True
    if isinstance(value, MatrixBase):
        return len(value) <= _MAX_EXPR_NODES and all(_is_tame(v) for v in value)
    if not isinstance(value, Basic):
        return True
    try:
        for count, node in enumerate(postorder_traversal(value)):
            if count > _MAX_EXPR_NODES:
                return False
            if isinstance(node, Pow):
                arg = node.exp
            elif isinstance(node, factorial):
                arg = node.args[0]
            else:
                continue
            if arg.is_Number:
                if abs(arg) > _MAX_EXPONENT:
                    return False
            elif not arg.free_symbols:  # numeric but unevaluated, e.g. 9^(9^9)
                return False
    except Exception:
        return False
    return True


def math_verify_verdict(pred: str, gold: str) -> bool | None:
    """math-verify's verdict on ``pred`` vs ``gold``; ``None`` when it cannot decide (either side unparsable,
    too wild to compare safely, or an internal error)."""
    gold_parsed = _mv_parse_gold(gold[-MATH_VERIFY_MAX_CHARS:])
    if not gold_parsed:
        return None
    pred_parsed = _mv_parse(pred)
    if not pred_parsed:
        return None
    if not all(_is_tame(v) for v in (*gold_parsed, *pred_parsed)):
        return None
    try:
        from math_verify import verify
        from math_verify.errors import TimeoutException
    except ImportError:  # pragma: no cover
        return None
    try:
        return bool(verify(list(gold_parsed), list(pred_parsed), timeout_seconds=_timeout()))
    except (Exception, TimeoutException):
        return None


def _numbers_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)


def _require_gold(gold: str) -> None:
    if not gold:
        raise ValueError("empty solution")


# --------------------------------------------------------------------------------------------- methods


@accuracy_method("math")
def math_match(pred: str, gold: str) -> float:
    """math-verify only (``\\boxed{}`` preferred, else the last expression); 0.0 if ``pred`` doesn't parse.
    Raises ``ValueError`` if the solution doesn't parse."""
    _require_gold(gold)
    if not _mv_parse_gold(gold[-MATH_VERIFY_MAX_CHARS:]):
        raise ValueError(f"math-verify cannot parse the solution {gold[:200]!r}")
    return 1.0 if math_verify_verdict(pred, gold) else 0.0


@accuracy_method("numeric")
def numeric_match(pred: str, gold: str) -> float:
    """1.0 iff both hold exactly one number and they agree within a relative tolerance of 1e-6.
    Raises ``ValueError`` if the solution does not hold exactly one number."""
    _require_gold(gold)
    target = single_number(gold)
    if target is None:
        raise ValueError(f"solution {gold[:200]!r} does not hold exactly one number")
    value = single_number(pred)
    return 1.0 if value is not None and _numbers_close(value, target) else 0.0


@accuracy_method("exact")
def exact_match(pred: str, gold: str) -> float:
    """1.0 iff the texts are equal after :func:`normalize_text`."""
    _require_gold(gold)
    return 1.0 if normalize_text(pred) == normalize_text(gold) else 0.0


@accuracy_method("default")
def default_match(pred: str, gold: str) -> float:
    """math-verify if it can decide; else numeric (when both hold exactly one number); else exact match."""
    _require_gold(gold)
    verdict = math_verify_verdict(pred, gold)
    if verdict is not None:
        return 1.0 if verdict else 0.0
    value, target = single_number(pred), single_number(gold)
    if value is not None and target is not None:
        return 1.0 if _numbers_close(value, target) else 0.0
    return 1.0 if normalize_text(pred) == normalize_text(gold) else 0.0


def _method(name: Any) -> Callable[[str, str], float]:
    key = "default" if name is None else str(name).strip().lower() or "default"
    try:
        return ACCURACY_METHODS[key]
    except KeyError:
        raise ValueError(f"Unknown accu_reward_method '{name}'. Known: {', '.join(sorted(ACCURACY_METHODS))}") from None


# --------------------------------------------------------------------------------------------- reward


def accuracy_reward(
    completions: Sequence[Any],
    solution: Sequence[Any] | None = None,
    accu_reward_method: Sequence[str | None] | str | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Accuracy reward: 1.0 if the completion's answer matches the row's solution, else 0.0. Range {0.0, 1.0}.

    The predicted answer is the content of the completion's LAST ``<answer>…</answer>`` (the whole completion when
    it has none); the gold answer is likewise the content of the solution's answer tag, or the whole solution.
    Per row, ``accu_reward_method`` picks the comparison (missing column / None / "" / "default" -> default):

    - ``default``: math-verify (``parse``/``verify``) when both sides parse; otherwise, if both hold exactly one
      number, numeric comparison (relative tolerance 1e-6); otherwise normalised exact match.
    - ``math``: math-verify only (``\\boxed{}`` preferred); 0.0 when the answer doesn't parse.
    - ``numeric``: exactly one number on each side, equal within relative tolerance 1e-6.
    - ``exact``: equal after NFKC + case-folding, dropping punctuation that isn't between two letters/digits, and
      collapsing whitespace (``"Red."`` == ``"red"``).

    math-verify sees at most the last 2000 characters, with a 3 s timeout in the main thread (none in other
    threads, where its signal-based timeout cannot work; oversized expressions are never compared).
    Never raises on completion text; raises ``ValueError`` on malformed rows (no ``solution`` column, empty
    solution, solution unusable for its method, unknown method), which :class:`SafeReward` turns into ``None``.
    """
    if solution is None:
        raise ValueError("The accuracy reward needs a 'solution' column")
    n = len(completions)
    if accu_reward_method is None or isinstance(accu_reward_method, str):
        methods: Sequence[Any] = [accu_reward_method] * n
    else:
        methods = accu_reward_method
    if len(solution) != n or len(methods) != n:
        raise ValueError(
            f"Got {n} completions but {len(solution)} solutions and {len(methods)} accu_reward_method entries"
        )
    rewards: list[float | None] = []
    for completion, sol, method in zip(completions, solution, methods, strict=True):
        compare = _method(method)
        if sol is None:
            raise ValueError("solution is None")
        gold = extract_answer(sol if isinstance(sol, str) else str(sol))
        pred = extract_answer(completion_text(completion))
        rewards.append(float(compare(pred, gold)))
    return rewards


__all__ = [
    "ACCURACY_METHODS",
    "accuracy_method",
    "accuracy_reward",
    "default_match",
    "exact_match",
    "math_match",
    "math_verify_verdict",
    "normalize_text",
    "numeric_match",
    "single_number",
]
