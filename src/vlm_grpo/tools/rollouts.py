"""What the trainer needs for multi-turn tool rollouts on top of TRL's tool loop.

Families are asked to call tools in the Hermes / Qwen format, ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; InternVL's ``-hf`` checkpoints share the ``<|im_start|>``
chat format and are given the same one), parsed by TRL's Qwen response template; GLM and Mistral 3 in their own
formats (see :mod:`vlm_grpo.tools.templates`).
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
    ToolError,
    make_environment_factory,
    parse_tool_kwargs,
)
from vlm_grpo.tools.protocols import (
    ANSWER,
    HERMES_MALFORMED,
    ToolProtocol,
    function_call,
    images_of,
    resolve_protocol,
)
from vlm_grpo.tools.templates import family_response_template, family_tool_template

logger = logging.getLogger(__name__)

_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_VISION_TOKENS += ("<IMG_CONTEXT>", "<img>", "</img>", "<video>")
_VISION_TOKENS += ("<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>")
_VISION_TOKENS += ("<|video|>",)
_VISION_TOKENS += ("<image>", "<fake_token_around_image>", "<global-img>")
_VISION_TOKENS += ("[IMG]", "[IMG_BREAK]", "[IMG_END]")  # Pixtral's (Mistral 3)


def tile_fields(image_processor: Any, images: list | None, fields: dict[str, Any]) -> dict[str, Any]:
    """InternVL's prompt fields in the form TRL's tool loop can cut per rollout.

    With an environment per rollout, TRL tokenizes each prompt alone, and InternVL's tiles come back as a list
    of tensors. In a round where no tool returned an image, TRL's loop splits ``pixel_values`` per rollout: a
    list fails there, and a tile-indexed tensor needs each rollout's tile count (``num_tiles``, which TRL's
    log-prob pass computes the same way). Other families' fields come back as they are. The trainer's
    ``_generate_single_turn`` leaves ``num_tiles`` out of what reaches ``generate``.

    LLaVA-OneVision's come back as one tensor of tiles per image (``image_sizes`` beside them): they are padded to
    the largest tile count and stacked, one row per image, as one processor call over the batch lays them out.
    """
    pixels = fields.get("pixel_values")
    if images is None or "image_grid_thw" in fields or not isinstance(pixels, list) or not pixels:
        return fields
    import torch

    if not all(isinstance(p, torch.Tensor) for p in pixels):
        return fields
    if "image_sizes" in fields:
        most = max(p.size(0) for p in pixels)
        padded = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.size(0))) for p in pixels]
        sizes = torch.stack([torch.as_tensor(s) for s in fields["image_sizes"]])
        # batch_num_images is per prompt, which TRL's loop cannot cut per rollout; left out, every image is tiled,
        # as a one-image prompt's is
        rest = {k: v for k, v in fields.items() if k != "batch_num_images"}
        return {**rest, "pixel_values": torch.stack(padded), "image_sizes": sizes}
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


_TOOL_RUN_FLAGS = ("tool_protocol", "max_turn_tokens", "max_tool_images", "max_context_tokens")


def check_tool_flags(script_args: Any) -> None:
    """The tool flags of a run, checked before any model loads: tools, their options, the protocol, the budgets;
    a tool flag without ``--tools`` is an error (it would do nothing)."""
    from vlm_grpo.cli_errors import UserError

    if not script_args.tools:
        given = [f"--{name}" for name in _TOOL_RUN_FLAGS if getattr(script_args, name) is not None]
        if given:
            raise UserError(
                f"{', '.join(given)} without --tools: name the tools the model may call, e.g. --tools zoom_in"
            )
    if script_args.tools or script_args.tool_kwargs:
        factory = build_tool_environment(script_args.tools or [], script_args.tool_kwargs)
        tool_turns(
            [], factory, None, script_args.tool_protocol, script_args.max_context_tokens, script_args.max_tool_images
        )
    if script_args.max_turn_tokens is not None and script_args.max_turn_tokens < 1:
        raise UserError(f"--max_turn_tokens must be a positive number of tokens, got {script_args.max_turn_tokens}")


def tool_turns(
    tools: Sequence[Any],
    factory: Any,
    processing_class: Any,
    protocol_name: str | None,
    max_context_tokens: int | None = None,
    max_tool_images: int | None = None,
) -> ToolTurns:
    """The run's :class:`ToolTurns`: its protocol (``--tool_protocol``, else the one the tools name, else hermes),
    checked against the tools it calls by itself, and the budgets (positive, or None)."""
    if max_context_tokens is not None and max_context_tokens < 1:
        raise ValueError(f"--max_context_tokens must be a positive number of tokens, got {max_context_tokens}")
    if max_tool_images is not None and max_tool_images < 0:
        raise ValueError(f"--max_tool_images must be 0 or more images, got {max_tool_images}")
    functions = list(tools)
    for name in getattr(factory, "_tool_order", ()) or []:
        functions.append(getattr(getattr(factory, name), "tool_function", None))
    protocol = resolve_protocol(protocol_name, [f for f in functions if f is not None])
    if isinstance(protocol, type):  # a plugin named its class
        protocol = protocol()
    if not isinstance(protocol, ToolProtocol):
        raise ValueError(
            f"--tool_protocol {protocol_name}: {protocol!r} is not a ToolProtocol (vlm_grpo.tools.protocols)"
        )
    protocol = protocol.configured(dict(getattr(factory, "_options", None) or {}))
    available = {getattr(f, "__name__", None) for f in functions if f is not None}
    missing = [name for name in protocol.tool_names if name not in available]
    if missing:
        raise ValueError(
            f"--tool_protocol {protocol.name} runs the {', '.join(missing)} tool: add it to --tools "
            f"(now: {', '.join(sorted(n for n in available if n)) or 'none'})"
        )
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer is not None:
        protocol = protocol.for_vocab(tokenizer.get_vocab())
    return ToolTurns(protocol, tokenizer, max_context_tokens, max_tool_images)


def prepare_for_tools(args: Any, processing_class: Any) -> None:
    """Set the tool-call parser when the checkpoint has none, and keep the model from writing image placeholders.

    The speed path stays on: the first turn prefills each prompt once for its group, every turn decodes with
    ``fast_decode`` (``VLMGRPOTrainer._generate_single_turn``), and the packed log-prob pass (``share_prompt``)
    holds each rollout's turns, tool replies and tool images in its block after the shared prompt.
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
        # What the template writes between a user's words and the reply (Mistral's [/INST], Gemma's model turn).
        turn = [{"role": "user", "content": "\u2063"}]
        opener = processing_class.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
        opener = opener.rpartition("\u2063")[2]
        tokenizer.response_template = family_response_template(tokenizer.get_vocab(), opener, tokenizer.eos_token)
    # The model must not write image placeholders itself: tool results are the only source of image tokens
    # after the prompt, and a stray <|image_pad|> or <|video_pad|> breaks the log-prob pass (3D positions, tokens
    # vs features). Random and early policies do sample them.
    vocab = tokenizer.get_vocab()
    placeholders = sorted(vocab[t] for t in _VISION_TOKENS if t in vocab)
    if placeholders and args is not None:
        kwargs = dict(args.generation_kwargs or {})
        kwargs["suppress_tokens"] = sorted(set(kwargs.get("suppress_tokens") or []) | set(placeholders))
        args.generation_kwargs = kwargs


_EXECUTOR: ThreadPoolExecutor | None = None


def tool_executor() -> ThreadPoolExecutor:
    """The threads that run rollouts' calls ahead of TRL's loop (one pool for the process)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="vlm-grpo-tools")
    return _EXECUTOR


def is_parallel(cls: type, name: str) -> bool:
    """Whether the environment class's tool ``name`` is marked ``parallel`` (``fn.parallel = True``)."""
    return bool(getattr(getattr(getattr(cls, name, None), "tool_function", None), "parallel", False))


def parallel_calls(env: Any, tool_calls: Sequence[Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """``(name, arguments)`` of a turn's calls up to the first that is not of a parallel tool (``fn.parallel =
    True``): a rollout's calls keep their order."""
    calls = []
    for call in tool_calls or []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("arguments", {}), dict):
            break
        if not is_parallel(type(env), str(function.get("name"))):
            break
        calls.append((function["name"], function.get("arguments") or {}))
    return calls


def prefetch_tool_calls(
    environments: Sequence[Any] | None,
    completions: Sequence[Any],
    seen: set[int] | None = None,
    tool_turns: ToolTurns | None = None,
) -> int:
    """Start the pending calls of parallel tools (``fn.parallel = True``: the python sandbox) of every rollout
    at once, before TRL's tool loop asks for them one rollout after another. A rollout's pending calls are
    those of its last message when that is an assistant turn not started before (``seen``: message ids), and not
    started already as its turn ended (:mod:`vlm_grpo.tools.early_calls`); none once the rollout holds as many tool
    images as ``tool_turns`` allows (the call would be refused, see :meth:`ToolTurns.wrap`). Returns the rollouts
    started."""
    started = 0
    for env, turns in zip(environments or [], completions, strict=False):
        if not isinstance(env, ToolEnvironment) or not turns or not isinstance(turns[-1], dict):
            continue
        last = turns[-1]
        if last.get("role") != "assistant" or (seen is not None and id(last) in seen):
            continue
        if seen is not None:
            seen.add(id(last))
        calls = parallel_calls(env, last.get("tool_calls"))
        if calls and not env._ahead and not (tool_turns is not None and tool_turns.at_image_budget(env)):
            started += env._prefetch(calls, tool_executor())
    return started


class ToolBatch:
    """The rollouts of one tool loop: their parallel tool calls start together, round after round.

    On entry the calls of the loop's first turn start; in later turns the first parallel call TRL makes starts every
    rollout's pending calls (TRL has appended the new assistant turns to ``completions`` by then).
    """

    def __init__(
        self, environments: Sequence[Any] | None, completions: Sequence[Any], turns: ToolTurns | None = None
    ) -> None:
        self.environments = [e for e in environments or [] if isinstance(e, ToolEnvironment)]
        self.all_environments = environments
        self.completions = completions
        self.turns = turns
        self.seen: set[int] = set()

    def prefetch(self) -> int:
        return prefetch_tool_calls(self.all_environments, self.completions, self.seen, self.turns)

    def __enter__(self) -> ToolBatch:
        self.prefetch()
        for env in self.environments:
            env._batch = self
        return self

    def __exit__(self, *exc: Any) -> None:
        for env in self.environments:
            env._batch = None


class MalformedCall(ValueError):
    """An action the protocol could not read (or a call of an unknown tool): the model reads the message."""


def malformed_call_tool(environment: Any = None) -> Callable[..., str]:
    """The hidden :data:`MALFORMED_CALL` tool of one rollout, for its entry in TRL's per-rollout tool dict: it
    answers with the protocol's error message (``message``), counted as a failed call of the rollout's environment
    (``tools/calls_per_rollout``, ``tools/errors_per_rollout``) as TRL counts it in ``tools/failure_frequency``."""

    def malformed_tool_call(message: str = HERMES_MALFORMED) -> str:
        if isinstance(environment, ToolEnvironment):
            environment.calls += 1
            environment.errors += 1
        raise MalformedCall(message)

    return malformed_tool_call


def malformed(message: str) -> dict[str, Any]:
    return function_call(MALFORMED_CALL, {"message": message})


class ToolTurns:
    """One run's tool protocol at work in TRL's loop: reads each assistant turn (:meth:`read`), words each
    reply (:meth:`wrap`), and counts what it stopped: calls after a final answer, rollouts at the context budget,
    images over the per-rollout budget."""

    def __init__(
        self,
        protocol: ToolProtocol,
        tokenizer: Any,
        max_context_tokens: int | None = None,
        max_tool_images: int | None = None,
    ) -> None:
        self.protocol = protocol
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.max_tool_images = max_tool_images
        self.calls_after_answer = 0
        self.context_stops = 0
        self.image_refusals = 0
        self.image_counts: dict[int, dict[str, int]] = {}  # id(environment) -> its tools' images so far (see wrap)
        # Every tool a rollout may call: TRL hands later turns' parses no tools when the protocol hides them.
        self.names: set[str] = set()

    def reset_counts(self) -> None:
        self.calls_after_answer = self.context_stops = self.image_refusals = 0
        self.image_counts = {}

    def cut(self, ids: Sequence[int]) -> list[int]:
        """A generated turn ended where the protocol's stop string ends (PyVision: ``</code>``): the tokens up to
        the one that completes it; what was written after it is dropped (as a stop string in generation drops it:
        sampling after the stop does not change the tokens before it)."""
        ids = list(ids)
        stops = self.protocol.stop
        if not stops or not ids:
            return ids

        def stopped(n: int) -> bool:
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=False)
            return any(stop in text for stop in stops)

        if not stopped(len(ids)):
            return ids
        low, high = 1, len(ids)  # the shortest prefix that holds a stop string
        while low < high:
            middle = (low + high) // 2
            if stopped(middle):
                high = middle
            else:
                low = middle + 1
        return ids[:low]

    def ended(self, ids: Sequence[int]) -> bool:
        """The (cut) turn ended by itself: its end-of-turn token, or the protocol's stop string completed by its
        last token; not at a token budget."""
        ids = list(ids)
        if ids[-1:] == [self.tokenizer.eos_token_id]:
            return True
        if not self.protocol.stop or not ids:
            return False
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        before = self.tokenizer.decode(ids[:-1], skip_special_tokens=False)
        return any(stop in text and stop not in before for stop in self.protocol.stop)

    def tools_for(self, tools: dict[str, Any], environment: Any, prompt_images: int) -> dict[str, Any]:
        """One rollout's tools (name -> callable, TRL's per-rollout tool dict), in place: the hidden
        :data:`MALFORMED_CALL` tool added, every tool answering in the protocol's words within the image budget."""
        tools[MALFORMED_CALL] = malformed_call_tool(environment)
        counts = self.image_counts[id(environment)] = {"images": 0}
        for name, fn in list(tools.items()):
            tools[name] = self.wrap(fn, environment, prompt_images, counts)
        return tools

    def at_image_budget(self, environment: Any) -> bool:
        """The rollout of ``environment`` holds as many tool images as ``--max_tool_images`` allows: its next call
        is refused without running."""
        held = self.image_counts.get(id(environment), {}).get("images", 0)
        return self.max_tool_images is not None and held >= self.max_tool_images

    def reply_messages(self, tool_messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages rendered after a turn for its tool messages: the chat template's ``tool`` turns, or one
        user turn of the protocol's own words (``user_replies``: PyVision, DeepEyes)."""
        if not self.protocol.user_replies:
            return tool_messages
        content = self.protocol.join([message.get("content") for message in tool_messages])
        return [{"role": "user", "name": tool_messages[0].get("name"), "content": content}]

    def read(
        self, message: dict[str, Any], ids: Sequence[int], context: int, tools: Any, count: bool = True
    ) -> dict[str, Any]:
        """The assistant message for one turn (``ids``; ``context``: tokens before it), with the calls to run:
        none once the turn answers or the context budget is reached; the hidden tool for a malformed action or an
        unknown tool. ``count``: count calls after the answer and context stops (False: a reading ahead of TRL's)."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=not self.protocol.special_text)
        turn = self.protocol.parse(text, message)
        if turn.answered and count:
            self.calls_after_answer += len(self.protocol.parse(ANSWER.sub("", text), message).calls)
        calls = [malformed(turn.error)] if turn.error is not None else list(turn.calls)
        if calls and self.max_context_tokens is not None and context + len(ids) >= self.max_context_tokens:
            self.context_stops += count
            calls = []
        names = tool_names(tools) or self.names
        if names:
            calls = [self._known(call, names) for call in calls]
        out = {k: v for k, v in message.items() if k != "tool_calls"}
        out.setdefault("role", "assistant")
        if self.protocol.name != "hermes" or "content" not in out:
            out["content"] = text
        if calls:
            out["tool_calls"] = calls
        return out

    @staticmethod
    def _known(call: dict[str, Any], names: set[str]) -> dict[str, Any]:
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if name == MALFORMED_CALL or name in names:
            return call
        shown = ", ".join(sorted(names - {MALFORMED_CALL}))
        return malformed(f"there is no tool named {name!r}; the tools are: {shown}")

    def wrap(self, fn: Callable[..., Any], environment: Any, prompt_images: int, counts: dict[str, int]) -> Callable:
        """``fn`` (one rollout's tool) answering in the protocol's words, within the image budget. ``counts``:
        the rollout's images returned so far (shared by its tools)."""
        protocol = self.protocol
        limit = None if getattr(fn, "__name__", None) == MALFORMED_CALL else self.max_tool_images

        def tool(**arguments: Any) -> Any:
            env = environment if isinstance(environment, ToolEnvironment) else None
            if limit is not None and counts["images"] >= limit:
                self.image_refusals += 1
                if env is not None:
                    env.calls += 1
                    env.errors += 1
                return protocol.error(
                    f"this conversation already holds {counts['images']} tool images, the most allowed "
                    f"(--max_tool_images {limit}): answer with what you have",
                    malformed=False,
                )
            try:
                result = fn(**arguments)
            except Exception as exc:
                return protocol.error(str(exc), malformed=isinstance(exc, MalformedCall))
            first = first_index(result, env, prompt_images + counts["images"])  # before images are converted
            try:
                result = showable(result)
            except ToolError as exc:
                if env is not None:  # run_tool counted it a success
                    env.successes -= 1
                    env.errors += 1
                return protocol.error(str(exc), malformed=False)
            result = self._within_budget(result, counts)
            return protocol.reply(result, first)

        tool.__name__ = getattr(fn, "__name__", "tool")
        return tool

    def _within_budget(self, result: Any, counts: dict[str, int]) -> Any:
        images = images_of(result)
        room = len(images) if self.max_tool_images is None else max(0, self.max_tool_images - counts["images"])
        counts["images"] += min(room, len(images))
        if len(images) <= room:
            return result
        self.image_refusals += 1
        kept, out = 0, []
        for block in result:
            if isinstance(block, dict) and block.get("type") == "image":
                kept += 1
                if kept > room:
                    continue
            out.append(block)
        note = f"[{len(images) - room} more image(s) not shown: --max_tool_images {self.max_tool_images}]"
        return [*out, {"type": "text", "text": note}]


#: The most extreme aspect ratio an image may have (the Qwen processors refuse more than 200:1).
MAX_ASPECT = 200


def showable(result: Any) -> Any:
    """``result`` with its images as RGB PIL images the processor takes; a ToolError saying what is wrong with
    an image that is not one (not an image, unreadable, empty, too thin)."""
    if not isinstance(result, list) or not images_of(result):
        return result
    from PIL import Image

    out = []
    for block in result:
        if isinstance(block, dict) and block.get("type") == "image":
            image = block.get("image")
            if not isinstance(image, Image.Image):
                raise ToolError(f"the tool returned {type(image).__name__!s} where an image was expected")
            try:
                image.load()
                image = image if image.mode == "RGB" else image.convert("RGB")
            except Exception as exc:
                raise ToolError(f"the tool returned an image that cannot be decoded: {exc}") from None
            width, height = image.size
            if min(width, height) < 1 or max(width, height) / min(width, height) > MAX_ASPECT:
                raise ToolError(
                    f"the tool returned a {width}x{height} image: images need both sides >= 1 pixel and an aspect "
                    f"ratio up to {MAX_ASPECT}:1"
                )
            block = {**block, "image": image}
        out.append(block)
    return out


def first_index(result: Any, env: ToolEnvironment | None, default: int) -> int:
    """The conversation index of the first image a call returned: where the environment recorded it (a call may
    have run ahead of TRL's loop, see :func:`prefetch_tool_calls`), else ``default``."""
    images = images_of(result)
    if env is None or not images:
        return default
    found = [i for i, image in enumerate(env.images) if image is images[0]]
    return found[-1] if found else default


def tool_names(tools: Any) -> set[str]:
    """Names of the tools a rollout may call (callables, schema dicts or a name-keyed dict)."""
    if isinstance(tools, Mapping):
        return set(tools)
    names = set()
    for tool in tools or []:
        if isinstance(tool, str):
            name = tool
        elif isinstance(tool, dict):
            name = tool.get("function", tool).get("name")
        else:
            name = getattr(tool, "__name__", None)
        if name:
            names.add(name)
    return names


class ProtocolParser:
    """Stands in for the trainer's tokenizer (``trainer._tokenizer``) while TRL's tool loop runs.

    The loop parses every post-tool turn with ``trl.chat_template_utils.parse_response(trainer._tokenizer, ...)``.
    Here ``parse_response`` runs TRL's own ``parse_response`` on the real tokenizer (its fallback to text, its
    tool-call checks) and then the run's protocol (:meth:`ToolTurns.read`): its calls, a malformed action as a call
    of the hidden :data:`MALFORMED_CALL` tool, no calls after the answer. Everything else is the tokenizer's.
    """

    def __init__(self, tokenizer: Any, turns: ToolTurns) -> None:
        object.__setattr__(self, "_wrapped", tokenizer)
        object.__setattr__(self, "_turns", turns)

    def parse_response(self, response: Any, schema: Any = None, **kwargs: Any) -> Any:
        one_turn = isinstance(response, list) and all(isinstance(t, int) for t in response)
        if not one_turn or schema is not None or set(kwargs) - {"prefix", "tools"}:  # not the tool loop's call
            return self._wrapped.parse_response(response, schema, **kwargs)
        from trl.chat_template_utils import parse_response

        prefix, tools = kwargs.get("prefix"), kwargs.get("tools")
        parsed = parse_response(self._wrapped, response, prefix=prefix, tools=tools)
        return self._turns.read(parsed, response, len(prefix or []), tools)

    def __getattr__(self, name: str) -> Any:  # only for names the instance lacks: everything but _wrapped
        if name in ("_wrapped", "_turns"):
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._wrapped, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapped(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._wrapped)


@contextmanager
def parse_with_protocol(trainer: Any, turns: ToolTurns) -> Iterator[None]:
    """``trainer._tokenizer`` is a :class:`ProtocolParser` inside the block, the tokenizer again after it
    (exceptions included)."""
    tokenizer = trainer._tokenizer
    trainer._tokenizer = ProtocolParser(tokenizer, turns)
    try:
        yield
    finally:
        trainer._tokenizer = tokenizer
