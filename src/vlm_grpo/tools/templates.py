"""A tool-capable chat template for checkpoints whose own template cannot render tools, and how TRL reads the calls.

Qwen2-VL's and Qwen2.5-VL's released templates (and InternVL ``-hf``, Gemma 3 and Mistral-Small-3.1 ones) render
no tools, tool calls or tool results, so TRL refuses them for tool runs. This one renders messages with the family's
turns and image placeholders (and, for Qwen, the default system prompt) and adds Qwen2.5's tool format: the
schemas in the system turn, ``<tool_call>`` blocks in assistant turns, results as ``<tool_response>`` blocks
of one user turn (their images rendered with the family's placeholder). GLM and Mistral 3 get their own tool
formats instead (:func:`glm_tool_template`, :func:`mistral_tool_template`). Each is prefix-preserving, as TRL's
tool loop needs.
"""

from __future__ import annotations

from dataclasses import dataclass

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
QWEN_SYSTEM = "You are a helpful assistant."
INTERNVL_IMAGE = "<IMG_CONTEXT>\n"
INTERNVL_VIDEO = "<video>\n"
# Gemma 3 and Mistral 3 take no videos: a video item renders the image placeholder, which their processors then
# refuse (one more placeholder than images) instead of dropping the video unseen.
GEMMA3_IMAGE = "<start_of_image>"
PIXTRAL_IMAGE = "[IMG]"
LLAVA_IMAGE = "<image>\n"  # LLaVA-OneVision: its Qwen2 turns, the placeholder on a line of its own
LLAVA_VIDEO = "<video>\n"

_TOOLS_HEADER = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call>"
)


@dataclass(frozen=True)
class Turns:
    """A family's turn markers, as Jinja expressions of the variable ``role`` (system, user or assistant).

    ``close`` of the assistant's turn is generated (inside ``{% generation %}``); ``after`` follows it outside.
    """

    open: str
    close: str
    after: str = "''"
    start: str = "''"  # written once, first (e.g. bos_token)
    prompt: str = "''"  # the generation prompt


QWEN_TURNS = Turns(
    open="'<|im_start|>' + role + '\\n'",
    close="'<|im_end|>' if role == 'assistant' else '<|im_end|>\\n'",
    after="'\\n'",
    prompt="'<|im_start|>assistant\\n'",
)
# Gemma's turns (its templates write the assistant's turns as "model"); Gemma 3's own template renders no tools.
GEMMA_TURNS = Turns(
    open="'<start_of_turn>' + ('model' if role == 'assistant' else role) + '\\n'",
    close="'<end_of_turn>' if role == 'assistant' else '<end_of_turn>\\n'",
    after="'\\n'",
    start="bos_token",
    prompt="'<start_of_turn>model\\n'",
)
# Mistral-Small-3.1's turns: no generation prompt, the answer follows [/INST] and ends with </s>.
MISTRAL_TURNS = Turns(
    open="{'system': '[SYSTEM_PROMPT]', 'user': '[INST]'}.get(role, '')",
    close="{'system': '[/SYSTEM_PROMPT]', 'user': '[/INST]'}.get(role, eos_token)",
    start="bos_token",
)


def _render_macro(image: str, video: str | None = None) -> str:
    """The templates' ``render(content)`` macro: a message's text, ``image`` (a Jinja expression) for each of its
    images and ``video`` for each video (None: videos are not rendered)."""
    media = "{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}{{- " + image + " -}}"
    if video is not None:
        media += "{%- elif item.type == 'video' or 'video' in item -%}{{- " + video + " -}}"
    return (
        "{%- macro render(content) -%}"
        "{%- if content is string -%}{{- content -}}"
        "{%- else -%}{%- for item in content -%}" + media + "{%- elif 'text' in item -%}{{- item['text'] -}}"
        "{%- endif -%}"
        "{%- endfor -%}{%- endif -%}"
        "{%- endmacro -%}"
    )


def tool_chat_template(image: str, video: str, default_system: str | None, turns: Turns = QWEN_TURNS) -> str:
    """The template, with the family's image / video placeholders, default system prompt (None: none) and turns."""
    default = "" if default_system is None else default_system
    return (
        (
            "{%- macro open(role) -%}{{- __OPEN__ -}}{%- endmacro -%}"
            "{%- macro close(role) -%}{{- __CLOSE__ -}}{%- endmacro -%}"
            + _render_macro("IMAGE", "VIDEO")
            + "{{- __START__ -}}"
            "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
            "{%- if tools -%}"
            "{{- open('system') -}}"
            "{%- if has_system -%}{{- render(messages[0]['content']) -}}{%- else -%}{{- DEFAULT -}}{%- endif -%}"
            "{%- if has_system or DEFAULT -%}{{- '\\n\\n' -}}{%- endif -%}"
            f"{{{{- '{_TOOLS_HEADER}' -}}}}"
            "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
            f"{{{{- '{_TOOLS_FOOTER}' + close('system') -}}}}"
            "{%- elif not has_system and DEFAULT -%}{{- open('system') + DEFAULT + close('system') -}}"
            "{%- endif -%}"
            "{%- for message in messages -%}"
            "{%- if tools and loop.first and message['role'] == 'system' -%}"
            "{%- elif message['role'] == 'assistant' -%}"
            "{{- open('assistant') -}}"
            "{%- generation -%}"
            "{%- set text = render(message['content']) -%}{{- text -}}"
            "{%- for call in message['tool_calls'] or [] -%}"
            "{%- set fn = call['function'] if call['function'] is defined else call -%}"
            "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
            "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
            "{{- (fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson) + '}\\n</tool_call>' -}}"
            "{%- endfor -%}"
            "{{- close('assistant') -}}{%- endgeneration -%}"
            "{{- __AFTER__ -}}"
            "{%- elif message['role'] == 'tool' -%}"
            "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- open('user') -}}{%- else -%}{{- '\\n' -}}"
            "{%- endif -%}"
            "{{- '<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' -}}"
            "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- close('user') -}}{%- endif -%}"
            "{%- else -%}"
            "{{- open(message['role']) + render(message['content']) + close(message['role']) -}}"
            "{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- __PROMPT__ -}}{%- endif -%}"
        )
        .replace("IMAGE", repr(image))
        .replace("VIDEO", repr(video))
        .replace("DEFAULT", repr(default))
        .replace("__OPEN__", turns.open)
        .replace("__CLOSE__", turns.close)
        .replace("__AFTER__", turns.after)
        .replace("__START__", turns.start)
        .replace("__PROMPT__", turns.prompt)
    )


def smolvlm_tool_template() -> str:
    """SmolVLM / Idefics3's turns (``User:`` ... ``<end_of_utterance>``, ``Assistant:`` prompt) with the same tool
    format: schemas in a ``System:`` turn, ``<tool_call>`` blocks, results as ``<tool_response>`` blocks of one
    ``User:`` turn. An assistant turn's text after ``Assistant:`` (its leading space, and ``<end_of_utterance>``) is
    the generation, as the real checkpoints write it."""
    footer = _TOOLS_FOOTER.replace("<|im_end|>", "<end_of_utterance>")
    return (
        _render_macro("'<image>'") + "{%- macro opens_with_image(content) -%}"
        "{%- if content is not string and content and content[0].type == 'image' -%}1{%- endif -%}"
        "{%- endmacro -%}"
        "{{- '<|im_start|>' -}}"
        "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
        "{%- if tools -%}"
        "{{- 'System: ' -}}"
        "{%- if has_system -%}{{- render(messages[0]['content']) + '\\n\\n' -}}{%- endif -%}"
        f"{{{{- '{_TOOLS_HEADER}' -}}}}"
        "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
        f"{{{{- '{footer}' -}}}}"
        "{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if tools and loop.first and message['role'] == 'system' -%}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{{- 'Assistant:' -}}"
        "{%- generation -%}"
        "{%- set text = render(message['content']) -%}{{- ' ' + text -}}"
        "{%- for call in message['tool_calls'] or [] -%}"
        "{%- set fn = call['function'] if call['function'] is defined else call -%}"
        "{%- if text or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
        "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
        "{{- (fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson) + '}\\n</tool_call>' -}}"
        "{%- endfor -%}"
        "{{- '<end_of_utterance>' -}}{%- endgeneration -%}"
        "{{- '\\n' -}}"
        "{%- elif message['role'] == 'tool' -%}"
        "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- 'User:' -}}{%- endif -%}"
        "{{- '\\n<tool_response>\\n' + render(message['content']) + '\\n</tool_response>' -}}"
        "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '<end_of_utterance>\\n' -}}{%- endif -%}"
        "{%- else -%}"
        "{{- message['role'] | capitalize -}}"
        "{{- ':' if opens_with_image(message['content']) else ': ' -}}"
        "{{- render(message['content']) + '<end_of_utterance>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
    )


GLM_IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
GLM_VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"
# GLM-4.5V's turns: [gMASK]<sop>, then <|system|> / <|user|> / <|assistant|> / <|observation|> (no end-of-turn token:
# generation stops at <|user|>, <|observation|> or <|endoftext|>); tools as GLM-4.5 writes them (schemas in a system
# turn, calls as <tool_call>NAME + <arg_key>/<arg_value> pairs, results as <tool_response> blocks of one
# <|observation|> turn, their images rendered too), an assistant turn without reasoning written with an empty
# <think></think> as GLM-4.5's template writes it, and {% generation %} around assistant content for SFT.
_GLM_TOOLS_HEADER = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_GLM_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML "
    "format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)


def glm_tool_template() -> str:
    """GLM-4.1V / GLM-4.5V turns with GLM-4.5's tool format (for checkpoints whose template renders no tools)."""
    return (
        (
            _render_macro("IMAGE", "VIDEO") + "{{- '[gMASK]<sop>' -}}"
            "{%- if tools -%}"
            f"{{{{- '{_GLM_TOOLS_HEADER}' -}}}}"
            "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
            f"{{{{- '{_GLM_TOOLS_FOOTER}' -}}}}"
            "{%- endif -%}"
            "{%- for message in messages -%}"
            "{%- if message['role'] == 'assistant' -%}"
            "{{- '<|assistant|>' -}}"
            "{%- generation -%}"
            "{%- set text = render(message['content'] or '') -%}"
            "{%- if '</think>' not in text -%}{{- '\n<think></think>' -}}{%- endif -%}"
            "{%- if text -%}{{- '\n' + text -}}{%- endif -%}"
            "{%- for call in message['tool_calls'] or [] -%}"
            "{%- set fn = call['function'] if call['function'] is defined else call -%}"
            "{{- '\n<tool_call>' + fn['name'] + '\n' -}}"
            "{%- set args = fn['arguments'] if fn['arguments'] is mapping else {} -%}"
            "{%- for key, value in args.items() -%}"
            "{{- '<arg_key>' + key + '</arg_key>\n<arg_value>' -}}"
            "{{- (value if value is string else value | tojson) + '</arg_value>\n' -}}"
            "{%- endfor -%}"
            "{{- '</tool_call>' -}}"
            "{%- endfor -%}"
            "{%- endgeneration -%}"
            "{%- elif message['role'] == 'tool' -%}"
            "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}"
            "{{- '\n<tool_response>\n' + render(message['content']) + '\n</tool_response>' -}}"
            "{%- else -%}"
            "{{- '<|' + message['role'] + '|>\n' + render(message['content']) -}}"
            "{%- endif -%}"
            "{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
        )
        .replace("IMAGE", repr(GLM_IMAGE))
        .replace("VIDEO", repr(GLM_VIDEO))
    )


# Mistral's own tool format, as mistral-common's instruct tokenizers and the checkpoints' chat templates write it: the
# schemas once as [AVAILABLE_TOOLS]<json list>[/AVAILABLE_TOOLS] before the conversation's user turn, the calls at the
# end of the assistant's turn (before </s>), each result in [TOOL_RESULTS]...[/TOOL_RESULTS] (its images as [IMG]).
# v11+ tokenizers (Mistral-Small-3.2, Magistral, Ministral 3, Devstral) write each call as [TOOL_CALLS]<name>[ARGS]
# <json arguments> and a result as its content; v7 tokenizers (Mistral-Small-3.1), which have no [ARGS] token, write
# the turn's calls as one [TOOL_CALLS]<json list of {"name", "arguments"}> and a result as [TOOL_RESULTS]<call id>
# [TOOL_CONTENT]<content> (here with no call id: TRL's tool messages carry none).
MISTRAL_V11_TOKENS = ("[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
MISTRAL_V7_TOKENS = ("[TOOL_CALLS]", "[TOOL_RESULTS]", "[TOOL_CONTENT]", "[/TOOL_RESULTS]")
_MISTRAL_CALLS = {
    "v11": "{{- '[TOOL_CALLS]' + fn['name'] + '[ARGS]' + args -}}",
    "v7": "{{- ('[TOOL_CALLS][' if loop.first else ', ') -}}"
    "{{- '{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args -}}"
    "{%- if call['id'] is defined and call['id'] -%}{{- ', \"id\": \"' + call['id'] + '\"' -}}{%- endif -%}"
    "{{- '}' + (']' if loop.last else '') -}}",
}
_MISTRAL_RESULTS = {"v11": "'[TOOL_RESULTS]'", "v7": "'[TOOL_RESULTS][TOOL_CONTENT]'"}


def mistral_tools(vocab: dict[str, int]) -> str | None:
    """Mistral's tool format the tokenizer has the tokens of: ``"v11"``, ``"v7"`` (no ``[ARGS]``), or None."""
    if "[INST]" not in vocab:
        return None
    for version, tokens in (("v11", MISTRAL_V11_TOKENS), ("v7", MISTRAL_V7_TOKENS)):
        if all(token in vocab for token in tokens):
            return version
    return None


def mistral_tool_template(version: str = "v11") -> str:
    """Mistral 3's turns with Mistral's own tool format of ``version`` (for checkpoints whose template renders no
    tools)."""
    return (
        _render_macro("'[IMG]'", "'[IMG]'") + "{{- bos_token -}}"
        "{%- set has_system = messages and messages[0]['role'] == 'system' -%}"
        "{%- if has_system -%}{{- '[SYSTEM_PROMPT]' + render(messages[0]['content']) + '[/SYSTEM_PROMPT]' -}}"
        "{%- endif -%}"
        "{%- if tools -%}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if loop.first and has_system -%}"
        "{%- elif message['role'] == 'user' -%}{{- '[INST]' + render(message['content']) + '[/INST]' -}}"
        "{%- elif message['role'] == 'assistant' -%}"
        "{%- generation -%}"
        "{{- render(message['content'] or '') -}}"
        "{%- for call in message['tool_calls'] or [] -%}"
        "{%- set fn = call['function'] if call['function'] is defined else call -%}"
        "{%- set args = fn['arguments'] -%}"
        "{%- if args is not string -%}{%- set args = args | tojson -%}{%- elif args == '' -%}{%- set args = '{}' -%}"
        "{%- endif -%}"
        f"{_MISTRAL_CALLS[version]}"
        "{%- endfor -%}"
        "{{- eos_token -}}{%- endgeneration -%}"
        "{%- elif message['role'] == 'tool' -%}"
        f"{{{{- {_MISTRAL_RESULTS[version]} + render(message['content']) + '[/TOOL_RESULTS]' -}}}}"
        "{%- else -%}"
        "{{- raise_exception('Only system, user, assistant and tool roles are supported') -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


def mistral_response_template(end: str, version: str = "v11") -> dict:
    """How TRL reads Mistral's calls back out of a completion: text, then the calls, up to ``end`` (``</s>``). v11:
    ``[TOOL_CALLS]<name>[ARGS]<json>`` calls (a ``[CALL_ID]<id>`` before ``[ARGS]``, as v11 writes a call that has
    an id, is read too); v7: one ``[TOOL_CALLS]<json list>``, whose ``{"name", "arguments"}`` entries the tool
    protocol turns into calls. A turn follows ``[/INST]``, or ``[/TOOL_RESULTS]`` after a tool's result."""
    import re

    end_pattern = re.escape(end) + r"\s*"
    if version == "v7":
        calls = {"open": "[TOOL_CALLS]", "close_pattern": end_pattern, "content": "json"}
    else:
        calls = {
            "open_pattern": r"\[TOOL_CALLS\](?P<name>[^\[\]]+?)(?:\[CALL_ID\][^\[\]]*)?\[ARGS\]",
            "close_pattern": r"(?=\[TOOL_CALLS\])|" + end_pattern,
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        }
    return {
        "defaults": {"role": "assistant"},
        "start_anchor_pattern": r"\[/INST\]|\[/TOOL_RESULTS\]",
        "fields": {"tool_calls": calls, "content": {"close_pattern": end_pattern, "content": "text"}},
    }


def family_response_template(vocab: dict[str, int], opener: str = "", end: str = "") -> dict:
    """How TRL reads tool calls back out of a completion in the family's turns: Qwen3's format; SmolVLM's turns
    open with ``Assistant:`` and end with ``<end_of_utterance>``; GLM-4.5V writes GLM-4.5's own call format, Mistral 3
    (with Mistral's tool tokens) its ``[TOOL_CALLS]`` calls. Families whose turns end in another token than
    ``<|im_end|>`` (Gemma 3) get Qwen3's calls in their own turns: ``opener`` (the chat template's generation prompt)
    and ``end`` (the tokenizer's end of turn)."""
    import re

    from trl.chat_template_utils import glm4moe_template, qwen3_template

    if "<|observation|>" in vocab:
        return glm4moe_template
    if mistral_tools(vocab):
        return mistral_response_template(end or "</s>", mistral_tools(vocab))
    if "<fake_token_around_image>" in vocab:
        opener, end = "Assistant:", "<end_of_utterance>"
    elif end in ("", "<|im_end|>") or not opener:
        return qwen3_template
    content = {"close_pattern": re.escape(end) + r"\s*", "content": "text"}
    return {**qwen3_template, "start_anchor": opener, "fields": {**qwen3_template["fields"], "content": content}}


def family_tool_template(vocab: dict[str, int]) -> str | None:
    """The tool template for a tokenizer's family, told by its image token (None: unknown family)."""
    if "<|observation|>" in vocab:
        return glm_tool_template()
    if "<fake_token_around_image>" in vocab:
        return smolvlm_tool_template()
    if "<image>" in vocab and "<|im_start|>" in vocab:
        return tool_chat_template(LLAVA_IMAGE, LLAVA_VIDEO, QWEN_SYSTEM)
    if "<|image_pad|>" in vocab:
        return tool_chat_template(QWEN_IMAGE, QWEN_VIDEO, QWEN_SYSTEM)
    if "<IMG_CONTEXT>" in vocab:
        return tool_chat_template(INTERNVL_IMAGE, INTERNVL_VIDEO, None)
    if "<start_of_turn>" in vocab and "<start_of_image>" in vocab:
        return tool_chat_template(GEMMA3_IMAGE, GEMMA3_IMAGE, None, GEMMA_TURNS)
    if "[INST]" in vocab and "[IMG]" in vocab:
        if mistral_tools(vocab):
            return mistral_tool_template(mistral_tools(vocab))
        return tool_chat_template(PIXTRAL_IMAGE, PIXTRAL_IMAGE, None, MISTRAL_TURNS)
    return None
