"""Tool protocols: how a model writes a tool call, and how the reply it reads back looks (``--tool_protocol``).

A checkpoint trained on one protocol only calls tools in that syntax and expects the replies it was trained on:

* ``hermes`` (the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5 / Qwen3 /
  Hermes), any number a turn; replies are ``tool`` turns rendered by the chat template (``<tool_response>``
  blocks of one user turn), the tool schemas are in the system prompt. A family with its own call format writes
  that instead: GLM-4.5V ``<tool_call>NAME`` with ``<arg_key>``/``<arg_value>`` pairs, Mistral 3 (a tokenizer with
  Mistral's tool tokens) ``[TOOL_CALLS]NAME[ARGS]{...}`` (v7 tokenizers: ``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}]``) with ``[TOOL_RESULTS]...[/TOOL_RESULTS]`` replies.
* ``pyvision`` (PyVision): Python in ``<code>```python ... ```</code>``, or a bare ```` ```python ```` fence, or
  ``<code>...</code>``; the last block of the turn runs in the ``python`` tool. As in PyVision (its stop string
  ``</code>``), a turn ends at the first ``</code>``: what the model writes after it is cut off, neither kept nor
  run, and the interpreter's reply follows at once. The reply is a user turn
  ``<tool_response>\\n<interpreter>...</interpreter>\\n\\n</tool_response>`` holding ``Text Result:`` and
  ``Image Result:`` with each image between ``<image_clue_i>`` tags (``i``: its index in the conversation,
  the name it has in later cells). A turn with neither code nor answer is told so and the rollout goes on.
* ``deepeyes`` (DeepEyes), in the version of DeepEyes' tool box set by ``image_zoom_in_tool``'s ``version``
  option (``v2``, the default: what DeepEyes' README training uses; or ``v5``):

  - ``v2``: the last ``<tool_call>`` JSON block of the turn is run; the reply is a user turn ``<tool_response>`` +
    the image + ``USER_PROMPT_V2`` + ``</tool_response>``;
  - ``v5``: the first three ``<tool_call>`` blocks are run; the reply is a user turn with
    ``<tool_response>\n`` + image + ``\n</tool_response>\n`` per image, then ``TURN_PROMPT_V5``.

  An error is a user turn ``Error: ...``. A turn with no call and no answer ends the rollout.

In every protocol a turn holding ``<answer>...</answer>`` ends the rollout: its tool calls are not run. PyVision's
and DeepEyes' prompts describe their tools themselves (their datasets carry them), so with those protocols the
chat template shows no tool schemas.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from vlm_grpo.registry import Registry
from vlm_grpo.tools.templates import mistral_tools

#: The help of ``--tool_protocol`` (training, SFT and evaluation share the flag).
TOOL_PROTOCOL_HELP = (
    "How the model calls tools and reads their replies: 'hermes' (<tool_call> JSON, <tool_response> replies, tool "
    "schemas in the system prompt; GLM and Mistral 3 in their own call formats), 'pyvision' (```python / <code> "
    "blocks run in the python tool, <interpreter> replies; a turn ends at </code>) or 'deepeyes' (DeepEyes' "
    "<tool_call> and reply text, in the version set by image_zoom_in_tool's 'version' option: v2, the default, or "
    "v5). Default: the protocol the tools name (a plugin tool's 'protocol' attribute), else hermes. A turn with "
    "<answer>...</answer> always ends the rollout; its tool calls are not run."
)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED_CODE = re.compile(r"<code>\s*```python\s*(.*?)\s*```\s*</code>", re.DOTALL)
_PYTHON_FENCE = re.compile(r"```python\s*(.*?)\s*```", re.DOTALL)
_BARE_CODE = re.compile(r"<code>\s*(.*?)\s*</code>", re.DOTALL)
# The python tool's own note of the images a cell showed (the protocol numbers them itself).
_INTERPRETER = "<tool_response>\n<interpreter>{}</interpreter>\n\n</tool_response>"
_SHOWN_NOTE = re.compile(r"\n?\[\d+ image\(s\) shown: (?:image_clue_\d+(?:, )?)+\]$")

#: DeepEyes' instruction after a zoomed view (its ``USER_PROMPT_V2``).
DEEPEYES_USER_PROMPT = (
    "\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  <think>...</think>  "
    "<tool_call>...</tool_call> (if tools needed)  <answer>...</answer> "
)
#: DeepEyes' instruction after the tool responses of a turn, tool box v5 (its ``TURN_PROMPT_V5``).
DEEPEYES_TURN_PROMPT_V5 = (
    "\nThink in the mind first, and then decide whether to call tools one or more times OR provide final answer. "
    "Format strictly as: <think>...</think> <tool_call>...</tool_call> <tool_call>...</tool_call> "
    "(if any tools needed) OR <answer>...</answer> (if no tools needed)."
)
#: DeepEyes' tool box versions: ``v2`` (the default, what its README training uses) and ``v5``.
DEEPEYES_VERSIONS = ("v2", "v5")
#: The most calls a v5 turn runs (DeepEyes' ``max_action_per_turn``).
DEEPEYES_V5_CALLS = 3
#: What the model reads after a ``<tool_call>`` block that does not parse (``hermes``).
HERMES_MALFORMED = (
    'the <tool_call> block could not be read: write <tool_call>{"name": "<tool name>", "arguments": {...}}'
    "</tool_call> with valid JSON"
)
#: What the model reads after a ``[TOOL_CALLS]`` call that does not parse (``hermes`` with Mistral's v11+ tokens).
MISTRAL_MALFORMED = (
    'the [TOOL_CALLS] call could not be read: write [TOOL_CALLS]<tool name>[ARGS]{"<argument>": <value>, ...} '
    "with the arguments as one JSON object"
)
#: The same for Mistral's v7 tokens (no ``[ARGS]``: the calls are one JSON list).
MISTRAL_V7_MALFORMED = (
    'the [TOOL_CALLS] calls could not be read: write [TOOL_CALLS][{"name": "<tool name>", "arguments": {...}}] '
    "with valid JSON"
)
#: PyVision's message for a turn with neither code nor a final answer.
PYVISION_NO_CODE = "No Python code or final answer found. There is something wrong with the format."


@dataclass
class ParsedTurn:
    """What one assistant turn asks for: tool calls (TRL's ``tool_calls`` form), or a malformed action (the
    message the model reads back), and whether the turn gave the final answer (then nothing is run)."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    answered: bool = False


def function_call(name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def has_answer(text: str) -> bool:
    """The turn gives a final answer (a closed ``<answer>`` tag)."""
    return ANSWER.search(text) is not None


def text_of(result: Any) -> str:
    """The text blocks of a tool result (a string, or a list of content blocks), joined."""
    if isinstance(result, list):
        return "".join(str(b.get("text", "")) for b in result if isinstance(b, dict) and b.get("type") == "text")
    return "" if result is None else str(result)


def images_of(result: Any) -> list[Any]:
    if not isinstance(result, list):
        return []
    return [b["image"] for b in result if isinstance(b, dict) and b.get("type") == "image"]


class ToolProtocol:
    """One protocol: parse a turn (:meth:`parse`) and word the replies (:meth:`reply`, :meth:`error`).

    ``show_tools``: the chat template renders the tool schemas in the system prompt. ``user_replies``: replies are
    rendered as one user turn of the protocol's own text (:meth:`join`; else as the chat template's ``tool`` turns,
    and errors as TRL words them). ``tool_names``: the tools the protocol calls by itself (``pyvision``:
    ``python``). ``stop``: strings that end a turn (the turn is cut after the first one, see
    :meth:`~vlm_grpo.tools.rollouts.ToolTurns.cut`). ``special_text``: :meth:`parse` reads the turn with the
    tokenizer's special tokens (Mistral's ``[TOOL_CALLS]`` is one).
    """

    name = ""
    show_tools = True
    user_replies = False
    special_text = False
    tool_names: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()

    def configured(self, options: dict[str, dict[str, Any]]) -> ToolProtocol:
        """The protocol for a run whose tools have these ``--tool_kwargs`` options (a protocol version a tool
        option picks); by default itself."""
        return self

    def for_vocab(self, vocab: dict[str, int]) -> ToolProtocol:
        """The protocol for a tokenizer with this vocabulary (a family's own call format); by default itself."""
        return self

    def join(self, contents: list[Any]) -> list[dict[str, Any]]:
        """The user turn holding a turn's replies (``user_replies``): their content blocks in order."""
        out: list[dict[str, Any]] = []
        for content in contents:
            out += content if isinstance(content, list) else [{"type": "text", "text": str(content)}]
        return out

    def parse(self, text: str, message: dict[str, Any] | None = None) -> ParsedTurn:
        """``text``: the turn as decoded; ``message``: TRL's parse of it (its ``tool_calls``), where it has one."""
        raise NotImplementedError

    def reply(self, result: Any, first_image: int) -> Any:
        """The tool message content for a successful call; ``first_image``: the conversation index of the first
        image the call returned."""
        return result

    def error(self, message: str, malformed: bool) -> Any:
        """The tool message content for a failed call (``malformed``: the action could not be read)."""
        raise NotImplementedError


@dataclass(frozen=True)
class CallFormat:
    """How the chat template writes a call: the marker that opens one, what the model reads back for a call that does
    not parse, and whether the marker is a special token (then the turn is read with its special tokens)."""

    marker: str
    malformed: str
    special: bool = False


HERMES_CALLS = CallFormat("<tool_call>", HERMES_MALFORMED)
MISTRAL_CALLS = CallFormat("[TOOL_CALLS]", MISTRAL_MALFORMED, special=True)
MISTRAL_V7_CALLS = CallFormat("[TOOL_CALLS]", MISTRAL_V7_MALFORMED, special=True)
_CALL_FORMATS = {None: HERMES_CALLS, "v11": MISTRAL_CALLS, "v7": MISTRAL_V7_CALLS}


class HermesProtocol(ToolProtocol):
    """The chat template's own call format, read by TRL's response template: ``<tool_call>`` blocks (Qwen, GLM's
    ``<tool_call>NAME<arg_key>...``), or Mistral's ``[TOOL_CALLS]`` calls where the tokenizer has Mistral's tool
    tokens (:meth:`for_vocab`: v11's ``[TOOL_CALLS]NAME[ARGS]{...}``, v7's ``[TOOL_CALLS][{...}, ...]``)."""

    name = "hermes"

    def __init__(self, calls: CallFormat = HERMES_CALLS) -> None:
        self.calls = calls
        self.special_text = calls.special

    def for_vocab(self, vocab: dict[str, int]) -> ToolProtocol:
        calls = _CALL_FORMATS[mistral_tools(vocab)]
        return self if calls == self.calls else HermesProtocol(calls)

    def parse(self, text: str, message: dict[str, Any] | None = None) -> ParsedTurn:
        answered = has_answer(text)
        calls = list((message or {}).get("tool_calls") or [])
        if answered:
            return ParsedTurn(answered=True)
        if not calls and self.calls.marker in text:
            return ParsedTurn(error=self.calls.malformed)
        # Mistral v7's calls come as the JSON list's {"name", "arguments"} entries
        calls = [c if "function" in c else function_call(c["name"], c["arguments"]) for c in calls]
        return ParsedTurn(calls=calls)

    def error(self, message: str, malformed: bool) -> Any:
        raise ValueError(message)  # TRL's loop words it: {'error': '...'}


class DeepEyesProtocol(ToolProtocol):
    name = "deepeyes"
    show_tools = False
    user_replies = True

    def __init__(self, version: str = "v2") -> None:
        if version not in DEEPEYES_VERSIONS:
            raise ValueError(f"DeepEyes version must be one of {', '.join(DEEPEYES_VERSIONS)}, got {version!r}")
        self.version = version

    def configured(self, options: dict[str, dict[str, Any]]) -> ToolProtocol:
        version = (options.get("image_zoom_in_tool") or {}).get("version", "v2")
        return self if version == self.version else DeepEyesProtocol(version)

    def parse(self, text: str, message: dict[str, Any] | None = None) -> ParsedTurn:
        if has_answer(text):
            return ParsedTurn(answered=True)
        blocks = [b.strip() for b in _TOOL_CALL.findall(text)]
        if not blocks:
            return ParsedTurn()
        if self.version == "v2":
            return self._read(blocks[-1], wording=True)
        calls = []
        for action in blocks[:DEEPEYES_V5_CALLS]:  # v5: any block that does not read fails the turn
            turn = self._read(action, wording=False)
            if turn.error is not None:
                return turn
            calls += turn.calls
        return ParsedTurn(calls=calls)

    @staticmethod
    def _read(action: str, wording: bool) -> ParsedTurn:
        """One block as a call; ``wording``: v2's ``Invalid tool call format`` message for JSON that does not
        parse (v5 answers with the exception alone)."""
        try:
            call = json.loads(action)
        except Exception as exc:  # whatever the model wrote: the model reads why
            return ParsedTurn(error=f"Invalid tool call format: {action}. Error: {exc}" if wording else str(exc))
        try:
            name, arguments = call["name"], call["arguments"]
        except Exception as exc:
            return ParsedTurn(error=str(exc))
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return ParsedTurn(
                error=f"Invalid tool call format: {action}. Error: name must be a string, arguments an object"
            )
        return ParsedTurn(calls=[function_call(name, arguments)])

    def reply(self, result: Any, first_image: int) -> Any:
        images = images_of(result)
        if self.version == "v5":
            if not images:
                return [{"type": "text", "text": f"<tool_response>\n{text_of(result)}\n</tool_response>\n"}]
            out: list[dict[str, Any]] = []
            for image in images:
                out += [{"type": "text", "text": "<tool_response>\n"}, {"type": "image", "image": image}]
                out.append({"type": "text", "text": "\n</tool_response>\n"})
            return out
        if not images:
            return [{"type": "text", "text": f"<tool_response>{text_of(result)}{DEEPEYES_USER_PROMPT}</tool_response>"}]
        return [
            {"type": "text", "text": "<tool_response>"},
            *({"type": "image", "image": image} for image in images),
            {"type": "text", "text": f"{DEEPEYES_USER_PROMPT}</tool_response>"},
        ]

    def error(self, message: str, malformed: bool) -> Any:
        return [{"type": "text", "text": f"Error: {message}"}]

    def join(self, contents: list[Any]) -> list[dict[str, Any]]:
        """v5: the turn prompt once, after the turn's tool responses."""
        out = super().join(contents)
        if self.version == "v5" and any(b.get("text", "").startswith("<tool_response>") for b in out):
            out.append({"type": "text", "text": DEEPEYES_TURN_PROMPT_V5})
        return out


class PyVisionProtocol(ToolProtocol):
    name = "pyvision"
    show_tools = False
    user_replies = True
    tool_names = ("python",)
    stop = ("</code>",)

    def parse(self, text: str, message: dict[str, Any] | None = None) -> ParsedTurn:
        if has_answer(text):
            return ParsedTurn(answered=True)
        for pattern in (_FENCED_CODE, _PYTHON_FENCE, _BARE_CODE):
            blocks = pattern.findall(text)
            if blocks:
                return ParsedTurn(calls=[function_call("python", {"code": blocks[-1]})])
        return ParsedTurn(error=PYVISION_NO_CODE)

    def reply(self, result: Any, first_image: int) -> Any:
        text = _SHOWN_NOTE.sub("", text_of(result)).strip()  # PyVision strips the printed text
        text = "" if text == "(no output)" else text
        images = images_of(result)
        if not images:
            return [
                {
                    "type": "text",
                    "text": _INTERPRETER.format(f"\nText Result:\n{text}"),
                }
            ]
        head = "<tool_response>\n<interpreter>" + (f"Text Result:\n{text}\n" if text else "") + "Image Result:\n"
        content: list[dict[str, Any]] = [{"type": "text", "text": head}]
        for k, image in enumerate(images, start=first_image):
            content += [
                {"type": "text", "text": f"<image_clue_{k}>"},
                {"type": "image", "image": image},
                {"type": "text", "text": f"</image_clue_{k}>"},
            ]
        content.append({"type": "text", "text": "</interpreter>\n\n</tool_response>"})
        return content

    def error(self, message: str, malformed: bool) -> Any:
        what = "Error" if malformed else "Execution error"
        return [
            {
                "type": "text",
                "text": _INTERPRETER.format(f"{what}: {message}"),
            }
        ]


PROTOCOLS: Registry[ToolProtocol] = Registry("tool protocol", entry_point_group="vlm_grpo.tool_protocols")
PROTOCOLS.register("hermes", HermesProtocol())
PROTOCOLS.register("pyvision", PyVisionProtocol())
PROTOCOLS.register("deepeyes", DeepEyesProtocol())


def resolve_protocol(name: str | None, tools: list[Any] | tuple[Any, ...] = ()) -> ToolProtocol:
    """The protocol named by ``--tool_protocol``; unset, the one the tools name (a tool function's ``protocol``
    attribute, e.g. a plugin's), else ``hermes``."""
    if name:
        return PROTOCOLS.get(name)
    named = {getattr(t, "protocol", None) for t in tools} - {None}
    if len(named) > 1:
        raise ValueError(
            f"The tools ask for different protocols ({', '.join(sorted(named))}): pick one with --tool_protocol"
        )
    return PROTOCOLS.get(named.pop() if named else "hermes")
