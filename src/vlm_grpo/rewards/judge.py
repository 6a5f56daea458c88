"""``llm_judge``: a served LLM grades each completion through an OpenAI-compatible chat endpoint.

For each sample a prompt is filled from a template file and sent with the official ``openai`` client to
``{base_url}/chat/completions`` (vLLM, SGLang, TGI, llama.cpp, OpenAI ...); the judge's reply is parsed into a
reward in [0, 1] (:func:`parse_verdict`). Requests run concurrently (at most ``max_concurrency`` in flight) with
the retry, cache, down-state and fallback rules of :mod:`vlm_grpo.rewards.client` (the openai client's own
retries are off, so one policy counts and bounds every attempt).

Template placeholders (plain text replacement, other braces are left alone): ``{question}`` (the row's question,
``<image>`` markers removed), ``{solution}`` (the reference: the content of its last ``<answer>`` tag, or all of
it), ``{answer}`` (the completion's answer the same way; the whole completion with ``answer_only=False``),
``{completion}`` (the whole completion). The default template (``templates/judge_default.txt``) asks for yes/no.

Parameters (``--reward_kwargs '{"llm_judge": {...}}'``; environment in brackets):

* ``base_url`` or ``judge_base_url`` [``JUDGE_BASE_URL``, else ``OPENAI_BASE_URL``]: e.g.
  ``http://127.0.0.1:8000/v1`` (a URL ending in ``/chat/completions`` is accepted too). Required.
* ``model`` or ``judge_model`` [``JUDGE_MODEL``]: the served model name. Required.
* ``api_key_env`` (default ``JUDGE_API_KEY``, else ``OPENAI_API_KEY``): the NAME of the environment variable
  holding the key. The key itself is read from the environment only -- passing ``api_key`` is refused -- is sent
  as a bearer token, and never appears in logs, warnings, metrics or reprs. No key set: no Authorization header
  (local servers).
* ``template`` [``JUDGE_TEMPLATE``]: path of a template file; ``system_prompt``: optional system message.
* ``verdict``: ``"auto"`` (default: a score if the reply gives one, else yes/no), ``"yes_no"`` or ``"score"``;
  ``max_score``: divide scores by it (e.g. 10); without it a score needs a denominator (``7/10``) or must be in
  [0, 1].
* ``max_concurrency`` [``JUDGE_MAX_CONCURRENCY``, 8], ``temperature`` (0.0), ``max_tokens`` (256),
  ``extra_body`` (dict merged into the request).
* ``timeout``, ``total_timeout``, ``max_retries``, ``backoff_factor``, ``jitter``, ``max_backoff``,
  ``cache_size``, ``down_cooldown``, ``warn_every``, ``fallback`` [``JUDGE_TIMEOUT`` ...], as for ``listener``.

A reply that cannot be parsed counts as a failure (the sample gets ``fallback``, the warning quotes the start of
the reply). Metrics: ``rewards/llm_judge/server_failures``, ``rewards/llm_judge/cache_hits``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
from collections.abc import Callable, Coroutine, Sequence
from importlib import resources
from typing import Any

from vlm_grpo.rewards.client import (
    RETRY_STATUSES,
    CallResult,
    RemoteError,
    ResilientClient,
    env_fallback,
    get_client,
    report,
    resolve_config,
    retry_after_seconds,
)
from vlm_grpo.rewards.format import extract_answer
from vlm_grpo.rewards.turns import final_turn
from vlm_grpo.tasks import IMAGE_TOKEN

DEFAULT_TEMPLATE = "judge_default.txt"
DEFAULT_API_KEY_ENV = "JUDGE_API_KEY"
VERDICT_MODES = ("auto", "yes_no", "score")

_THINK = re.compile(r"<think(?:ing)?>.*?</think(?:ing)?>", re.IGNORECASE | re.DOTALL)
_NUM = r"(-?\d+(?:\.\d+)?)"
_SCORE_TAG = re.compile(rf"<score>\s*{_NUM}\s*(?:/\s*{_NUM})?\s*</score>", re.IGNORECASE)
_SCORE_LABEL = re.compile(
    rf"\b(?:score|rating|grade|mark)\b\s*(?:is|of)?\s*[:=]?\s*\**\s*{_NUM}\s*(?:(?:/|out\s+of)\s*{_NUM})?",
    re.IGNORECASE,
)
_FRACTION = re.compile(rf"{_NUM}\s*(?:/|out\s+of)\s*{_NUM}", re.IGNORECASE)
_BARE_NUMBER = re.compile(rf"\s*{_NUM}\s*\.?\s*")
_VERDICT_LABEL = re.compile(
    r"\b(?:verdict|judg(?:e)?ment|decision|final\s+answer|answer|correct)\s*[:=]\s*[*\"'`\[(]*\s*([A-Za-z]+)",
    re.IGNORECASE,
)
# "Judgement: 1" / "Verdict: 0" (DeepEyes' judge): a labelled binary verdict.
_BINARY_LABEL = re.compile(
    r"\b(?:verdict|judg(?:e)?ment|decision|correct(?:ness)?|result|label)\s*[:=]\s*[*\"'`\[(]*\s*([01])(?![\d.])",
    re.IGNORECASE,
)
# "[[A]]" / "[[B]]" (pairwise-style judges: A = the answer is right), "[[yes]]", "Rating: [[7]]" (MT-bench).
_BRACKETED = re.compile(r"\[\[\s*([A-Za-z]+|-?\d+(?:\.\d+)?)\s*\]\]")
_BRACKET_LETTERS = {"a": 1.0, "b": 0.0}
_YES = frozenset({"yes", "correct", "true", "right", "consistent", "match", "matches", "pass", "accept"})
_NO = frozenset({"no", "incorrect", "false", "wrong", "inconsistent", "mismatch", "fail", "reject"})
_NEGATED_YES = re.compile(r"\bnot\s+(?:correct|right|consistent|a\s+match)\b", re.IGNORECASE)
_WORD = re.compile(r"[A-Za-z]+")


# =========================================================================== verdict parsing
def _normalise(value: float, denominator: float | None, max_score: float | None) -> float | None:
    if denominator is not None:
        if denominator <= 0:
            return None
        score = value / denominator
    elif max_score is not None:
        score = value / max_score
    else:
        score = value
    if -1e-9 <= score <= 1 + 1e-9:
        return min(1.0, max(0.0, score))
    return None


def _parse_score(text: str, max_score: float | None, patterns: Sequence[re.Pattern[str]], bare: bool) -> float | None:
    for pattern in patterns:
        matches = list(pattern.finditer(text))
        if matches:
            groups = [g for g in matches[-1].groups() if g is not None]
            value = float(groups[0])
            denominator = float(groups[1]) if len(groups) > 1 else None
            return _normalise(value, denominator, max_score)
    if bare:
        match = _BARE_NUMBER.fullmatch(text)
        if match:
            return _normalise(float(match.group(1)), None, max_score)
    return None


def _word_verdict(word: str) -> float | None:
    word = word.lower()
    if word in _YES:
        return 1.0
    if word in _NO:
        return 0.0
    return None


def _parse_marked(text: str, max_score: float | None, words: bool, numbers: bool) -> float | None:
    """Verdicts a judge marks unambiguously: ``Judgement: 1/0``, then the last ``[[...]]``."""
    if words:
        binary = list(_BINARY_LABEL.finditer(text))
        if binary:
            return float(binary[-1].group(1))
    bracketed = list(_BRACKETED.finditer(text))
    if bracketed:
        value = bracketed[-1].group(1)
        if value[0].isalpha():
            if words:
                return _BRACKET_LETTERS.get(value.lower(), _word_verdict(value))
        elif numbers:
            return _normalise(float(value), None, max_score)
    return None


def _parse_yes_no(text: str) -> float | None:
    labelled = list(_VERDICT_LABEL.finditer(text))
    if labelled:
        verdict = _word_verdict(labelled[-1].group(1))
        if verdict is not None:
            return verdict
    first = _WORD.search(text)
    if first is not None:
        verdict = _word_verdict(first.group(0))
        if verdict is not None:
            return verdict
    if _NEGATED_YES.search(text):
        return 0.0
    words = {w.lower() for w in _WORD.findall(text)}
    says_yes, says_no = bool(words & _YES), bool(words & _NO)
    if says_yes != says_no:
        return 1.0 if says_yes else 0.0
    return None


def parse_verdict(text: str | None, mode: str = "auto", max_score: float | None = None) -> float | None:
    """A judge's reply -> reward in [0, 1], or None when it gives no usable verdict.

    ``<think>…</think>`` blocks are dropped first. Marked verdicts come first: ``Judgement: 1`` / ``Verdict: 0``
    (a labelled 0 or 1), then the last ``[[...]]``: ``[[A]]`` -> 1.0, ``[[B]]`` -> 0.0, ``[[yes]]`` / ``[[no]]``,
    ``[[7]]`` a score (with ``max_score``, or in [0, 1]).
    Scores: ``<score>x</score>``, ``score: x`` (also rating/grade),
    ``x/y`` or ``x out of y`` (the last one wins); ``x/y`` gives ``x / y``, otherwise ``x / max_score``, or ``x``
    itself when no ``max_score`` is given (it must then lie in [0, 1]). In ``"score"`` mode a reply that is just a
    number counts too. Yes/no: a labelled verdict (``Verdict: yes``, ``Judgement: incorrect``...), else the first
    word, else the only kind of verdict word present (yes/correct/true/right... -> 1.0; no/incorrect/false/
    wrong... -> 0.0; "not correct" -> 0.0). ``"auto"`` tries a tagged or labelled score, then yes/no, then
    ``x/y``, then a reply that is just a number.
    """
    if mode not in VERDICT_MODES:
        raise ValueError(f"verdict mode must be one of {VERDICT_MODES}, got {mode!r}")
    if not isinstance(text, str):
        return None
    text = _THINK.sub(" ", text).strip()
    if not text:
        return None
    marked = _parse_marked(text, max_score, words=mode != "score", numbers=mode != "yes_no")
    if marked is not None:
        return marked
    if mode == "yes_no":
        return _parse_yes_no(text)
    if mode == "score":
        return _parse_score(text, max_score, (_SCORE_TAG, _SCORE_LABEL, _FRACTION), bare=True)
    score = _parse_score(text, max_score, (_SCORE_TAG, _SCORE_LABEL), bare=False)
    if score is not None:
        return score
    verdict = _parse_yes_no(text)
    if verdict is not None:
        return verdict
    return _parse_score(text, max_score, (_FRACTION,), bare=True)


# =========================================================================== prompts
def load_template(path: str | None = None) -> str:
    """The template text: ``path`` (or ``$JUDGE_TEMPLATE``), else the packaged default."""
    path = path or os.environ.get("JUDGE_TEMPLATE") or None
    if path:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            return handle.read()
    return resources.files("vlm_grpo.rewards").joinpath("templates", DEFAULT_TEMPLATE).read_text(encoding="utf-8")


def fill_template(template: str, **values: str) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def chat_completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/chat/completions") else base + "/chat/completions"


def _api_base(base_url: str) -> str:
    """The openai client's ``base_url``: the given URL without a trailing ``/chat/completions``."""
    base = base_url.rstrip("/")
    return base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base


def _reply_text(completion: Any) -> str | None:
    try:
        message = completion.choices[0].message
    except (AttributeError, IndexError, TypeError):
        raise RemoteError("judge answer has no choices[0].message", retryable=False) from None
    content = getattr(message, "content", None)
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None


def _sender(client: ResilientClient, api: Any) -> Callable[[dict[str, Any], float], Coroutine[Any, Any, Any]]:
    """One chat request through the openai client, its failures as :class:`RemoteError` (retryable or not)."""
    import openai

    # No key: send no Authorization header at all (local servers), rather than a placeholder bearer token.
    auth = {} if client.config.token else {"extra_headers": {"Authorization": openai.Omit()}}

    async def send(payload: dict[str, Any], timeout: float) -> Any:
        try:
            return await api.chat.completions.create(**payload, **auth, timeout=timeout)
        except openai.APITimeoutError as exc:
            raise RemoteError(f"timed out ({type(exc).__name__})", retryable=True) from None
        except openai.APIStatusError as exc:
            body = client.scrub(exc.response.text[:300].replace("\n", " "))
            raise RemoteError(
                f"HTTP {exc.status_code} from {client.config.url}: {body}",
                exc.status_code in RETRY_STATUSES,
                retry_after_seconds(exc.response.headers),
            ) from None
        except openai.APIConnectionError as exc:
            raise RemoteError(client.scrub(f"{type(exc).__name__}: {exc}"), retryable=True) from None
        except openai.OpenAIError as exc:
            raise RemoteError(client.scrub(f"{type(exc).__name__}: {exc}"), retryable=False) from None

    return send


async def _judge_all(client: ResilientClient, payloads: list[dict[str, Any]], parse: Callable, concurrency: int):
    import openai

    loopback = client.config.is_loopback
    http_client = openai.DefaultAsyncHttpxClient(trust_env=not loopback)
    async with openai.AsyncOpenAI(
        base_url=_api_base(client.config.url),
        api_key=client.config.token
        or "no-key",  # the client wants one; without a key the header is omitted per request
        max_retries=0,
        timeout=client.config.timeout,
        http_client=http_client,
    ) as api:
        return await client.amap_each(payloads, _sender(client, api), parse, concurrency)


def _run(factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


# =========================================================================== the reward
def llm_judge_reward(
    completions: Sequence[Any],
    question: Sequence[str] | None = None,
    solution: Sequence[Any] | None = None,
    *,
    base_url: str | None = None,
    model: str | None = None,
    judge_base_url: str | None = None,
    judge_model: str | None = None,
    api_key_env: str = DEFAULT_API_KEY_ENV,
    template: str | None = None,
    system_prompt: str | None = None,
    verdict: str = "auto",
    max_score: float | None = None,
    answer_only: bool = True,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    max_tokens: int = 256,
    extra_body: dict[str, Any] | None = None,
    fallback: float | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    timeout: float | None = None,
    total_timeout: float | None = None,
    max_retries: int | None = None,
    backoff_factor: float | None = None,
    jitter: float | None = None,
    max_backoff: float | None = None,
    cache_size: int | None = None,
    down_cooldown: float | None = None,
    warn_every: int | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """LLM-as-a-judge reward: an OpenAI-compatible chat endpoint grades each completion; range [0, 1].

    See the module docstring for the parameters, the template and the verdict rules.
    """
    for forbidden in ("api_key", "judge_api_key", "token"):
        if forbidden in kwargs:
            raise ValueError(
                f"llm_judge does not take '{forbidden}': put the key in the environment variable named by "
                f"api_key_env (default {DEFAULT_API_KEY_ENV})"
            )
    if verdict not in VERDICT_MODES:
        raise ValueError(f"verdict must be one of {VERDICT_MODES}, got {verdict!r}")
    base = base_url or judge_base_url or os.environ.get("JUDGE_BASE_URL") or os.environ.get("OPENAI_BASE_URL")
    model_name = model or judge_model or os.environ.get("JUDGE_MODEL")
    if not base:
        raise ValueError("llm_judge needs base_url (or judge_base_url, or $JUDGE_BASE_URL)")
    if not model_name:
        raise ValueError("llm_judge needs model (or judge_model, or $JUDGE_MODEL)")
    api_key = os.environ.get(api_key_env) or (
        os.environ.get("OPENAI_API_KEY") if api_key_env == DEFAULT_API_KEY_ENV else None
    )
    config = resolve_config(
        "JUDGE",
        url=chat_completions_url(base),
        timeout=timeout,
        total_timeout=total_timeout,
        max_retries=max_retries,
        backoff_factor=backoff_factor,
        jitter=jitter,
        max_backoff=max_backoff,
        cache_size=cache_size,
        down_cooldown=down_cooldown,
        warn_every=warn_every,
        token=api_key,
    )
    if max_concurrency is None:
        max_concurrency = int(os.environ.get("JUDGE_MAX_CONCURRENCY", "8") or 8)
    client = get_client("llm_judge", config)
    fallback = env_fallback("JUDGE", fallback)
    prompt_template = load_template(template)

    payloads = []
    for i, completion in enumerate(completions):
        text = final_turn(completion)  # the model's last turn: never tool output
        row_question = question[i] if question is not None and i < len(question) else ""
        row_solution = solution[i] if solution is not None and i < len(solution) else ""
        reference = extract_answer(row_solution if isinstance(row_solution, str) else str(row_solution))
        prompt = fill_template(
            prompt_template,
            question=" ".join(str(row_question or "").replace(IMAGE_TOKEN, " ").split()),
            solution=reference,
            answer=extract_answer(text) if answer_only else text.strip(),
            completion=text,
        )
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        payload: dict[str, Any] = {
            "model": model_name,
            "messages": messages,
            "temperature": temperature,
            "max_tokens": max_tokens,
        }
        if extra_body:
            payload["extra_body"] = dict(extra_body)
        payloads.append(payload)

    def parse(answer: Any) -> float:
        reply = _reply_text(answer)
        value = parse_verdict(reply, verdict, max_score)
        if value is None:
            snippet = " ".join((reply or "").split())[:80]
            raise RemoteError(f"unparseable judge verdict: {client.scrub(snippet)!r}", retryable=False)
        return value

    call: CallResult = _run(lambda: _judge_all(client, payloads, parse, max_concurrency))
    rewards = [value if ok else fallback for value, ok in zip(call.values, call.ok, strict=True)]
    report(client, call, call.failed, fallback, log_metric)
    return rewards


llm_judge_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]  # plus whatever ``fallback`` is

__all__ = ["chat_completions_url", "fill_template", "llm_judge_reward", "load_template", "parse_verdict"]
