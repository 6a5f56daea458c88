"""Agentic evaluation: the multi-turn tool loop of training, run greedily over a held-out set.

``vlm-grpo-eval --tools zoom_in --max_tool_calling_iterations 4 ...`` evaluates each row as a GRPO tool rollout,
with the training run's tool protocol (``--tool_protocol hermes|pyvision|deepeyes``) and the same code reading
each turn and wording each reply (:class:`~vlm_grpo.tools.rollouts.ToolTurns`): the prompt is rendered as
training renders it (``hermes``: the tools' schemas in the chat template's system prompt, in the order of
``--tools``; PyVision's and DeepEyes' prompts describe their tools themselves), the model writes a turn (ending at
the protocol's stop string: PyVision's ``</code>``), the protocol reads its calls, they run in the row's
:class:`~vlm_grpo.tools.ToolEnvironment` (the same tools, options and box frames as training), the replies --
images included -- are appended as training appends them, and the model writes the next turn. A rollout ends when
a turn calls no tool, when a turn gives the final answer (``</answer>``: calls after it are not run, and
counted), after ``max_tool_calling_iterations`` rounds of calls, or when the model has written
``max_new_tokens`` tokens over all its turns. Bad calls (unknown tool, wrong arguments, an action the protocol
cannot read, a tool that raises) are answered with an error the model reads, as in training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vlm_grpo.tools.base import MALFORMED_CALL
from vlm_grpo.tools.protocols import has_answer
from vlm_grpo.tools.rollouts import ProtocolParser, build_tool_environment, prepare_for_tools, tool_turns

logger = logging.getLogger("vlm_grpo")


@dataclass
class ToolRollout:
    """One evaluated rollout: the completion messages (as rewards receive them) and its counts."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    turns: int = 0
    images: int = 0
    calls_after_answer: int = 0
    generated_tokens: int = 0
    stop: str = ""

    def log(self) -> dict[str, Any]:
        """The per-sample log line: counts and the conversation, images shown as ``<image>``."""
        return {
            "turns": self.turns,
            "tool_calls": self.calls,
            "tool_errors": self.errors,
            "tool_images": self.images,
            "calls_after_answer": self.calls_after_answer,
            "generated_tokens": self.generated_tokens,
            "stop": self.stop,
            "conversation": [_loggable(m) for m in self.messages],
        }


def _loggable(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        content = [{"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p for p in content]
    out = {"role": message.get("role"), "content": content}
    for key in ("name", "tool_calls"):
        if message.get(key):
            out[key] = message[key]
    return out


def run_call(tools: dict[str, Any], call: dict[str, Any]) -> tuple[str, Any]:
    """One call as TRL's tool loop runs it: ``(name, tool message content)``; an exception is its ``error``."""
    if call.get("type") != "function":
        return str(call.get("name", "unknown")), str({"error": f"Unsupported tool call type: {call.get('type')}"})
    function = call["function"]
    name = function["name"]
    try:
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        result = tools[name](**function["arguments"])
    except Exception as exc:
        result = {"error": str(exc)}
    return name, result if isinstance(result, list) else str(result)


class ToolLoop:
    """The tool loop for one model: renders, generates greedily (or samples), reads each turn with the run's tool
    protocol and runs its calls."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        module: Any,
        tools: Sequence[str],
        tool_kwargs: Any = None,
        max_iterations: int | None = None,
        max_new_tokens: int = 256,
        sampling: dict[str, Any] | None = None,
        protocol: str | None = None,
    ) -> None:
        self.model, self.processor = model, processor
        self.tokenizer = getattr(processor, "tokenizer", processor)

        def coord_size(width: int, height: int) -> tuple[int, int]:
            return module.coord_size(processor, width, height)

        self.environment = build_tool_environment(list(tools), tool_kwargs, coord_size)
        self.tool_names = list(tools)
        settings = SimpleNamespace(generation_kwargs={}, share_prompt=False)
        prepare_for_tools(settings, processor)  # the tool chat template, the response parser, no image tokens
        self.suppress = settings.generation_kwargs.get("suppress_tokens")
        self.turns = tool_turns([], self.environment, processor, protocol)
        self.turns.names = {*self.tool_names, MALFORMED_CALL}
        self.parser = ProtocolParser(self.tokenizer, self.turns)
        self.max_iterations = max_iterations
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or {}

    @property
    def protocol(self) -> str:
        return self.turns.protocol.name

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]], tools: list[Any] | None, generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _start(self, row: dict[str, Any]) -> tuple[Any, list[Any], dict[str, Any], list[Any], str]:
        """A rollout of ``row`` begins: its environment, the tools shown (none where the protocol's prompt
        describes them), its tools (wrapped as in training), its images and the rendered prompt."""
        env = self.environment()
        env.reset(**row)
        images = list(row.get("images") or [])
        shown = [getattr(env, name) for name in self.tool_names] if self.turns.protocol.show_tools else []
        tools = self.turns.tools_for({name: getattr(env, name) for name in self.tool_names}, env, len(images))
        return env, shown, tools, images, self._render(list(row["prompt"]), shown, generation_prompt=True)

    def _tool_suffix(self, replies: list[dict[str, Any]]) -> str:
        """The text the chat template puts after a turn's end for these tool replies (as the protocol renders
        them), up to the next turn's start (TRL's ``_get_tool_suffix_ids``, in text)."""
        call = [{"type": "function", "function": {"name": replies[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        prefix = self._render(dummy, None, generation_prompt=False)
        full = self._render(dummy + self.turns.reply_messages(replies), None, generation_prompt=True)
        eos = self.tokenizer.eos_token
        cut = prefix.rfind(eos) + len(eos) if eos and eos in prefix else len(prefix)
        return full[cut:]

    # ------------------------------------------------------------------ one rollout
    def _generate(self, text: str, images: list[Any], budget: int) -> list[int]:
        import torch

        inputs = self.processor(text=[text], images=images or None, return_tensors="pt").to(self.model.device)
        kwargs: dict[str, Any] = {"max_new_tokens": budget, "pad_token_id": self.tokenizer.pad_token_id}
        if self.suppress:
            kwargs["suppress_tokens"] = self.suppress
        if self.sampling:
            kwargs.update(do_sample=True, **self.sampling)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            output = self.model.generate(**inputs, **kwargs)
        ids = output[0, inputs["input_ids"].shape[1] :].tolist()
        pad = self.tokenizer.pad_token_id
        if pad is not None and pad != self.tokenizer.eos_token_id:
            ids = [t for t in ids if t != pad]
        return self.turns.cut(ids)  # the turn ends at the protocol's stop string, as in training

    def _parse(self, ids: list[int], context: str, shown: list[Any]) -> dict[str, Any]:
        """A turn's ids as the message training makes of it: TRL's ``parse_response`` (``context``: the text
        before the turn), then the protocol (:class:`~vlm_grpo.tools.rollouts.ProtocolParser`)."""
        prefix = self.tokenizer(context, add_special_tokens=False)["input_ids"]
        message = self.parser.parse_response(list(ids), prefix=prefix, tools=shown)
        if not isinstance(message, dict):
            message = {"role": "assistant", "content": str(message)}
        message.setdefault("role", "assistant")
        return message

    def run_calls(self, env: Any, tools: dict[str, Any], calls: list[Any], images: list[Any]) -> list[dict]:
        """Run one turn's calls in order, as TRL's loop runs them: the tool messages (an error the model reads
        for a bad call); the images they return are appended to ``images``."""
        replies = []
        for call in calls:
            name, content = run_call(tools, call)
            for part in content if isinstance(content, list) else []:
                if isinstance(part, dict) and part.get("type") == "image":
                    images.append(part["image"])
            replies.append({"role": "tool", "name": name, "content": content})
        return replies

    def replay(self, row: dict[str, Any], turns: Sequence[str]) -> list[tuple[str, list[Any], bool]]:
        """A scripted rollout of ``row``: the model's ``turns`` (text), with the calls each one writes run by the
        tools. Returns the rollout as segments ``(text, images, written_by_the_model)`` in the order the loop
        builds them: the rendered prompt, each turn (ending with the end-of-turn token, or cut at the protocol's
        stop string), each tool reply suffix. Supervised fine-tuning on these segments trains exactly the tokens
        the loop shows and samples."""
        env, shown, tools, images, text = self._start(row)
        try:
            return self._replay(env, shown, tools, images, text, turns)
        finally:
            env._close_state()  # the rollout's interpreter goes back now, not when the environment is collected

    def _replay(self, env: Any, shown: list[Any], tools: dict[str, Any], images: list[Any], text: str,
                turns: Sequence[str]) -> list[tuple[str, list[Any], bool]]:  # fmt: skip
        segments = [(text, images, False)]
        eos = self.tokenizer.eos_token
        for i, turn in enumerate(turns):
            ids = self.turns.cut(self.tokenizer(turn + eos, add_special_tokens=False)["input_ids"])
            written = self.tokenizer.decode(ids, skip_special_tokens=False)
            segments.append((written, [], True))
            if i == len(turns) - 1:
                break
            message = self._parse(ids, "".join(t for t, _, _ in segments[:-1]), shown)
            calls = list(message.get("tool_calls") or [])
            if not calls:
                raise ValueError(f"turn {i} of a scripted rollout calls no tool but is followed by more turns")
            new_images: list[Any] = []
            replies = self.run_calls(env, tools, calls, new_images)
            segments.append((self._tool_suffix(replies), new_images, False))
        return segments

    def run(self, row: dict[str, Any]) -> ToolRollout:
        """One rollout of ``row`` (a dataset row: ``prompt``, ``images``, ``coord_sizes``, ...)."""
        env, shown, tools, images, text = self._start(row)
        try:
            return self._run(row, env, shown, tools, images, text)
        finally:
            env._close_state()

    def _run(self, row: dict[str, Any], env: Any, shown: list[Any], tools: dict[str, Any], images: list[Any],
             text: str) -> ToolRollout:  # fmt: skip
        self.turns.reset_counts()
        out = ToolRollout()
        rounds = 0
        while True:
            budget = self.max_new_tokens - out.generated_tokens
            ids = self._generate(text, images, budget)
            out.generated_tokens += len(ids)
            out.turns += 1
            message = self._parse(ids, text, shown)
            calls = list(message.get("tool_calls") or [])
            out.messages.append(message)
            if has_answer(self.tokenizer.decode(ids, skip_special_tokens=True)):
                out.calls_after_answer = self.turns.calls_after_answer
                out.stop = "answer"
                break
            if not calls:
                out.stop = "no_call"
                break
            if self.max_iterations is not None and rounds >= self.max_iterations:
                out.stop = "max_tool_calling_iterations"
                break
            if out.generated_tokens >= self.max_new_tokens or not self.turns.ended(ids):
                out.stop = "max_new_tokens"
                break
            rounds += 1
            replies = self.run_calls(env, tools, calls, images)
            out.messages.extend(replies)
            text = text + self.tokenizer.decode(ids, skip_special_tokens=False) + self._tool_suffix(replies)
        out.calls, out.errors = env.calls, env.errors
        out.images = len(images) - len(row.get("images") or [])
        return out
