"""Tool replies and turn reading without a model, to the block: each protocol's reply as the chat template
receives it (block types included: a block of the wrong type is not rendered), the user turn a turn's replies
make, what ends a turn, and the messages a malformed call or a refused one gives the model.

Expected values are written out by hand from DeepEyes' and PyVision's observation strings (module docstring of
``vlm_grpo.tools.protocols``), never computed by the code under test.
"""

from __future__ import annotations

import pytest
from PIL import Image

from vlm_grpo.tools.protocols import (
    DEEPEYES_TURN_PROMPT_V5,
    DEEPEYES_USER_PROMPT,
    PROTOCOLS,
    DeepEyesProtocol,
    HermesProtocol,
    function_call,
    text_of,
)
from vlm_grpo.tools.rollouts import MALFORMED_CALL, ToolTurns

RED, BLUE = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image(value: Image.Image) -> dict:
    return {"type": "image", "image": value}


@pytest.fixture(scope="module")
def tokenizer():
    from vlm_grpo.testing.tiny import build_tokenizer

    return build_tokenizer("qwen2_5_vl")


def test_deepeyes_v2_replies_block_by_block():
    v2 = DeepEyesProtocol()  # the default version is v2: what DeepEyes' README training uses
    assert v2.version == "v2"
    assert v2.reply([text("Zoomed in"), image(RED), image(BLUE)], 1) == [
        text("<tool_response>"),
        image(RED),
        image(BLUE),
        text(DEEPEYES_USER_PROMPT + "</tool_response>"),
    ]
    assert v2.reply([text("rotated "), text("by 90")], 1) == [
        text("<tool_response>rotated by 90" + DEEPEYES_USER_PROMPT + "</tool_response>")
    ]
    assert v2.reply("plain", 1) == [text("<tool_response>plain" + DEEPEYES_USER_PROMPT + "</tool_response>")]
    assert v2.reply(None, 1) == [text("<tool_response>" + DEEPEYES_USER_PROMPT + "</tool_response>")]


def test_deepeyes_v5_replies_one_response_per_image_and_the_turn_prompt_once():
    v5 = DeepEyesProtocol("v5")
    two = v5.reply([text("Zoomed in"), image(RED), image(BLUE)], 1)
    assert two == [
        text("<tool_response>\n"),
        image(RED),
        text("\n</tool_response>\n"),
        text("<tool_response>\n"),
        image(BLUE),
        text("\n</tool_response>\n"),
    ]
    assert v5.reply([text("no view")], 1) == [text("<tool_response>\nno view\n</tool_response>\n")]
    assert v5.reply(None, 1) == [text("<tool_response>\n\n</tool_response>\n")]
    joined = v5.join([two, v5.error("bad box", malformed=False)])
    assert joined == [*two, text("Error: bad box"), text(DEEPEYES_TURN_PROMPT_V5)]
    assert PROTOCOLS.get("deepeyes").join([two]) == two  # v2 words its prompt inside each reply


def test_a_deepeyes_version_it_does_not_have_is_named_in_the_error():
    with pytest.raises(ValueError, match=r"^DeepEyes version must be one of v2, v5, got 'v3'$"):
        DeepEyesProtocol("v3")


@pytest.mark.parametrize(
    ("call", "why"),
    [
        ('{"name": 3, "arguments": {"bbox_2d": [1, 2, 3, 4]}}', "name"),
        ('{"name": "image_zoom_in_tool", "arguments": [1, 2, 3, 4]}', "arguments"),
    ],
)
def test_deepeyes_refuses_a_call_whose_name_or_arguments_have_the_wrong_type(call, why):
    turn = DeepEyesProtocol().parse(f"<tool_call>{call}</tool_call>")
    assert turn.calls == [] and not turn.answered
    assert turn.error == f"Invalid tool call format: {call}. Error: name must be a string, arguments an object"


def test_pyvision_replies_block_by_block():
    pyvision = PROTOCOLS.get("pyvision")
    reply = pyvision.reply([text("(2, 3)\n[1 image(s) shown: image_clue_4]"), image(RED)], 4)
    assert reply == [
        text("<tool_response>\n<interpreter>Text Result:\n(2, 3)\nImage Result:\n"),
        text("<image_clue_4>"),
        image(RED),
        text("</image_clue_4>"),
        text("</interpreter>\n\n</tool_response>"),
    ]
    assert pyvision.reply([text("(no output)")], 1) == [
        text("<tool_response>\n<interpreter>\nText Result:\n</interpreter>\n\n</tool_response>")
    ]


def test_text_of_joins_the_text_blocks_only():
    blocks = ["stray", text("a"), {"type": "text"}, image(RED), {"type": "note", "text": "x"}, text("b")]
    assert text_of(blocks) == "ab"
    assert text_of(None) == "" and text_of(7) == "7"


class Plain(HermesProtocol):
    """A plugin protocol that words its own user turns and replies with plain strings."""

    name = "plain"
    user_replies = True

    def reply(self, result, first_image):
        return f"[{text_of(result)}]"


def test_a_turns_replies_make_one_user_turn_in_order(tokenizer):
    messages = [
        {"role": "tool", "name": "python", "content": [text("one"), image(RED)]},
        {"role": "tool", "name": "rotate", "content": "two"},
    ]
    turns = ToolTurns(Plain(), tokenizer)
    assert turns.reply_messages(messages) == [
        {"role": "user", "name": "python", "content": [text("one"), image(RED), text("two")]}
    ]
    hermes = ToolTurns(PROTOCOLS.get("hermes"), tokenizer)
    assert hermes.reply_messages(messages) == messages  # the chat template's own tool turns


def test_a_turn_ends_by_itself_only_at_its_eos_or_the_stop_string(tokenizer):
    eos = tokenizer.eos_token_id
    words = tokenizer.encode("I will zoom in", add_special_tokens=False)
    hermes = ToolTurns(PROTOCOLS.get("hermes"), tokenizer)
    assert hermes.ended([*words, eos]) and not hermes.ended(words)  # no stop string: the budget cut it
    pyvision = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer)
    code = tokenizer.encode("<code>\nx = 1\n</code>\n", add_special_tokens=False)
    assert pyvision.ended(code) and pyvision.ended([*words, eos])
    assert not pyvision.ended(code[:-1]) and not pyvision.ended(words)


class StopAtTurnStart(HermesProtocol):
    """A plugin protocol whose stop string is one special token: the turn ends where the model opens a new turn."""

    name = "stop_at_turn_start"
    stop = ("<|im_start|>",)


def test_a_one_token_special_stop_string_cuts_right_after_it(tokenizer):
    turns = ToolTurns(StopAtTurnStart(), tokenizer)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    words = tokenizer.encode("look closer", add_special_tokens=False)
    assert turns.cut([*words, start, *words]) == [*words, start]
    long = tokenizer.encode(" ".join(["look closer at the frame"] * 8), add_special_tokens=False)
    for cut in (5, len(long) - 1, len(long)):  # the stop early, late and last, in a long turn
        assert turns.cut([*long[:cut], start, *long]) == [*long[:cut], start]
    assert turns.cut([start, *words]) == [start]  # the first token already stops the turn
    assert turns.cut(words) == words
    assert turns.ended([*words, start]) and turns.ended([start]) and not turns.ended(words)


def test_a_rollout_not_yet_given_tools_is_under_any_image_budget_but_zero(tokenizer):
    class Env:
        pass

    assert not ToolTurns(PROTOCOLS.get("hermes"), tokenizer, max_tool_images=1).at_image_budget(Env())
    assert ToolTurns(PROTOCOLS.get("hermes"), tokenizer, max_tool_images=0).at_image_budget(Env())
    assert not ToolTurns(PROTOCOLS.get("hermes"), tokenizer).at_image_budget(Env())


def test_images_over_the_budget_are_dropped_the_rest_of_the_reply_kept(tokenizer):
    def views(**kwargs):
        return [image(RED), image(BLUE), text("two views")]

    turns = ToolTurns(PROTOCOLS.get("hermes"), tokenizer, max_tool_images=3)
    counts = {"images": 0}
    tool = turns.wrap(views, None, 1, counts)
    assert tool() == [image(RED), image(BLUE), text("two views")]  # 2 of 3: all shown
    assert (counts["images"], turns.image_refusals) == (2, 0)
    assert tool() == [image(RED), text("two views"), text("[1 more image(s) not shown: --max_tool_images 3]")]
    assert (counts["images"], turns.image_refusals) == (3, 1)
    with pytest.raises(ValueError, match="already holds 3 tool images, the most allowed"):
        tool()
    assert (counts["images"], turns.image_refusals) == (3, 2)
    other = turns.wrap(views, None, 1, {"images": 2})  # another rollout, one image from its budget
    assert other()[1:] == [text("two views"), text("[1 more image(s) not shown: --max_tool_images 3]")]
    assert turns.image_refusals == 3


def test_the_hidden_tool_is_never_refused_by_the_image_budget(tokenizer):
    from vlm_grpo.tools.rollouts import build_tool_environment

    def python(code: str) -> list:
        return [text(code)]

    turns = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer, max_tool_images=0)
    env = build_tool_environment(["zoom_in"])()
    env.reset(images=[RED])
    tools = turns.tools_for({"python": python}, env, 1)
    assert sorted(tools) == [MALFORMED_CALL, "python"] and tools["python"].__name__ == "python"
    assert tools[MALFORMED_CALL](message="no code") == [
        text("<tool_response>\n<interpreter>Error: no code</interpreter>\n\n</tool_response>")
    ]
    assert tools["python"](code="1")[0]["text"].startswith(
        "<tool_response>\n<interpreter>Execution error: this conversation already holds 0 tool images"
    )
    assert turns.image_counts[id(env)] == {"images": 0} and turns.at_image_budget(env)
    assert (env.calls, env.errors) == (2, 2)  # both count as failed calls of the rollout


def test_reading_a_turn_keeps_trls_content_for_hermes_and_the_text_otherwise(tokenizer):
    ids = tokenizer.encode("run <code>print(1)</code><|im_end|>", add_special_tokens=False)
    pyvision = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer, max_context_tokens=len(ids) + 5)
    message = pyvision.read({"content": "TRL's parse"}, ids, 4, ["python"])
    assert message == {
        "content": "run <code>print(1)</code>",  # decoded without special tokens, as the model wrote it
        "role": "assistant",
        "tool_calls": [function_call("python", {"code": "print(1)"})],
    }
    # A read ahead of TRL's (count=False) neither counts a context stop nor a call after the answer
    assert "tool_calls" not in pyvision.read({}, ids, 5, ["python"], count=False) and pyvision.context_stops == 0
    answered = tokenizer.encode("<answer>1</answer><code>x</code>", add_special_tokens=False)
    pyvision.read({}, answered, 0, ["python"], count=False)
    assert pyvision.calls_after_answer == 0
    pyvision.read({}, answered, 0, ["python"])
    assert pyvision.calls_after_answer == 1

    hermes = ToolTurns(PROTOCOLS.get("hermes"), tokenizer)
    call = function_call("zoom_in", {"bbox_2d": [1, 2, 3, 4]})
    kept = hermes.read({"role": "assistant", "content": "TRL's parse", "tool_calls": [call]}, ids, 0, ["zoom_in"])
    assert kept == {"role": "assistant", "content": "TRL's parse", "tool_calls": [call]}
    assert hermes.read({"role": "assistant"}, ids, 0, ["zoom_in"])["content"] == "run <code>print(1)</code>"


def test_later_turns_check_the_calls_against_every_tool_of_the_run(tokenizer):
    """TRL hands later turns' parses no tools when the protocol hides them: the run's names stand in."""
    turns = ToolTurns(PROTOCOLS.get("deepeyes"), tokenizer)
    turns.names = {"image_zoom_in_tool"}
    ids = tokenizer.encode('<tool_call>{"name": "zoom", "arguments": {}}</tool_call>', add_special_tokens=False)
    message = turns.read({}, ids, 0, None)
    assert message["tool_calls"] == [
        function_call(MALFORMED_CALL, {"message": "there is no tool named 'zoom'; the tools are: image_zoom_in_tool"})
    ]


def test_an_image_is_numbered_where_the_environment_recorded_it(tokenizer):
    """A call that ran ahead of TRL's loop recorded its image already: its clue is that index, not the count of
    images the loop has seen (prompt images + earlier tool images)."""
    from vlm_grpo.tools.rollouts import build_tool_environment

    env = build_tool_environment(["zoom_in"])()
    env.reset(images=[RED, RED])
    view = Image.new("RGB", (16, 16), (0, 255, 0))
    env._add_image(BLUE)
    env._add_image(view)  # index 3
    tool = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer).wrap(lambda: [image(view)], env, 2, {"images": 0})
    assert "<image_clue_3>" in [b.get("text") for b in tool()]
    env._add_image(view)  # the same image returned again: its latest index
    assert "<image_clue_4>" in [b.get("text") for b in tool()]


def test_an_image_that_does_not_decode_says_why(tokenizer):
    import io

    png = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(png, format="PNG")
    broken = Image.open(io.BytesIO(png.getvalue()[:60]))  # the header reads, the pixels do not
    tool = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer).wrap(lambda: [image(broken)], None, 1, {"images": 0})
    reply = tool()[0]["text"]
    assert reply.startswith(
        "<tool_response>\n<interpreter>Execution error: the tool returned an image that cannot be decoded: "
    )
    assert len(reply) > len("<tool_response>\n<interpreter>Execution error: the tool returned an image that ") + 40


def test_the_tool_threads_run_64_calls_at_once(monkeypatch):
    """Every rollout of a 64-rollout batch runs its python cell at the same time: 64 calls that each wait for all
    the others finish (a smaller pool would leave some waiting for a free thread)."""
    import threading

    from vlm_grpo.tools import rollouts

    monkeypatch.setattr(rollouts, "_EXECUTOR", None)
    barrier = threading.Barrier(64, timeout=10)
    futures = [rollouts.tool_executor().submit(barrier.wait) for _ in range(64)]
    assert sorted(f.result(timeout=15) for f in futures) == list(range(64))
    rollouts._EXECUTOR.shutdown(wait=True)


def test_the_tool_loops_parser_calls_the_tokenizer_with_its_keywords(tokenizer):
    from vlm_grpo.tools.rollouts import ProtocolParser

    parser = ProtocolParser(tokenizer, ToolTurns(PROTOCOLS.get("hermes"), tokenizer))
    assert "attention_mask" not in parser("look closer", return_attention_mask=False)
    assert parser("look closer", return_attention_mask=False) == tokenizer("look closer", return_attention_mask=False)


def test_tool_flag_errors_say_what_to_change():
    from vlm_grpo.cli_errors import UserError
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.tools.rollouts import check_tool_flags

    def check(*argv):
        check_tool_flags(parse_args(["--model_name_or_path", "never-loaded", *argv])[0])

    with pytest.raises(UserError) as error:
        check("--max_tool_images", "2", "--max_context_tokens", "64")
    assert str(error.value) == (
        "--max_tool_images, --max_context_tokens without --tools: name the tools the model may call, "
        "e.g. --tools zoom_in"
    )
    with pytest.raises(ValueError, match=r"^--tool_kwargs was given without --tools$"):
        check("--tool_kwargs", '{"zoom_in": {"size": 56}}')
    with pytest.raises(UserError) as error:
        check("--tools", "zoom_in", "--max_turn_tokens", "-1")
    assert str(error.value) == "--max_turn_tokens must be a positive number of tokens, got -1"
    check("--tools", "zoom_in", "--max_turn_tokens", "1", "--max_context_tokens", "1", "--max_tool_images", "0")
    with pytest.raises(ValueError, match=r"^--max_context_tokens must be a positive number of tokens, got 0$"):
        check("--tools", "zoom_in", "--max_context_tokens", "0")
    with pytest.raises(ValueError, match=r"^--max_tool_images must be 0 or more images, got -1$"):
        check("--tools", "zoom_in", "--max_tool_images", "-1")
    with pytest.raises(ValueError, match=r"^--tool_protocol pyvision runs the python tool: add it to --tools "):
        check("--tools", "zoom_in", "crop", "--tool_protocol", "pyvision")
    try:
        check("--tools", "zoom_in", "crop", "--tool_protocol", "pyvision")
    except ValueError as exc:
        assert str(exc).endswith("(now: crop, zoom_in)")


def test_tools_that_ask_for_different_protocols_need_the_flag():
    from vlm_grpo.tools.protocols import resolve_protocol

    def zoom(env) -> str:
        return ""

    def run(env) -> str:
        return ""

    zoom.protocol, run.protocol = "deepeyes", "pyvision"
    with pytest.raises(ValueError) as error:
        resolve_protocol(None, [zoom, run, print])
    assert str(error.value) == (
        "The tools ask for different protocols (deepeyes, pyvision): pick one with --tool_protocol"
    )
    assert resolve_protocol(None, [zoom, print]).name == "deepeyes"
    assert resolve_protocol("pyvision", [zoom, run]).name == "pyvision"


def triple(x: int) -> int:
    """Triple a number.

    Args:
        x: the number.
    """
    return 3 * x


@pytest.fixture(scope="module")
def template_tokenizer():
    from trl.chat_template_utils import qwen3_template

    from vlm_grpo.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer("qwen2_5_vl")
    tokenizer.response_template = qwen3_template  # as prepare_for_tools sets it
    return tokenizer


def test_the_tool_loops_parser_reads_with_the_tools_and_the_context_it_is_handed(template_tokenizer):
    """TRL's loop hands the tools (arguments typed by their schemas, unknown names caught) and the prompt's tokens
    (the context budget counts them)."""
    from trl.chat_template_utils import parse_response

    from vlm_grpo.tools.rollouts import ProtocolParser

    tok = template_tokenizer
    prefix = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)

    def ids(name: str) -> list[int]:
        text = f'<tool_call>\n{{"name": "{name}", "arguments": {{"x": "7"}}}}\n</tool_call><|im_end|>'
        return tok.encode(text, add_special_tokens=False)

    call = ids("triple")
    room = len(prefix) + len(call) + 1  # one token over the turn: the call runs
    parser = ProtocolParser(tok, ToolTurns(PROTOCOLS.get("hermes"), tok, max_context_tokens=room))
    parsed = parse_response(parser, call, prefix=prefix, tools=[triple])
    assert parsed["tool_calls"] == [function_call("triple", {"x": 7})]  # "7" typed by the schema
    plain = ProtocolParser(tok, ToolTurns(PROTOCOLS.get("hermes"), tok))
    wrong = parse_response(plain, ids("double"), prefix=prefix, tools=[triple])
    assert wrong["tool_calls"] == [
        function_call(MALFORMED_CALL, {"message": "there is no tool named 'double'; the tools are: triple"})
    ]
    at_budget = ProtocolParser(tok, ToolTurns(PROTOCOLS.get("hermes"), tok, max_context_tokens=room - 1))
    assert "tool_calls" not in parse_response(at_budget, call, prefix=prefix, tools=[triple])
    assert at_budget._turns.context_stops == 1


def test_the_tool_loops_parser_leaves_other_calls_to_the_tokenizer():
    import copy

    from vlm_grpo.tools.rollouts import ProtocolParser

    class Tokenizer:
        def parse_response(self, response, schema=None, **kwargs):
            return {"raw": response, "schema": schema, **kwargs}

    tokenizer = Tokenizer()
    parser = ProtocolParser(tokenizer, ToolTurns(PROTOCOLS.get("hermes"), tokenizer))
    assert parser.parse_response([1, 2], {"type": "object"}) == {"raw": [1, 2], "schema": {"type": "object"}}
    assert parser.parse_response([1, 2], prefix=[0], other=3) == {
        "raw": [1, 2],
        "schema": None,
        "prefix": [0],
        "other": 3,
    }
    clone = copy.copy(parser)  # a copy (a trainer's state copied) still stands in for the same tokenizer
    assert clone.parse_response([4], {"s": 1}) == {"raw": [4], "schema": {"s": 1}}


def test_the_step_counts_start_again_from_zero(tokenizer):
    turns = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer, max_context_tokens=5, max_tool_images=0)
    ids = tokenizer.encode("<answer>1</answer><code>x</code>", add_special_tokens=False)
    turns.read({}, ids, 0, ["python"])
    turns.read({}, tokenizer.encode("<code>x</code>", add_special_tokens=False), 10, ["python"])
    turns.tools_for({"python": triple}, object(), 0)["python"](x=1)
    assert (turns.calls_after_answer, turns.context_stops, turns.image_refusals) == (1, 1, 1)
    turns.reset_counts()
    assert (turns.calls_after_answer, turns.context_stops, turns.image_refusals, turns.image_counts) == (0, 0, 0, {})


def test_a_rollouts_call_counts_add_up_over_its_turns(tokenizer):
    """``tools/calls_per_rollout`` and ``tools/errors_per_rollout`` add every call to what the rollout counted."""
    from vlm_grpo.tools.rollouts import build_tool_environment, malformed_call_tool

    env = build_tool_environment(["zoom_in"])()
    env.reset(images=[RED])
    env.calls, env.errors, env.successes = 5, 2, 3  # earlier turns
    turns = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer, max_tool_images=1)
    refused = turns.wrap(triple, env, 1, {"images": 1})
    assert refused(x=1)[0]["text"].startswith("<tool_response>\n<interpreter>Execution error: this conversation")
    assert (env.calls, env.errors, env.successes) == (6, 3, 3)
    env.successes += 1  # as run_tool counts a call that returned
    broken = turns.wrap(lambda: [image("not an image")], env, 1, {"images": 0})
    assert "str where an image was expected" in broken()[0]["text"]
    assert (env.calls, env.errors, env.successes) == (6, 4, 3)
    with pytest.raises(ValueError):
        malformed_call_tool(env)()
    assert (env.calls, env.errors) == (7, 5)


def test_calls_after_the_answer_and_context_stops_add_up_over_a_step(tokenizer):
    turns = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer, max_context_tokens=5)
    answered = tokenizer.encode("<answer>1</answer><code>x</code>", add_special_tokens=False)
    code = tokenizer.encode("<code>x</code>", add_special_tokens=False)
    for _ in range(2):
        turns.read({}, answered, 0, ["python"])
        turns.read({}, code, 10, ["python"])
    assert (turns.calls_after_answer, turns.context_stops) == (2, 2)


def test_images_without_a_record_are_numbered_after_the_earlier_ones_and_any_callable_is_a_tool(tokenizer):
    import functools

    pyvision = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer)
    tool = pyvision.wrap(lambda: [image(RED)], None, 2, {"images": 1})  # 2 prompt images, 1 tool image so far
    assert "<image_clue_3>" in [b.get("text") for b in tool()]
    partial = pyvision.wrap(functools.partial(triple, 2), None, 0, {"images": 0})  # no __name__
    assert partial.__name__ == "tool" and partial()[0]["text"].endswith(
        "Text Result:\n6</interpreter>\n\n</tool_response>"
    )
