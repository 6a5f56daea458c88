"""What the trainer needs for multi-turn tool rollouts on top of TRL's tool loop.

Every family is asked to call tools in the Hermes / Qwen format, ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; InternVL's ``-hf`` checkpoints share the ``<|im_start|>``
chat format and are given the same one), parsed by TRL's Qwen response template.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from vlm_grpo.tools.base import (
    MALFORMED_CALL,
    CoordSize,
    ToolEnvironment,
    make_environment_factory,
    parse_tool_kwargs,
)
from vlm_grpo.tools.templates import family_tool_template

logger = logging.getLogger(__name__)

# The packed log-prob pass shares one prompt per group; after a tool turn every rollout's prefix is its own.
# (Generation keeps share_prefill / fast_decode: the first turn shares its prompt, later turns decode fast.)
_SPEED_FEATURES = ("share_prompt",)
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_VISION_TOKENS += ("<IMG_CONTEXT>", "<img>", "</img>", "<video>")


def tile_fields(image_processor: Any, images: list | None, fields: dict[str, Any]) -> dict[str, Any]:
    """InternVL's prompt fields in the form TRL's tool loop can cut per rollout.

    With an environment per rollout, TRL tokenizes each prompt alone, and InternVL's tiles come back as a list
    of tensors. In a round where no tool returned an image, TRL's loop splits ``pixel_values`` per rollout: a
    list fails there, and a tile-indexed tensor needs each rollout's tile count (``num_tiles``, which TRL's
    log-prob pass computes the same way). Other families' fields come back as they are. The trainer's
    ``_generate_single_turn`` leaves ``num_tiles`` out of what reaches ``generate``.
    """
    pixels = fields.get("pixel_values")
    if images is None or "image_grid_thw" in fields or not isinstance(pixels, list) or not pixels:
        return fields
    import torch

    if not all(isinstance(p, torch.Tensor) for p in pixels):
        return fields
    pixels = torch.cat([p if p.ndim == 4 else p[None] for p in pixels])
    flat = [image for row in images if row for image in row]
    if pixels.size(0) == len(flat):
        per_image = [1] * len(flat)
    else:
        per_image = image_processor(images=flat, crop_to_patches=True, return_tensors="pt")["num_patches"].tolist()
    tiles, start = [], 0
    for row in images:
        count = len(row) if row else 0
        tiles.append(sum(per_image[start : start + count]))
        start += count
    return {**fields, "pixel_values": pixels, "num_tiles": tiles}


def build_tool_environment(
    names: Sequence[str], tool_kwargs: str | Mapping[str, Any] | None = None, coord_size: CoordSize | None = None
) -> type[ToolEnvironment]:
    """The environment class (TRL's ``environment_factory``) holding the named tools."""
    from vlm_grpo.tools import TOOLS

    if not names:
        raise ValueError("--tool_kwargs was given without --tools")
    return make_environment_factory([TOOLS.get(name) for name in names], parse_tool_kwargs(tool_kwargs), coord_size)


def prepare_for_tools(args: Any, processing_class: Any) -> None:
    """Set the tool-call parser when the checkpoint has none, and turn the packed log-prob pass off.

    ``share_prompt`` packs one prompt per group; tool turns make every rollout's prefix its own, so the
    log-prob passes are TRL's per-row ones. Generation keeps the speed path: the first turn prefills each
    prompt once for its group, and every turn decodes with ``fast_decode`` (``VLMGRPOTrainer._generate_single_turn``).
    """
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    from trl.chat_template_utils import supports_tool_calling

    if processing_class is not None and not supports_tool_calling(processing_class):
        template = family_tool_template(tokenizer.get_vocab())
        if template is not None:  # else TRL says the template does not support tool calling
            logger.info("The checkpoint's chat template renders no tools: using Qwen2.5's tool format with it")
            processing_class.chat_template = template
            if tokenizer is not processing_class:
                tokenizer.chat_template = template
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        from trl.chat_template_utils import qwen3_template

        tokenizer.response_template = qwen3_template
    # The model must not write image placeholders itself: tool results are the only source of image tokens
    # after the prompt, and a stray <|image_pad|> or <|video_pad|> breaks the log-prob pass (3D positions, tokens
    # vs features). Random and early policies do sample them.
    vocab = tokenizer.get_vocab()
    placeholders = sorted(vocab[t] for t in _VISION_TOKENS if t in vocab)
    if placeholders and args is not None:
        kwargs = dict(getattr(args, "generation_kwargs", None) or {})
        kwargs["suppress_tokens"] = sorted(set(kwargs.get("suppress_tokens") or []) | set(placeholders))
        args.generation_kwargs = kwargs
    on = [name for name in _SPEED_FEATURES if getattr(args, name, False)]
    if on:
        logger.info(
            "Tool rollouts are multi-turn: %s turned off for this run (TRL's per-row log-prob passes)", ", ".join(on)
        )
        for name in on:
            setattr(args, name, False)


_EXECUTOR: ThreadPoolExecutor | None = None


def prefetch_tool_calls(
    environments: Sequence[Any] | None, completions: Sequence[Any], seen: set[int] | None = None
) -> int:
    """Start the pending calls of parallel tools (``fn.parallel = True``: the python sandbox) of every rollout
    at once, before TRL's tool loop asks for them one rollout after another. A rollout's pending calls are
    those of its last message when that is an assistant turn not started before (``seen``: message ids).
    Returns the rollouts started."""
    global _EXECUTOR
    started = 0
    for env, turns in zip(environments or [], completions, strict=False):
        if not isinstance(env, ToolEnvironment) or not turns or not isinstance(turns[-1], dict):
            continue
        last = turns[-1]
        if last.get("role") != "assistant" or (seen is not None and id(last) in seen):
            continue
        if seen is not None:
            seen.add(id(last))
        calls = []
        for call in last.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("arguments", {}), dict):
                break
            method = getattr(type(env), str(function.get("name")), None)
            if not getattr(getattr(method, "tool_function", None), "parallel", False):
                break  # keep the rollout's calls in order: stop at the first one that is not prefetched
            calls.append((function["name"], function.get("arguments") or {}))
        if calls:
            if _EXECUTOR is None:
                _EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vlm-grpo-tools")
            started += env._prefetch(calls, _EXECUTOR)
    return started


class ToolBatch:
    """The rollouts of one tool loop: their parallel tool calls start together, round after round.

    On entry the first round's calls start; in later rounds the first parallel call TRL makes starts every
    rollout's pending calls (TRL has appended the new assistant turns to ``completions`` by then).
    """

    def __init__(self, environments: Sequence[Any] | None, completions: Sequence[Any]) -> None:
        self.environments = [e for e in environments or [] if isinstance(e, ToolEnvironment)]
        self.all_environments = environments
        self.completions = completions
        self.seen: set[int] = set()

    def prefetch(self) -> int:
        return prefetch_tool_calls(self.all_environments, self.completions, self.seen)

    def __enter__(self) -> ToolBatch:
        self.prefetch()
        for env in self.environments:
            env._batch = self
        return self

    def __exit__(self, *exc: Any) -> None:
        for env in self.environments:
            env._batch = None


def mark_malformed_call(message: dict[str, Any]) -> bool:
    """Turn an assistant message that wrote ``<tool_call>`` but no parseable call into a call of the hidden
    :data:`MALFORMED_CALL` tool (its text, and the tokens the model wrote, stay as they are)."""
    content = message.get("content")
    if message.get("role") != "assistant" or message.get("tool_calls") or not isinstance(content, str):
        return False
    if "<tool_call>" not in content:
        return False
    message["tool_calls"] = [{"type": "function", "function": {"name": MALFORMED_CALL, "arguments": {}}}]
    return True


def answer_malformed_call() -> str:
    """What the model reads back after a malformed call (TRL counts it as a failed call)."""
    raise ValueError(
        'the <tool_call> block could not be read: write <tool_call>{"name": "<tool name>", "arguments": {...}}'
        "</tool_call> with valid JSON"
    )


def malformed_call_tool(environment: Any = None) -> Callable[[], str]:
    """The hidden :data:`MALFORMED_CALL` tool of one rollout, for its entry in TRL's per-rollout tool dict: it
    answers with :func:`answer_malformed_call`'s error, counted as a failed call of the rollout's environment
    (``tools/calls_per_rollout``, ``tools/errors_per_rollout``) as TRL counts it in ``tools/failure_frequency``."""

    def malformed_tool_call() -> str:
        if isinstance(environment, ToolEnvironment):
            environment.calls += 1
            environment.errors += 1
        return answer_malformed_call()

    return malformed_tool_call


class MalformedCallParser:
    """Stands in for the trainer's tokenizer (``trainer._tokenizer``) while TRL's tool loop runs.

    The loop parses every post-tool turn with ``trl.chat_template_utils.parse_response(trainer._tokenizer, ...)``,
    which calls ``tokenizer.parse_response`` and reads a turn whose call does not parse as plain text, ending the
    rollout. Here ``parse_response`` runs TRL's own ``parse_response`` on the real tokenizer (its fallback to
    text, its tool-call checks) and marks such a turn as a call of the hidden :data:`MALFORMED_CALL` tool
    (:func:`mark_malformed_call`), so the loop answers it like a first turn's. Everything else is the tokenizer's.
    """

    def __init__(self, tokenizer: Any) -> None:
        object.__setattr__(self, "_wrapped", tokenizer)

    def parse_response(self, response: Any, schema: Any = None, **kwargs: Any) -> Any:
        one_turn = isinstance(response, list) and all(isinstance(t, int) for t in response)
        if not one_turn or schema is not None or set(kwargs) - {"prefix", "tools"}:  # not the tool loop's call
            return self._wrapped.parse_response(response, schema, **kwargs)
        from trl.chat_template_utils import parse_response

        parsed = parse_response(self._wrapped, response, prefix=kwargs.get("prefix"), tools=kwargs.get("tools"))
        mark_malformed_call(parsed)
        return parsed

    def __getattr__(self, name: str) -> Any:  # only for names the instance lacks: everything but _wrapped
        if name == "_wrapped":
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._wrapped)


@contextmanager
def parse_malformed_calls(trainer: Any) -> Iterator[None]:
    """``trainer._tokenizer`` is a :class:`MalformedCallParser` inside the block, the tokenizer again after it
    (exceptions included)."""
    tokenizer = trainer._tokenizer
    trainer._tokenizer = MalformedCallParser(tokenizer)
    try:
        yield
    finally:
        trainer._tokenizer = tokenizer


def rollout_tool_stats(completions: Sequence[Any], environments: Sequence[Any] | None) -> dict[str, list[float]]:
    """Per-rollout counts for the log: assistant turns, tool calls, tool errors, images returned, timeouts."""
    turns = [float(sum(1 for m in c if isinstance(m, dict) and m.get("role") == "assistant")) for c in completions]
    stats = {"turns": turns}
    envs = [e for e in environments or [] if isinstance(e, ToolEnvironment)]
    if envs and len(envs) == len(completions):
        stats["calls_per_rollout"] = [float(e.calls) for e in envs]
        stats["errors_per_rollout"] = [float(e.errors) for e in envs]
        stats["images_returned"] = [float(len(e.images) - e.prompt_images) for e in envs]
        stats["sandbox_timeouts"] = [float(e.timeouts) for e in envs]
    return stats
