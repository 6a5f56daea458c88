"""Accuracy reward: does the completion's answer match the solution?

Per row, the ``accu_reward_method`` column picks the comparison (``default`` when missing/None/empty).
New methods can be added with ``@accuracy_method("name")``: a function ``(pred: str, gold: str) -> float``
in [0, 1] getting the extracted, stripped answer texts; it should raise ``ValueError`` for unusable ``gold``
(malformed row).

Also here: the ViVQA-X graded reward ``vqa_graded`` (3.0 / 1.5 / 0 by default).
"""

from __future__ import annotations

import functools
import math
import re
import threading
import unicodedata
from collections.abc import Callable, Sequence
from typing import Any

from vlm_grpo.rewards.format import extract_answer
from vlm_grpo.rewards.turns import final_answer

# math-verify only sees this many trailing characters of an answer (final answers sit at the end).
MATH_VERIFY_MAX_CHARS = 2000
# Text-similarity methods (fuzzy, vqa_graded, yes_no, mcq) only see this many leading characters of an answer.
TEXT_MAX_CHARS = 20_000
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


# Option letters: "B", "(B)", "B.", "B)", "**B**"; a leading "(B) cat" / "B. cat" / "B: cat"; "answer is (B)".
# Whitespace runs inside these patterns are bounded so that no input can make them backtrack for long.
_DECORATION = " \t\r\n*_`'\""
_BARE_CHOICE = re.compile(r"\(?\s{0,3}([A-Za-z])\s{0,3}\)?[.:)]?")
_LEADING_CHOICE = re.compile(r"\s{0,10}(?:\(\s{0,3}([A-Z])\s{0,3}\)|([A-Z])\s{0,3}[.:)])(?:\s|$)")
_PHRASE_CHOICE = re.compile(
    r"\b(?i:answer|option|choice)\s{0,5}(?i:is|would be)?\s{0,5}(?i:option)?[\s:]{0,5}"
    r"(?:\(\s{0,3}([A-Z])\s{0,3}\)|([A-Z])(?=\s{0,5}(?:[.,;:!?)]|$)))"
)
_PAREN_CHOICE = re.compile(r"\(\s{0,3}([A-Z])\s{0,3}\)")


def _bare_letter(text: str) -> str | None:
    """The letter of an answer that is only an option label (``B``, ``(b)``, ``B.``, ``**C**``), as written."""
    core = text.strip(_DECORATION)
    if len(core) > 12:
        return None
    match = _BARE_CHOICE.fullmatch(core)
    return match.group(1) if match else None


def extract_choice(text: str) -> str | None:
    """The multiple-choice letter an answer gives, upper-cased, or ``None``. Tried in order:

    1. the whole answer is one letter, optionally in parentheses / followed by ``.``, ``:`` or ``)``, optionally
       in markdown emphasis or quotes (``B``, ``(b)``, ``B.``, ``**C**``);
    2. the answer starts with an upper-case option label: ``(B) cat``, ``B. cat``, ``B) cat``, ``B: cat``;
    3. the last "answer/option/choice [is|:] X" phrase whose upper-case letter X is in parentheses or followed by
       punctuation or the end of the text (``The answer is (C) because``, ``Answer: C.``; not ``answer is A dog``);
    4. exactly one distinct parenthesised upper-case letter in the text (``I pick (D) because``).
    """
    text = text[:TEXT_MAX_CHARS]
    bare = _bare_letter(text)
    if bare:
        return bare.upper()
    leading = _LEADING_CHOICE.match(text)
    if leading:
        return leading.group(1) or leading.group(2)
    phrase = None
    for phrase in _PHRASE_CHOICE.finditer(text):  # noqa: B007 - keep the last one
        pass
    if phrase is not None:
        return phrase.group(1) or phrase.group(2)
    parens = {m.group(1) for m in _PAREN_CHOICE.finditer(text)}
    if len(parens) == 1:
        return parens.pop()
    return None


def _bare_choice(text: str) -> str | None:
    """The letter of an answer that is *only* an upper-case option label (``B``, ``(B)``, ``B.``), else ``None``."""
    letter = _bare_letter(text[:100])
    return letter if letter is not None and letter.isupper() else None


_YES = frozenset({"yes", "true", "y"})
_NO = frozenset({"no", "false", "n"})


def yes_no_value(text: str) -> bool | None:
    """``True``/``False`` for a yes/no answer, else ``None``: the first word of the normalised answer if it is one
    of yes/true/y or no/false/n; otherwise, if exactly one of the words "yes" and "no" occurs, that one."""
    words = normalize_text(text[:TEXT_MAX_CHARS]).split()
    if not words:
        return None
    if words[0] in _YES:
        return True
    if words[0] in _NO:
        return False
    has_yes, has_no = "yes" in words, "no" in words
    if has_yes != has_no:
        return has_yes
    return None


def graded_overlap(pred: str, gold: str) -> float:
    """ViVQA-X grading on normalised texts: 1.0 if equal; 0.5 if at least half of the ground-truth words (counted
    with repetition) occur among the predicted words; else 0.0. Empty prediction -> 0.0."""
    p, g = normalize_text(pred[:TEXT_MAX_CHARS]), normalize_text(gold[:TEXT_MAX_CHARS])
    if not p:
        return 0.0
    if p == g:
        return 1.0
    gold_words = g.split()
    pred_words = set(p.split())
    present = sum(1 for w in gold_words if w in pred_words)
    return 0.5 if gold_words and 2 * present >= len(gold_words) else 0.0


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


@accuracy_method("mcq")
def mcq_match(pred: str, gold: str) -> float:
    """1.0 iff the option letters of both (:func:`extract_choice`) are equal; 0.0 if ``pred`` gives none.
    Raises ``ValueError`` if the solution gives no option letter."""
    _require_gold(gold)
    target = extract_choice(gold)
    if target is None:
        raise ValueError(f"solution {gold[:200]!r} gives no multiple-choice letter")
    return 1.0 if extract_choice(pred) == target else 0.0


@accuracy_method("yes_no")
def yes_no_match(pred: str, gold: str) -> float:
    """1.0 iff both are the same yes/no answer (:func:`yes_no_value`); 0.0 if ``pred`` is neither.
    Raises ``ValueError`` if the solution is not a yes/no answer."""
    _require_gold(gold)
    target = yes_no_value(gold)
    if target is None:
        raise ValueError(f"solution {gold[:200]!r} is not a yes/no answer")
    return 1.0 if yes_no_value(pred) is target else 0.0


@accuracy_method("fuzzy")
def fuzzy_match(pred: str, gold: str) -> float:
    """Partial credit in [0, 1]: normalised Levenshtein similarity ``1 - distance / max(len)`` of the normalised
    texts (rapidfuzz); 1.0 for equal texts, 0.0 when the prediction is empty."""
    _require_gold(gold)
    from rapidfuzz.distance import Levenshtein

    p, g = normalize_text(pred[:TEXT_MAX_CHARS]), normalize_text(gold[:TEXT_MAX_CHARS])
    if not p:
        return 0.0
    return float(min(1.0, max(0.0, Levenshtein.normalized_similarity(p, g))))


@accuracy_method("vqa_graded")
def vqa_graded_match(pred: str, gold: str) -> float:
    """ViVQA-X rule normalised to [0, 1] (:func:`graded_overlap`): 1.0 exact (normalised) match, 0.5 when at least
    half of the ground-truth words are present, else 0.0. The ``vqa_graded`` reward scales it (3.0 / 1.5 / 0)."""
    _require_gold(gold)
    if not normalize_text(gold[:TEXT_MAX_CHARS]):
        raise ValueError("solution is empty after normalisation")
    return graded_overlap(pred, gold)


@accuracy_method("default")
def default_match(pred: str, gold: str) -> float:
    """math-verify if it can decide; else numeric (when both hold exactly one number); else, when the solution is a
    bare option letter (``B``, ``(B)``, ``B.``) and the prediction gives one, the letters compared; else exact match."""
    _require_gold(gold)
    verdict = math_verify_verdict(pred, gold)
    if verdict is not None:
        return 1.0 if verdict else 0.0
    value, target = single_number(pred), single_number(gold)
    if value is not None and target is not None:
        return 1.0 if _numbers_close(value, target) else 0.0
    letter = _bare_choice(gold)
    if letter is not None:
        choice = extract_choice(pred)
        if choice is not None:
            return 1.0 if choice == letter else 0.0
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
    """Accuracy reward: how well the completion's answer matches the row's solution. Range [0.0, 1.0] (only the
    ``fuzzy`` and ``vqa_graded`` methods give values other than 0.0 and 1.0).

    The predicted answer is the content of the completion's LAST ``<answer>…</answer>`` (the whole completion when
    it has none); the gold answer is likewise the content of the solution's answer tag, or the whole solution.
    Per row, ``accu_reward_method`` picks the comparison (missing column / None / "" / "default" -> default):

    - ``default``: math-verify (``parse``/``verify``) when both sides parse; otherwise, if both hold exactly one
      number, numeric comparison (relative tolerance 1e-6); otherwise, if the solution is a bare option letter
      (``B``, ``(B)``, ``B.``) and the answer gives a letter (as in ``mcq``), the letters compared; otherwise
      normalised exact match.
    - ``mcq``: option letters compared (:func:`extract_choice`: ``B``, ``(B) cat``, ``B. cat``, ``the answer is C``,
      one distinct ``(D)``); 0.0 when the answer gives none.
    - ``yes_no``: yes/no answers compared (:func:`yes_no_value`: first normalised word yes/true/y or no/false/n,
      else the only one of "yes"/"no" present); 0.0 when the answer is neither.
    - ``math``: math-verify only (``\\boxed{}`` preferred); 0.0 when the answer doesn't parse.
    - ``numeric``: exactly one number on each side, equal within relative tolerance 1e-6.
    - ``exact``: equal after NFKC + case-folding, dropping punctuation that isn't between two letters/digits, and
      collapsing whitespace (``"Red."`` == ``"red"``).
    - ``fuzzy``: partial credit ``1 - Levenshtein(pred, gold) / max(len(pred), len(gold))`` on the normalised texts.
    - ``vqa_graded``: ViVQA-X grading on normalised texts: 1.0 exact, 0.5 when >= 50% of the ground-truth words
      occur in the answer, else 0.0.

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
        pred = final_answer(completion)  # never tool output
        rewards.append(float(compare(pred, gold)))
    return rewards


def vqa_graded_reward(
    completions: Sequence[Any], solution: Sequence[Any] | None = None, scale: float = 3.0, **kwargs: Any
) -> list[float | None]:
    """ViVQA-X graded accuracy. Range {0, scale/2, scale} (default scale 3.0: {0.0, 1.5, 3.0}).

    The answer is the completion's last ``<answer>…</answer>`` (whole completion without one), the gold answer the
    solution's ``<answer>`` (whole solution without one); both are normalised as in ``exact`` (NFKC, case-folded,
    outer punctuation dropped, whitespace collapsed) and split into words. ``scale`` (3.0) for equal texts,
    ``scale / 2`` (1.5) when at least 50% of the ground-truth words (with repetition) occur among the answer's
    words, else 0.0. ``scale`` comes from ``--reward_kwargs '{"vqa_graded": {"scale": 3.0}}'``. Raises
    ``ValueError`` on malformed rows (no/empty solution).
    """
    if solution is None:
        raise ValueError("The vqa_graded reward needs a 'solution' column")
    scale = float(scale)
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"vqa_graded scale must be a finite number >= 0, got {scale}")
    if len(solution) != len(completions):
        raise ValueError(f"Got {len(completions)} completions but {len(solution)} solutions")
    rewards: list[float | None] = []
    for completion, sol in zip(completions, solution, strict=True):
        if sol is None:
            raise ValueError("solution is None")
        gold = extract_answer(sol if isinstance(sol, str) else str(sol))
        pred = final_answer(completion)  # never tool output
        rewards.append(scale * vqa_graded_match(pred, gold))
    return rewards


accuracy_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
vqa_graded_reward.value_range = (0.0, 3.0)  # type: ignore[attr-defined]  # with the default scale

__all__ = [
    "ACCURACY_METHODS",
    "accuracy_method",
    "accuracy_reward",
    "default_match",
    "exact_match",
    "extract_choice",
    "fuzzy_match",
    "graded_overlap",
    "math_match",
    "math_verify_verdict",
    "mcq_match",
    "normalize_text",
    "numeric_match",
    "single_number",
    "vqa_graded_match",
    "vqa_graded_reward",
    "yes_no_match",
    "yes_no_value",
]
