"""Agentic evaluation: the multi-turn tool loop of training, run greedily over a held-out set.

``vlm-grpo-eval --tools zoom_in --max_tool_calling_iterations 4 ...`` evaluates each row as a GRPO tool rollout:
the prompt is rendered with the tools' schemas (the chat template's tool system prompt, the order of
``--tools``), the model writes a turn, its ``<tool_call>`` blocks are parsed by TRL's ``parse_response`` and run
in the row's :class:`~vlm_grpo.tools.ToolEnvironment` (the same tools, options and box frames as training), the
replies -- images included -- are appended with the chat template's tool turn, and the model writes the next
turn. A rollout ends when a turn calls no tool, when a turn gives the final answer (``</answer>``: calls after it
are not run, and counted), after ``max_tool_calling_iterations`` rounds of calls, or when the model has written
``max_new_tokens`` tokens over all its turns. Bad calls (unknown tool, wrong arguments, unreadable
``<tool_call>`` JSON, a tool that raises) are answered with an error the model reads, as in training.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vlm_grpo.tools import ToolError
from vlm_grpo.tools.base import MALFORMED_CALL
from vlm_grpo.tools.protocols import HERMES_MALFORMED
from vlm_grpo.tools.rollouts import MalformedCall, build_tool_environment, malformed, prepare_for_tools

logger = logging.getLogger("vlm_grpo")

ANSWER_END = "</answer>"


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


class ToolLoop:
    """The tool loop for one model: renders, generates greedily (or samples), runs the calls."""

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
        self.max_iterations = max_iterations
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling or {}

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[dict[str, Any]], tools: list[Any], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def _tool_suffix(self, replies: list[dict[str, Any]], tools: list[Any]) -> str:
        """The text the chat template puts after a turn's end for these tool replies, up to the next turn's start
        (TRL's ``_get_tool_suffix_ids``, in text)."""
        call = [{"type": "function", "function": {"name": replies[0]["name"], "arguments": {}}}]
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        prefix = self._render(dummy, tools, generation_prompt=False)
        full = self._render(dummy + replies, tools, generation_prompt=True)
        eos = self.tokenizer.eos_token
        cut = prefix.rfind(eos) + len(eos) if eos and eos in prefix else len(prefix)
        return full[cut:]

    # ------------------------------------------------------------------ one rollout
    def _generate(self, text: str, images: list[Any], budget: int) -> tuple[list[int], str]:
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
        return ids, self.tokenizer.decode(ids, skip_special_tokens=False)

    def _parse(self, ids: list[int], context: str, tools: list[Any]) -> dict[str, Any]:
        """A turn's ids as a message, parsed as TRL's loop parses it (``prefix``: the context before the turn);
        a ``<tool_call>`` that does not parse becomes a call answered with an error."""
        from trl.chat_template_utils import parse_response

        prefix = self.tokenizer(context, add_special_tokens=False)["input_ids"]
        message = parse_response(self.tokenizer, ids, prefix=prefix, tools=tools)
        if not isinstance(message, dict):
            message = {"role": "assistant", "content": str(message)}
        message.setdefault("role", "assistant")
        content = message.get("content")
        if not message.get("tool_calls") and isinstance(content, str) and "<tool_call>" in content:
            message["tool_calls"] = [malformed(HERMES_MALFORMED)]  # answered with the error, as in training
        return message

    def _call(self, env: Any, call: Any) -> Any:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ToolError(f"unsupported tool call {call!r}")
        name, arguments = function.get("name"), function.get("arguments") or {}
        if name not in self.tool_names:
            raise ToolError(f"unknown tool {name!r}: the tools are {', '.join(self.tool_names)}")
        if not isinstance(arguments, dict):
            raise ToolError(f"the arguments of {name} must be a JSON object, got {arguments!r}")
        return getattr(env, name)(**arguments)

    def run_calls(self, env: Any, calls: list[Any], images: list[Any], out: ToolRollout) -> list[dict[str, Any]]:
        """Run one turn's calls in order: the tool messages (an error the model reads for a bad call); the images
        they return are appended to ``images``."""
        replies = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            name = str((function or {}).get("name", "unknown"))
            out.calls += 1
            try:
                if name == MALFORMED_CALL:
                    raise MalformedCall(call["function"]["arguments"].get("message", HERMES_MALFORMED))
                result = self._call(env, call)
            except Exception as exc:  # the model reads the error, as in TRL's loop
                out.errors += 1
                result = {"error": str(exc)}
            result = result if isinstance(result, list) else str(result)
            for part in result if isinstance(result, list) else []:
                if isinstance(part, dict) and part.get("type") == "image":
                    images.append(part["image"])
                    out.images += 1
            replies.append({"role": "tool", "name": name, "content": result})
        return replies

    def replay(self, row: dict[str, Any], turns: Sequence[str]) -> list[tuple[str, list[Any], bool]]:
        """A scripted rollout of ``row``: the model's ``turns`` (text), with the calls each one writes run by the
        tools. Returns the rollout as segments ``(text, images, written_by_the_model)`` in the order the loop
        builds them: the rendered prompt, each turn (ending with the end-of-turn token), each tool reply suffix.
        Supervised fine-tuning on these segments trains exactly the tokens the loop shows and samples."""
        env = self.environment()
        env.reset(**row)
        tools = [getattr(env, name) for name in self.tool_names]
        images = list(row.get("images") or [])
        segments = [(self._render(list(row["prompt"]), tools, generation_prompt=True), images, False)]
        out = ToolRollout()
        eos = self.tokenizer.eos_token
        for i, turn in enumerate(turns):
            segments.append((turn + eos, [], True))
            if i == len(turns) - 1:
                break
            ids = self.tokenizer(turn + eos, add_special_tokens=False)["input_ids"]
            message = self._parse(ids, "".join(text for text, _, _ in segments[:-1]), tools)
            calls = list(message.get("tool_calls") or [])
            if not calls:
                raise ValueError(f"turn {i} of a scripted rollout calls no tool but is followed by more turns")
            new_images: list[Any] = []
            replies = self.run_calls(env, calls, new_images, out)
            segments.append((self._tool_suffix(replies, tools), new_images, False))
        return segments

    def run(self, row: dict[str, Any]) -> ToolRollout:
        """One rollout of ``row`` (a dataset row: ``prompt``, ``images``, ``coord_sizes``, ...)."""
        env = self.environment()
        env.reset(**row)
        tools = [getattr(env, name) for name in self.tool_names]
        images = list(row.get("images") or [])
        text = self._render(list(row["prompt"]), tools, generation_prompt=True)
        out = ToolRollout()
        rounds = 0
        while True:
            budget = self.max_new_tokens - out.generated_tokens
            ids, generated = self._generate(text, images, budget)
            out.generated_tokens += len(ids)
            out.turns += 1
            message = self._parse(ids, text, tools)
            calls = list(message.get("tool_calls") or [])
            out.messages.append(message)
            content = message.get("content") if isinstance(message.get("content"), str) else ""
            if ANSWER_END in content or ANSWER_END in str(message.get("reasoning_content") or ""):
                out.calls_after_answer += len(calls)
                out.stop = "answer"
                break
            if not calls:
                out.stop = "no_call"
                break
            if self.max_iterations is not None and rounds >= self.max_iterations:
                out.stop = "max_tool_calling_iterations"
                break
            if out.generated_tokens >= self.max_new_tokens or ids[-1:] != [self.tokenizer.eos_token_id]:
                out.stop = "max_new_tokens"
                break
            rounds += 1
            replies = self.run_calls(env, calls, images, out)
            out.messages.extend(replies)
            text = text + generated + self._tool_suffix(replies, tools)
        return out
