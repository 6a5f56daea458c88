"""Mistral 3's own tool format: ``[TOOL_CALLS]NAME[ARGS]{json}`` calls and ``[TOOL_RESULTS]...[/TOOL_RESULTS]`` replies.

The expected texts are written out by hand from mistral-common's v13 chat template
(``tests/data/chat_templates/v13_image.jinja`` in mistralai/mistral-common: ``[AVAILABLE_TOOLS]`` + the tools as JSON +
``[/AVAILABLE_TOOLS]``, each call ``'[TOOL_CALLS]' + name + '[ARGS]' + arguments``, then ``eos_token``, each result
``'[TOOL_RESULTS]' + content + '[/TOOL_RESULTS]'``), and from its v11 instruct tokenizer (``[CALL_ID]`` + id before
``[ARGS]`` when the call has an id). The tiny mistral3 build's tokenizer has these tokens as special tokens, as the
real v11+ tokenizers do.
"""

from __future__ import annotations

import pytest

from e2e_utils import base_args, make_dataset
from test_tool_turns_fast import call_turn
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.tools.base import MALFORMED_CALL
from vlm_grpo.tools.protocols import HERMES_MALFORMED, MISTRAL_MALFORMED, MISTRAL_V7_MALFORMED
from vlm_grpo.tools.rollouts import prepare_for_tools, tool_turns
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GOOD = '[TOOL_CALLS]zoom_in[ARGS]{"bbox_2d": [100, 100, 800, 800], "image_index": 0}</s>'
BAD_BOX = '[TOOL_CALLS]zoom_in[ARGS]{"bbox_2d": [50, 50, 10, 10]}</s>'  # inverted box: the tool's error
UNREADABLE = '[TOOL_CALLS]zoom_in[ARGS]{"bbox_2d": [100, 100</s>'  # the JSON is cut off


def zoom_in(bbox_2d: list, image_index: int = 0) -> str:
    """Zoom in.

    Args:
        bbox_2d: the box
        image_index: the image
    """
    return ""


@pytest.fixture(scope="module")
def processor(tiny_models):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_models["mistral3"])
    prepare_for_tools(None, processor)
    return processor


def ids(processor, text: str) -> list[int]:
    return processor.tokenizer.encode(text, add_special_tokens=False)


def test_the_template_writes_mistrals_tool_format(processor):
    from trl.chat_template_utils import supports_tool_calling

    assert supports_tool_calling(processor)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Zoom in."}]},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [{"type": "function", "function": {"name": "zoom_in", "arguments": {"bbox_2d": [1, 2]}}}],
        },
        {"role": "tool", "name": "zoom_in", "content": [{"type": "image"}, {"type": "text", "text": "zoomed"}]},
    ]
    text = processor.apply_chat_template(messages, tools=[zoom_in], tokenize=False)
    head, tools = "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][AVAILABLE_TOOLS][", "][/AVAILABLE_TOOLS]"
    assert text.startswith(head) and tools in text
    assert text.endswith(
        '[INST][IMG]Zoom in.[/INST]Looking.[TOOL_CALLS]zoom_in[ARGS]{"bbox_2d": [1, 2]}</s>'
        "[TOOL_RESULTS][IMG]zoomed[/TOOL_RESULTS]"
    )
    # Each marker is one special token, as in Mistral's tokenizers.
    tokens = processor.tokenizer.convert_ids_to_tokens(ids(processor, text))
    for marker in ("[AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[ARGS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"):
        assert marker in tokens


def test_a_tool_run_never_samples_pixtrals_image_tokens(tiny_models):
    """A sampled ``[IMG]`` would be one more image placeholder than the rollout has images."""
    from types import SimpleNamespace

    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_models["mistral3"])
    args = SimpleNamespace(generation_kwargs=None)
    prepare_for_tools(args, processor)
    image_tokens = processor.tokenizer.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    assert set(image_tokens) <= set(args.generation_kwargs["suppress_tokens"])


def test_a_call_turn_is_written_as_the_template_writes_it(tiny_models):
    call = {"name": "zoom_in", "arguments": {"bbox_2d": [100, 100, 800, 800], "image_index": 0}}
    assert call_turn("mistral3", tiny_models, call) == GOOD


@pytest.mark.parametrize(
    ("text", "calls", "content"),
    [
        (GOOD, [{"bbox_2d": [100, 100, 800, 800], "image_index": 0}], ""),
        (
            'Let me look.[TOOL_CALLS]zoom_in[ARGS]{"bbox_2d": [1, 2, 3, 4]}</s>',
            [{"bbox_2d": [1, 2, 3, 4]}],
            "Let me look.",
        ),
        (  # two calls, the second with v11's call id
            '[TOOL_CALLS]zoom_in[ARGS]{"bbox_2d": [1, 2, 3, 4]}'
            '[TOOL_CALLS]zoom_in[CALL_ID]a1b2c3d4e[ARGS]{"bbox_2d": [5, 6, 7, 8], "image_index": 1}</s>',
            [{"bbox_2d": [1, 2, 3, 4]}, {"bbox_2d": [5, 6, 7, 8], "image_index": 1}],
            "",
        ),
        ("<answer>red</answer></s>", [], "<answer>red</answer>"),
    ],
)
def test_trl_reads_mistral_calls(processor, text, calls, content):
    from trl.chat_template_utils import parse_response

    for prefix in ("<s>[INST]Zoom in.[/INST]", "<s>[INST]Zoom in.[/INST]x</s>[TOOL_RESULTS]done[/TOOL_RESULTS]"):
        parsed = parse_response(processor.tokenizer, ids(processor, text), prefix=ids(processor, prefix))
        assert [c["function"]["arguments"] for c in parsed.get("tool_calls", [])] == calls
        assert all(c["function"]["name"] == "zoom_in" for c in parsed.get("tool_calls", []))
        assert parsed["content"] == content


@pytest.mark.parametrize(
    "text",
    [UNREADABLE, '[TOOL_CALLS]zoom_in{"bbox_2d": [1, 2, 3, 4]}</s>', "[TOOL_CALLS]zoom_in[ARGS]not json</s>"],
)
def test_an_unreadable_call_gets_the_protocols_message(processor, text):
    from trl.chat_template_utils import parse_response

    turns = tool_turns([], None, processor, None)
    assert turns.protocol.name == "hermes" and turns.protocol.special_text
    prefix = ids(processor, "<s>[INST]Zoom in.[/INST]")
    turn = ids(processor, text)
    message = turns.read(parse_response(processor.tokenizer, turn, prefix=prefix), turn, len(prefix), [zoom_in])
    assert message["tool_calls"] == [
        {"type": "function", "function": {"name": MALFORMED_CALL, "arguments": {"message": MISTRAL_MALFORMED}}}
    ]


def test_plain_turns_and_other_families_are_not_read_as_mistral_calls(processor, tiny_models):
    """Controls: a Mistral turn with no call has no error; Qwen's tokenizer keeps Hermes' marker and message."""
    from transformers import AutoProcessor
    from trl.chat_template_utils import parse_response

    turns = tool_turns([], None, processor, None)
    prefix = ids(processor, "<s>[INST]Zoom in.[/INST]")
    turn = ids(processor, "It is red.</s>")
    assert "tool_calls" not in turns.read(parse_response(processor.tokenizer, turn, prefix=prefix), turn, 9, None)
    qwen = tool_turns([], None, AutoProcessor.from_pretrained(tiny_models["qwen2_5_vl"]), None)
    assert qwen.protocol.calls.malformed == HERMES_MALFORMED and not qwen.protocol.special_text


V7_GOOD = '[TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [100, 100, 800, 800], "image_index": 0}}]</s>'
V7_BAD_BOX = '[TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [50, 50, 10, 10]}}]</s>'
V7_UNREADABLE = '[TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [100, 100</s>'


@pytest.mark.parametrize(
    ("version", "good", "bad_box", "unreadable", "result", "message"),
    [
        ("v11", GOOD, BAD_BOX, UNREADABLE, "[TOOL_RESULTS]", MISTRAL_MALFORMED),
        ("v7", V7_GOOD, V7_BAD_BOX, V7_UNREADABLE, "[TOOL_RESULTS][TOOL_CONTENT]", MISTRAL_V7_MALFORMED),
    ],
)
def test_a_scripted_rollout_runs_mistral_calls_and_feeds_back_results(
    version, good, bad_box, unreadable, result, message, tiny_models, tmp_path
):
    """One GRPO step whose first turns are scripted: a good ``zoom_in`` call, one with an inverted box, one whose
    JSON is cut off, and a turn without a call. The next turn's prompt holds each call's result as the template
    writes it: the zoomed image, the tool's error, the protocol's message; the turn without a call ends there.
    v7: the run's tokenizer is taken for one without ``[ARGS]``."""
    from vlm_grpo.tools import protocols, templates

    data, plugin = make_dataset(tmp_path / "data", kinds=("single",))
    scripted_turns = [good, bad_box, unreadable, "It is red.</s>"]
    later: list[str] = []
    generate = VLMGRPOTrainer._generate_single_turn

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations > 1:
            return [
                self._tokenizer.encode(scripted_turns[i % 4], add_special_tokens=False) for i in range(len(prompt_ids))
            ], None
        later.extend(self._tokenizer.decode(p, skip_special_tokens=False) for p in prompt_ids)
        return generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    argv = base_args(tiny_models["mistral3"], data, plugin, tmp_path / "out", steps=1)
    argv += ["--generation_kwargs", '{"max_new_tokens": 4, "do_sample": false}', "--share_prefill", "false"]
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", "1", "--max_completion_length", "400"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted)
        for module in (protocols, templates):
            mp.setattr(module, "mistral_tools", lambda vocab: version)
        main(*parse_args(argv))
    assert len(later) == 3  # the turn without a call ran no tool
    good_next, bad_next, unreadable_next = later
    assert good_next.count("[TOOL_RESULTS]") == 1 and good_next.endswith("[/TOOL_RESULTS]")
    assert good_next.split(good)[1].startswith(result) and "[IMG]" in good_next.split(good)[1]
    assert "[IMG]" not in bad_next.split(bad_box)[1]
    assert bad_next.split(bad_box)[1].startswith(result + "{'error': ")
    assert unreadable_next.split(unreadable)[1] == result + str({"error": message}) + "[/TOOL_RESULTS]"


# ------------------------------------------------------------------ v7 tokenizers (Mistral-Small-3.1): no [ARGS] token
V7_CALL = '[TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 3, 4]}, "id": "a1b2c3d4e"}]</s>'


@pytest.fixture
def v7(tiny_models):
    """The tiny processor with the v7 template and parser, as a tokenizer without ``[ARGS]`` gets them."""
    from transformers import AutoProcessor

    from vlm_grpo.tools.templates import mistral_response_template, mistral_tool_template

    processor = AutoProcessor.from_pretrained(tiny_models["mistral3"])
    processor.chat_template = processor.tokenizer.chat_template = mistral_tool_template("v7")
    processor.tokenizer.response_template = mistral_response_template("</s>", "v7")
    return processor


def test_the_tokenizers_tokens_pick_mistrals_format(processor, tiny_models):
    from transformers import AutoTokenizer

    from vlm_grpo.tools.templates import mistral_tools

    vocab = processor.tokenizer.get_vocab()
    assert mistral_tools(vocab) == "v11"
    assert mistral_tools({k: v for k, v in vocab.items() if k not in ("[ARGS]", "[CALL_ID]")}) == "v7"
    assert mistral_tools({k: v for k, v in vocab.items() if k not in ("[ARGS]", "[TOOL_CONTENT]")}) is None
    assert mistral_tools(AutoTokenizer.from_pretrained(tiny_models["qwen2_5_vl"]).get_vocab()) is None


def test_v7_template_writes_one_json_list_of_calls(v7):
    calls = [
        {"type": "function", "function": {"name": "zoom_in", "arguments": {"bbox_2d": [1, 2]}}},
        {"type": "function", "id": "a1b2c3d4e", "function": {"name": "rotate", "arguments": {"angle": 90}}},
    ]
    messages = [
        {"role": "user", "content": "Zoom in."},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": "zoom_in", "content": [{"type": "image"}, {"type": "text", "text": "zoomed"}]},
    ]
    text = v7.apply_chat_template(messages, tokenize=False)
    assert text == (
        '<s>[INST]Zoom in.[/INST][TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2]}}, '
        '{"name": "rotate", "arguments": {"angle": 90}, "id": "a1b2c3d4e"}]</s>'
        "[TOOL_RESULTS][TOOL_CONTENT][IMG]zoomed[/TOOL_RESULTS]"
    )


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (V7_CALL, [("zoom_in", {"bbox_2d": [1, 2, 3, 4]})]),
        (
            '[TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 3, 4]}}, '
            '{"name": "zoom_in", "arguments": {"bbox_2d": [5, 6, 7, 8]}}]</s>',
            [("zoom_in", {"bbox_2d": [1, 2, 3, 4]}), ("zoom_in", {"bbox_2d": [5, 6, 7, 8]})],
        ),
        ('[TOOL_CALLS][{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2</s>', MISTRAL_V7_MALFORMED),
        ('[TOOL_CALLS][{"arguments": {"bbox_2d": [1, 2, 3, 4]}}]</s>', MISTRAL_V7_MALFORMED),  # no name
        ("It is red.</s>", []),
    ],
)
def test_v7_calls_are_read_by_the_protocol(v7, text, calls):
    from trl.chat_template_utils import parse_response

    from vlm_grpo.tools.protocols import MISTRAL_V7_CALLS, HermesProtocol
    from vlm_grpo.tools.rollouts import ToolTurns

    turns = ToolTurns(HermesProtocol(MISTRAL_V7_CALLS), v7.tokenizer)
    prefix = ids(v7, "<s>[INST]Zoom in.[/INST]")
    turn = ids(v7, text)
    message = turns.read(parse_response(v7.tokenizer, turn, prefix=prefix), turn, len(prefix), [zoom_in])
    if isinstance(calls, str):
        calls = [(MALFORMED_CALL, {"message": calls})]
    assert message.get("tool_calls", []) == [
        {"type": "function", "function": {"name": name, "arguments": arguments}} for name, arguments in calls
    ]


# ------------------------------------------------------------------ the tool_format reward on the families' formats
def _turn(text: str, *calls: tuple[str, dict]) -> list[dict]:
    return [
        {
            "role": "assistant",
            "content": text,
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls],
        }
    ]


GLM_BLOCK = "<tool_call>zoom_in\n<arg_key>bbox_2d</arg_key>\n<arg_value>[1, 2, 30, 40]</arg_value>\n</tool_call>"


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        # Mistral: the tokenizer drops [TOOL_CALLS] from the text; the protocol's verdict is in the calls
        (_turn('zoom_in{"bbox_2d": [1, 2, 3, 4]}', (MALFORMED_CALL, {"message": MISTRAL_MALFORMED})), 0.0),
        (_turn('zoom_in[{"name": "zoom_in"', (MALFORMED_CALL, {"message": MISTRAL_V7_MALFORMED})), 0.0),
        (_turn('zoom_in{"bbox_2d": [1, 2, 3, 4]}', ("zoom_in", {"bbox_2d": [1, 2, 3, 4]})), 1.0),
        # GLM: a block in GLM-4.5's format the call was read from
        (_turn(GLM_BLOCK, ("zoom_in", {"bbox_2d": [1, 2, 30, 40]})), 1.0),
        (_turn(GLM_BLOCK), 0.0),  # the control: not read as a call, it is not a well-formed JSON block either
        (_turn("<tool_call>zoom_in(1, 2)</tool_call>", ("zoom_in", {})), 0.0),  # neither JSON nor GLM's
        # Qwen: a call of a tool that does not exist is still well formed; an unreadable block is not
        (
            _turn('<tool_call>{"name": "pan", "arguments": {}}</tool_call>', (MALFORMED_CALL, {"message": "no pan"})),
            1.0,
        ),
        (_turn("<tool_call>{</tool_call>", (MALFORMED_CALL, {"message": HERMES_MALFORMED})), 0.0),
    ],
)
def test_tool_format_reward_reads_each_familys_calls(completion, score):
    from vlm_grpo.rewards.tools import tool_format_reward

    assert tool_format_reward([completion]) == [score]
