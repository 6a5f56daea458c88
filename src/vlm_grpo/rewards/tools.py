"""Rewards for tool-using rollouts: ``tool_use``, ``deepeyes`` (DeepEyes' ``vl_agent.py`` score), ``tool_format``.

A tool rollout's completion is a list of messages: assistant turns, with the ``tool`` messages that TRL's
tool loop appended between them. With registered tools the rewards also receive the rollout's
environment (``environments``), which counts calls that returned successfully.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from vlm_grpo.rewards.base import completion_text
from vlm_grpo.tools.base import MALFORMED_CALL
from vlm_grpo.tools.protocols import HERMES_MALFORMED, MISTRAL_MALFORMED, MISTRAL_V7_MALFORMED

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# GLM-4.5's call format inside <tool_call>: the name, then <arg_key>/<arg_value> pairs
_GLM_CALL = re.compile(r"\s*[^\s{<]+\s*(?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*", re.DOTALL)
# What the hidden tool answers for a call the chat template's own format could not read
_UNREADABLE = {HERMES_MALFORMED, MISTRAL_MALFORMED, MISTRAL_V7_MALFORMED}


def _messages(completion: Any) -> list[dict[str, Any]]:
    if isinstance(completion, list):
        return [m for m in completion if isinstance(m, dict)]
    return [{"role": "assistant", "content": completion_text(completion)}]


def assistant_text(completion: Any) -> str:
    """The model's own text of a rollout (tool results left out), turns joined by newlines."""
    return "\n".join(completion_text([m]) for m in _messages(completion) if m.get("role") == "assistant")


def _is_error(message: dict[str, Any]) -> bool:
    content = message.get("content")
    # TRL answers a failed call with str({"error": ...}); our tools' errors arrive that way too.
    return isinstance(content, str) and content.startswith("{'error'")


def successful_calls(completion: Any, environment: Any = None) -> int:
    """Tool calls that returned a result rather than an error."""
    if environment is not None and hasattr(environment, "successes"):
        return int(environment.successes)
    return sum(1 for m in _messages(completion) if m.get("role") == "tool" and not _is_error(m))


def tool_use_reward(
    completions: Sequence[Any], environments: Sequence[Any] | None = None, bonus: float = 1.0, **kwargs: Any
) -> list[float]:
    """``bonus`` (1.0) when the rollout called a tool and at least one call returned successfully, else 0."""
    envs = list(environments) if environments is not None and len(environments) == len(completions) else None
    return [bonus if successful_calls(c, envs[i] if envs else None) > 0 else 0.0 for i, c in enumerate(completions)]


# The image markers a family's chat template writes for one image: DeepEyes counts the opening pair of Qwen's.
IMAGE_MARKERS = {
    "qwen": ("<|vision_start|><|image_pad|>", "<|image_pad|><|vision_end|>"),
    "internvl": ("<img><IMG_CONTEXT>", "<IMG_CONTEXT></img>"),
}
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
DEEPEYES_RULES = ("vstar", "common")
#: DeepEyes refuses answers this long (characters) as an attempt to sway the judge: no accuracy, format error.
DEEPEYES_MAX_ANSWER = 1000


def _content_text(content: Any, image_marker: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or []:
        if isinstance(part, dict) and part.get("type") == "image":
            parts.append(image_marker)
        elif isinstance(part, dict):
            parts.append(str(part.get("text") or ""))
        else:
            parts.append(str(part))
    return "".join(parts)


def response_text(completion: Any, image_marker: str = _QWEN_IMAGE) -> str:
    """The rollout as one text, the way verl-style reward code (DeepEyes) reads a response: the model's turns with
    their ``<tool_call>`` blocks, and each tool reply in ``<tool_response>`` with ``image_marker`` for each image it
    returned. A completion that is already text is returned as it is."""
    if isinstance(completion, str):
        return completion
    pieces = []
    for message in _messages(completion):
        role = message.get("role")
        text = _content_text(message.get("content"), image_marker)
        if role == "assistant":
            for call in message.get("tool_calls") or []:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and "<tool_call>" not in text and function.get("name"):
                    body = {"name": function.get("name"), "arguments": function.get("arguments") or {}}
                    text += "\n<tool_call>\n" + json.dumps(body, default=str) + "\n</tool_call>"
            pieces.append(text)
        elif role == "tool":
            pieces.append(f"<tool_response>\n{text}\n</tool_response>")
        else:
            pieces.append(text)
    return "\n".join(pieces)


def count_images(text: str) -> int:
    """Images in a response text: the opening image markers of every family (Qwen's, InternVL's)."""
    return sum(text.count(opening) for opening, _ in IMAGE_MARKERS.values())


def deepeyes_terms(text: str, rule: str = "vstar") -> tuple[str | None, bool, int]:
    """DeepEyes' reading of a response text (``vl_agent.py``): the answer to grade (None: no accuracy), whether the
    format is broken, and the images the response holds.

    Format errors: ``<think>`` / ``</think>`` counts differ; opening / closing image marker counts differ; after the
    last ``</think>``, ``<answer>`` / ``</answer>`` counts differ; the answer is 1,000 characters or longer (it
    then gets no accuracy either). The answer: ``rule="vstar"`` (DeepEyes' ``compute_score``, its V* / chart data)
    takes the text after the last ``<answer>`` up to the next ``</answer>`` -- the whole response when there is no
    tag; ``rule="common"`` (``compute_common_reasoning``) takes the first ``<answer>...</answer>`` after the last
    ``</think>``, and a missing or empty one gives no accuracy and a format error.
    """
    if rule not in DEEPEYES_RULES:
        raise ValueError(f"deepeyes rule must be one of {DEEPEYES_RULES}, got {rule!r}")
    broken = text.count("<think>") != text.count("</think>")
    broken |= any(text.count(opening) != text.count(closing) for opening, closing in IMAGE_MARKERS.values())
    after_think = text.split("</think>")[-1].strip()
    broken |= after_think.count("<answer>") != after_think.count("</answer>")
    answer: str | None
    if rule == "vstar":
        answer = text.split("<answer>")[-1].split("</answer>")[0].strip()
    else:
        match = re.search(r"<answer>(.*?)</answer>", after_think, re.DOTALL)
        answer = match.group(1).strip() if match else None
        if not answer:
            answer, broken = None, True
    if answer is not None and len(answer) >= DEEPEYES_MAX_ANSWER:
        answer, broken = None, True
    return answer, broken, count_images(text)


def deepeyes_judge_template(rule: str = "vstar") -> str:
    """Path of the packaged judge prompt DeepEyes uses with ``rule`` (for ``llm_judge``'s ``template``)."""
    from importlib import resources

    name = "judge_deepeyes.txt" if rule == "vstar" else "judge_deepeyes_common.txt"
    return str(resources.files("vlm_grpo.rewards").joinpath("templates", name))


def deepeyes_reward(
    completions: Sequence[Any],
    accuracy: str = "accuracy",
    accuracy_kwargs: dict[str, Any] | None = None,
    rule: str = "vstar",
    accuracy_weight: float = 0.8,
    format_weight: float = 0.2,
    tool_weight: float = 1.2,
    image_marker: str = _QWEN_IMAGE,
    **kwargs: Any,
) -> list[float | None]:
    """DeepEyes' ``vl_agent.py`` score: 0.8 x accuracy + 0.2 x format + 1.2 x tool.

    The response is read as DeepEyes reads it (:func:`response_text`, :func:`deepeyes_terms`): format is -1 when
    a tag or image-marker count is unbalanced or the answer is 1,000+ characters, else 0; tool is 1 when the
    response holds an image (a tool returned one) and the accuracy is > 0.5. Accuracy: the ``accuracy`` reward (or
    ``llm_judge``, given DeepEyes' own judge prompt, system message and temperature unless ``accuracy_kwargs``
    says otherwise, or any registered reward) on the extracted answer; 0 when there is none.
    """
    from vlm_grpo.rewards import REWARDS

    scorer: Callable[..., list[float | None]] = REWARDS.get(accuracy)
    options = dict(accuracy_kwargs or {})
    if accuracy == "llm_judge":
        options.setdefault("template", deepeyes_judge_template(rule))
        options.setdefault("temperature", 0.3 if rule == "vstar" else 0.5)
        if rule == "vstar":
            options.setdefault("system_prompt", "You are a helpful assistant.")
    terms = [deepeyes_terms(response_text(c, image_marker), rule) for c in completions]
    graded = [i for i, (answer, _, _) in enumerate(terms) if answer is not None]
    scores: list[float | None] = [0.0] * len(completions)
    if graded:
        columns = {k: ([v[i] for i in graded] if _per_sample(v, len(completions)) else v) for k, v in kwargs.items()}
        texts = [f"<answer>{terms[i][0]}</answer>" for i in graded]
        for i, value in zip(graded, scorer(texts, **columns, **options), strict=True):
            scores[i] = value
    out: list[float | None] = []
    for acc, (_, broken, images) in zip(scores, terms, strict=True):
        if acc is None:
            out.append(None)
            continue
        tool = 1.0 if images > 0 and acc > 0.5 else 0.0
        out.append(accuracy_weight * acc + format_weight * (-1.0 if broken else 0.0) + tool_weight * tool)
    return out


def _per_sample(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n


def tool_format_reward(completions: Sequence[Any], require_call: bool = False, **kwargs: Any) -> list[float]:
    """1 when every ``<tool_call>`` the model wrote was a closed block holding ``{"name": str, "arguments": {}}``
    JSON (TRL turns such blocks into calls; a malformed one is answered with an error message), else 0. A family
    with its own call format is judged by what the tool protocol read: a GLM-4.5 block (``<tool_call>NAME`` with
    ``<arg_key>`` / ``<arg_value>`` pairs) the turn's calls came from counts as well formed, and a call that the
    template's format could not read (Mistral's ``[TOOL_CALLS]`` included) scores 0.
    With ``require_call``, a rollout without any tool call also scores 0."""
    out = []
    for completion in completions:
        calls = 0
        ok = True
        for message in _messages(completion):
            if message.get("role") != "assistant":
                continue
            parsed = [c.get("function") or {} for c in message.get("tool_calls") or [] if isinstance(c, dict)]
            calls += len(message.get("tool_calls") or [])
            unread = [c for c in parsed if c.get("name") == MALFORMED_CALL]
            if any((c.get("arguments") or {}).get("message") in _UNREADABLE for c in unread):
                ok = False
            text = completion_text([message])
            if text.count("<tool_call>") != text.count("</tool_call>"):
                ok = False
            for block in _TOOL_CALL.findall(text):
                calls += 1
                try:
                    call = json.loads(block)
                except ValueError:
                    ok = ok and bool(parsed) and not unread and _GLM_CALL.fullmatch(block) is not None
                    continue
                if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
                    ok = False
                elif not isinstance(call.get("arguments", {}), dict):
                    ok = False
        out.append(1.0 if ok and (calls or not require_call) else 0.0)
    return out


tool_use_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]  # with the default bonus
deepeyes_reward.value_range = (-0.2, 2.0)  # type: ignore[attr-defined]  # with the default weights
tool_format_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
