"""Chat-template details checked against the checkpoints' published templates.

GLM: the tool format of GLM-4.5's ``chat_template.jinja`` (GLM-4.5-Air, whose language model GLM-4.5V shares; GLM-OCR's
template writes the same tool parts and adds the image placeholders): the tool system prompt with its two
``<arg_key>`` / ``<arg_value>`` example pairs, ``\\n<think></think>`` in an assistant turn that has no reasoning,
each call as ``\\n<tool_call>NAME\\n`` + ``<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`` + ``</tool_call>``,
results as ``\\n<tool_response>\\n...\\n</tool_response>`` after one ``<|observation|>``, and ``<|assistant|>`` as the
generation prompt. GLM-4.1V-9B-Thinking's own template renders no tools, which is why its tool runs take this one.
The expected strings are written out by hand from those templates.
"""

from __future__ import annotations

import pytest

from vlm_grpo.tools.templates import glm_tool_template

TOOL = {
    "type": "function",
    "function": {"name": "zoom_in", "description": "Zoom.", "parameters": {"type": "object", "properties": {}}},
}
GLM45_TOOL_PROMPT = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "zoom_in", "description": "Zoom.", '
    '"parameters": {"type": "object", "properties": {}}}}\n</tools>\n\n'
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)


@pytest.fixture(scope="module")
def processor(tiny_models):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_models["glm4v"])
    assert processor.chat_template == glm_tool_template()
    return processor


def render(processor, messages, **kwargs) -> str:
    return processor.apply_chat_template(messages, tokenize=False, **kwargs)


def test_glm_tool_prompt_is_glm45s(processor):
    text = render(processor, [{"role": "user", "content": "Zoom in."}], tools=[TOOL], add_generation_prompt=True)
    assert text == "[gMASK]<sop>" + GLM45_TOOL_PROMPT + "<|user|>\nZoom in.<|assistant|>"


@pytest.mark.parametrize(
    ("content", "written"),
    [
        ("", "\n<think></think>"),  # no reasoning: GLM-4.5 writes an empty think block
        ("Let me look.", "\n<think></think>\nLet me look."),
        ("<think>The cat is small.</think>\nLet me look.", "\n<think>The cat is small.</think>\nLet me look."),
    ],
)
def test_glm_call_turn_and_result_are_glm45s(processor, content, written):
    call = {"type": "function", "function": {"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 30, 40], "k": "a"}}}
    messages = [
        {"role": "user", "content": "Zoom in."},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "name": "zoom_in", "content": "ok"},
        {"role": "tool", "name": "zoom_in", "content": "again"},
    ]
    text = render(processor, messages, add_generation_prompt=True)
    assert text == (
        "[gMASK]<sop><|user|>\nZoom in.<|assistant|>" + written + "\n<tool_call>zoom_in\n"
        "<arg_key>bbox_2d</arg_key>\n<arg_value>[1, 2, 30, 40]</arg_value>\n"
        "<arg_key>k</arg_key>\n<arg_value>a</arg_value>\n"
        "</tool_call><|observation|>\n<tool_response>\nok\n</tool_response>\n<tool_response>\nagain\n</tool_response>"
        "<|assistant|>"
    )
