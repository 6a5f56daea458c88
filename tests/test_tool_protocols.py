"""Tool protocols without a model: what each one reads as a call, the reply text it words, the stops and budgets,
what rewards read of a rollout, and the flags. Expected texts are written out from PyVision's and DeepEyes' own
observation strings."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from PIL import Image

from vlm_grpo.rewards import REWARDS, completion_text
from vlm_grpo.rewards.turns import final_answer, final_turn, model_turns, tool_observations
from vlm_grpo.tools.protocols import PROTOCOLS, PYVISION_NO_CODE, function_call, resolve_protocol
from vlm_grpo.tools.rollout_text import rollout_messages
from vlm_grpo.tools.rollouts import MALFORMED_CALL, ToolTurns, build_tool_environment, tool_turns

PYTHON = "python"
ZOOM = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 30, 40]}}\n</tool_call>'


def calls_of(protocol: str, text: str) -> tuple[list, str | None, bool]:
    turn = PROTOCOLS.get(protocol).parse(text, None)
    return turn.calls, turn.error, turn.answered


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("<think>a</think><code>\n```python\nprint(1)\n```\n</code>", "print(1)"),
        ("x\n```python\nprint(2)\n```\nthen", "print(2)"),
        ("<code>print(3)</code>", "print(3)"),
        # the last block of the turn; PyVision's <code>-wrapped fence before a bare fence
        ("```python\na = 1\n```\n<code>\n```python\nb = 2\n```\n</code>\n```python\nc = 3\n```", "b = 2"),
        ("```python\na = 1\n```\n```python\nc = 3\n```", "c = 3"),
    ],
)
def test_pyvision_runs_the_last_code_block_in_the_python_tool(text, code):
    assert calls_of("pyvision", text) == ([function_call(PYTHON, {"code": code})], None, False)


def test_pyvision_without_code_or_answer_is_told_and_an_answer_runs_nothing():
    assert calls_of("pyvision", "I think it is red.") == ([], PYVISION_NO_CODE, False)
    assert calls_of("pyvision", "```python\nprint(1)\n```<answer>red</answer>") == ([], None, True)
    assert calls_of("pyvision", "<answer>red") == ([], PYVISION_NO_CODE, False)  # unclosed: no answer


def test_deepeyes_runs_the_last_call_and_words_bad_json_as_deepeyes_does():
    two = ZOOM + '\n<tool_call>\n{"name": "rotate", "arguments": {"angle": 90}}\n</tool_call>'
    assert calls_of("deepeyes", two) == ([function_call("rotate", {"angle": 90})], None, False)
    assert calls_of("deepeyes", "no call") == ([], None, False)  # the rollout ends, as in DeepEyes
    calls, error, _ = calls_of("deepeyes", "<tool_call>{not json}</tool_call>")
    assert calls == [] and error.startswith("Invalid tool call format: {not json}. Error: Expecting property name")
    _, error, _ = calls_of("deepeyes", '<tool_call>{"name": "zoom_in"}</tool_call>')
    assert error == "'arguments'"  # DeepEyes: a KeyError after the JSON parsed is worded "Error: {e}"
    assert calls_of("deepeyes", ZOOM + "<answer>3</answer>") == ([], None, True)


def test_pyvision_replies_as_pyvision_does():
    pyvision = PROTOCOLS.get("pyvision")
    assert pyvision.reply("size (4, 5)\n", 1) == [
        {
            "type": "text",
            "text": "<tool_response>\n<interpreter>\nText Result:\nsize (4, 5)</interpreter>\n\n</tool_response>",
        }
    ]
    image = Image.new("RGB", (8, 8))
    shown = [
        {"type": "text", "text": "hi\n[2 image(s) shown: image_clue_3, image_clue_4]"},
        {"type": "image", "image": image},
    ]
    shown.append({"type": "image", "image": image})
    reply = pyvision.reply(shown, 3)
    texts = "".join(b.get("text", "<IMG>") for b in reply)
    assert texts == (
        "<tool_response>\n<interpreter>Text Result:\nhi\nImage Result:\n<image_clue_3><IMG></image_clue_3>"
        "<image_clue_4><IMG></image_clue_4></interpreter>\n\n</tool_response>"
    )
    only_images = "".join(
        b.get("text", "<IMG>") for b in pyvision.reply([{"type": "text", "text": "(no output)"}, shown[1]], 1)
    )
    assert only_images.startswith("<tool_response>\n<interpreter>Image Result:\n<image_clue_1><IMG>")
    error = pyvision.error("NameError: x", malformed=False)[0]["text"]
    assert error == "<tool_response>\n<interpreter>Execution error: NameError: x</interpreter>\n\n</tool_response>"
    assert pyvision.error(PYVISION_NO_CODE, malformed=True)[0]["text"] == (
        "<tool_response>\n<interpreter>Error: No Python code or final answer found. There is something wrong with "
        "the format.</interpreter>\n\n</tool_response>"
    )


def test_deepeyes_replies_as_deepeyes_does():
    deepeyes = PROTOCOLS.get("deepeyes")
    image = Image.new("RGB", (8, 8))
    reply = deepeyes.reply([{"type": "text", "text": "Zoomed in"}, {"type": "image", "image": image}], 1)
    assert [b.get("text", "<image>") for b in reply] == [
        "<tool_response>",
        "<image>",
        "\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  <think>...</think>  "
        "<tool_call>...</tool_call> (if tools needed)  <answer>...</answer> </tool_response>",
    ]
    assert deepeyes.error("bad box", malformed=False) == [{"type": "text", "text": "Error: bad box"}]


@pytest.fixture(scope="module")
def tokenizer():
    from vlm_grpo.testing.tiny import build_tokenizer

    return build_tokenizer("qwen2_5_vl")


def test_a_turn_with_the_answer_runs_nothing_and_is_counted(tokenizer):
    turns = ToolTurns(PROTOCOLS.get("hermes"), tokenizer)
    call = function_call("zoom_in", {"bbox_2d": [1, 2, 30, 40]})
    ids = tokenizer.encode("<answer>4</answer>" + ZOOM, add_special_tokens=False)
    message = turns.read({"role": "assistant", "content": "", "tool_calls": [call]}, ids, 10, ["zoom_in"])
    assert "tool_calls" not in message and turns.calls_after_answer == 1
    ids = tokenizer.encode("4" + ZOOM, add_special_tokens=False)  # control: no answer, the call stays
    message = turns.read({"role": "assistant", "content": "", "tool_calls": [call]}, ids, 10, ["zoom_in"])
    assert message["tool_calls"] == [call] and turns.calls_after_answer == 1


def test_the_context_budget_stops_calls_at_the_limit_not_under_it(tokenizer):
    ids = tokenizer.encode("```python\nprint(1)\n```", add_special_tokens=False)
    for context, stopped in ((100 - len(ids) - 1, False), (100 - len(ids), True), (100 - len(ids) + 1, True)):
        turns = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer, max_context_tokens=100)
        message = turns.read({"role": "assistant", "content": ""}, ids, context, [PYTHON])
        assert ("tool_calls" not in message) == stopped and turns.context_stops == int(stopped)


def test_unknown_tools_and_malformed_actions_become_the_hidden_tools_call(tokenizer):
    turns = ToolTurns(PROTOCOLS.get("deepeyes"), tokenizer)
    ids = tokenizer.encode('<tool_call>{"name": "image_zoom", "arguments": {}}</tool_call>', add_special_tokens=False)
    message = turns.read({"role": "assistant", "content": ""}, ids, 0, ["zoom_in", "rotate"])
    assert message["tool_calls"] == [
        function_call(
            MALFORMED_CALL, {"message": "there is no tool named 'image_zoom'; the tools are: rotate, zoom_in"}
        )
    ]
    ids = tokenizer.encode("<tool_call>{oops</tool_call>", add_special_tokens=False)
    message = turns.read({"role": "assistant", "content": ""}, ids, 0, ["zoom_in"])
    assert message["tool_calls"][0]["function"]["name"] == MALFORMED_CALL


def quadrants():
    return Image.new("RGB", (100, 80), (255, 0, 0))


def two_images(env) -> list:
    """Shows two images.

    Returns:
        two images
    """
    return [{"type": "text", "text": "two"}, *({"type": "image", "image": quadrants()} for _ in range(2))]


@pytest.mark.parametrize("protocol", ["deepeyes", "hermes"])
def test_the_image_budget_just_under_at_and_over(protocol, tokenizer):
    env = build_tool_environment(["zoom_in"])()
    env.reset(images=[quadrants()])
    turns = ToolTurns(PROTOCOLS.get(protocol), tokenizer, max_tool_images=2)
    counts = {"images": 0}
    zoom = turns.wrap(env.zoom_in, env, 1, counts)
    for _ in range(2):  # under the budget, then reaching it: images come back
        reply = zoom(bbox_2d=[0, 0, 50, 40])
        assert any(b.get("type") == "image" for b in reply)
    assert counts["images"] == 2 and turns.image_refusals == 0
    if protocol == "hermes":  # over it: an error the model reads (TRL words a raised one)
        with pytest.raises(ValueError, match="already holds 2 tool images"):
            zoom(bbox_2d=[0, 0, 50, 40])
    else:
        assert zoom(bbox_2d=[0, 0, 50, 40])[0]["text"].startswith("Error: this conversation already holds 2")
    assert turns.image_refusals == 1 and env.errors == 1 and counts["images"] == 2

    many = ToolTurns(PROTOCOLS.get(protocol), tokenizer, max_tool_images=1)
    reply = many.wrap(lambda: two_images(None), None, 1, {"images": 0})()
    assert sum(b.get("type") == "image" for b in reply) == 1
    if protocol == "hermes":  # DeepEyes' reply shows the images only
        assert "1 more image(s) not shown: --max_tool_images 1" in "".join(b.get("text", "") for b in reply)


def test_errors_of_a_call_are_worded_by_the_protocol(tokenizer):
    def broken(**kwargs):
        raise RuntimeError("boom")

    pyvision = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer).wrap(broken, None, 1, {"images": 0})
    assert pyvision(code="x")[0]["text"] == (
        "<tool_response>\n<interpreter>Execution error: boom</interpreter>\n\n</tool_response>"
    )
    hermes = ToolTurns(PROTOCOLS.get("hermes"), tokenizer).wrap(broken, None, 1, {"images": 0})
    with pytest.raises(ValueError, match=r"^boom$"):
        hermes(code="x")


def test_rewards_receive_the_rollout_as_written_and_read(tokenizer):
    """Rebuilt from the tokens: the model's turns with think and calls, the reply with one image marker."""
    first = "<think>look</think>" + ZOOM
    reply = "\n<|im_start|>user\n<tool_response>\n<|vision_start|>" + "<|image_pad|>" * 5 + "<|vision_end|>printed "
    reply += "<answer>9</answer>\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    last = "<think>ok</think><answer>4</answer>"
    parts = [(first + "<|im_end|>", 1), (reply, 0), (last + "<|im_end|>", 1)]
    ids, mask = [], []
    for text, m in parts:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [m] * len(piece)
    call = function_call("zoom_in", {"bbox_2d": [1, 2, 30, 40]})
    trl_turns = [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "name": "zoom_in"}]
    completion = rollout_messages(tokenizer, ids, mask, [*trl_turns, {"role": "assistant", "content": "4"}])
    observation = (
        "<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>printed <answer>9</answer>\n</tool_response>"
    )
    assert completion == [
        {"role": "assistant", "content": first, "tool_calls": [call]},
        {"role": "tool", "content": observation, "names": ["zoom_in"]},
        {"role": "assistant", "content": last},
    ]
    assert completion_text(completion) == first + observation + last
    assert model_turns(completion) == [first, last] and tool_observations(completion) == [observation]
    assert final_turn(completion) == last and final_answer(completion) == "4"

    # Graders read the final answer only: the <answer> the tool printed is never graded
    accuracy = REWARDS.get("accuracy")
    assert accuracy([completion], solution=["<answer>9</answer>"]) == [0.0]
    assert accuracy([completion], solution=["<answer>4</answer>"]) == [1.0]
    printed_only = [*completion[:2], {"role": "assistant", "content": "<think>ok</think> no idea"}]
    assert accuracy([printed_only], solution=["<answer>9</answer>"]) == [0.0]
    # control: the whole text's last <answer> is the printed one
    assert accuracy([completion_text(printed_only)], solution=["<answer>9</answer>"]) == [1.0]


@pytest.mark.parametrize(
    "last",
    ["<think>ok</think><answer>4</answer>", "<think>ok</think> <answer>4</answer>", "<answer>4</answer>", ZOOM, ""],
)
def test_format_scores_a_tool_rollout_as_the_single_turn_text_of_its_answer(last):
    completion = [
        {"role": "assistant", "content": "<think>look</think>" + ZOOM},
        {"role": "tool", "content": "<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>\n</tool_response>"},
        {"role": "assistant", "content": last},
    ]
    fmt = REWARDS.get("format")
    assert fmt([completion]) == fmt([last]) == fmt([[{"role": "assistant", "content": last}]])
    if last.startswith("<think>"):
        assert fmt([completion]) == [1.0] and fmt([completion_text(completion)]) == [0.0]  # control: the whole text


def test_the_protocol_comes_from_the_flag_else_the_tools_else_hermes(tokenizer):
    def image_zoom_in_tool(env, bbox_2d: list) -> str:
        """Zoom.

        Args:
            bbox_2d: box
        """
        return ""

    image_zoom_in_tool.protocol = "deepeyes"
    assert resolve_protocol(None, [image_zoom_in_tool]).name == "deepeyes"
    assert resolve_protocol("hermes", [image_zoom_in_tool]).name == "hermes"
    assert resolve_protocol(None, []).name == "hermes"
    with pytest.raises(KeyError, match=r"Unknown tool protocol 'pyvison'\. Available: deepeyes, hermes, pyvision"):
        resolve_protocol("pyvison")
    with pytest.raises(ValueError, match="--tool_protocol pyvision runs the python tool: add it to --tools"):
        tool_turns([], build_tool_environment(["zoom_in"]), tokenizer, "pyvision")
    with pytest.raises(ValueError, match="--max_tool_images must be"):
        tool_turns([], build_tool_environment(["zoom_in"]), tokenizer, "hermes", max_tool_images=-1)


class Budgeted:
    """What ``VLMGRPOTrainer._generate_single_turn`` reads of the trainer; every row writes 10 tokens."""

    def __init__(self, max_turn_tokens=None, max_context_tokens=None, in_loop=False):
        self.max_turn_tokens = max_turn_tokens
        self._tool_turns = SimpleNamespace(max_context_tokens=max_context_tokens, protocol=SimpleNamespace(stop=()))
        self.max_completion_length = 50
        self.generation_config = SimpleNamespace(max_new_tokens=50)
        self._in_tool_loop = in_loop
        self._round_sync = None  # one process: no round votes
        self._turn_cache = None  # no held caches, no early tool calls
        self.asked = None

    def _generate_within_budgets(self, *args):
        from vlm_grpo.trainer import VLMGRPOTrainer

        return VLMGRPOTrainer._generate_within_budgets(self, *args)

    def _generate_turn(self, prompt_ids, images, fields, num_generations, has_tool_images=False):
        self.asked = self.generation_config.max_new_tokens
        return [list(range(10)) for _ in prompt_ids], [[0.5] * 10 for _ in prompt_ids]


def test_per_turn_and_context_budgets_cut_each_turn():
    from vlm_grpo.trainer import VLMGRPOTrainer

    generate = VLMGRPOTrainer._generate_single_turn
    for limit in (9, 10, 11):  # just under, at and over what the rows write
        trainer = Budgeted(max_turn_tokens=limit)
        ids, logprobs = generate(trainer, [[1] * 3, [1] * 7], None, {}, 1)
        assert [len(r) for r in ids] == [min(limit, 10)] * 2 and [len(r) for r in logprobs] == [min(limit, 10)] * 2
        assert trainer.asked == limit and trainer.generation_config.max_new_tokens == 50  # restored
    trainer = Budgeted(max_context_tokens=12, in_loop=True)  # rows of 3 and 7 context tokens, 20 and 30: none left
    ids, _ = generate(trainer, [[1] * 3, [1] * 7, [1] * 12, [1] * 30], None, {}, 1)
    assert [len(r) for r in ids] == [9, 5, 0, 0]
    trainer = Budgeted(max_context_tokens=12)  # a first turn keeps one token
    ids, _ = generate(trainer, [[1] * 12], None, {}, 4)
    assert [len(r) for r in ids] == [1]


def test_flags_parse_and_sft_refuses_the_budgets(tmp_path):
    from vlm_grpo.cli_errors import UserError
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.sft_jsonl import build_trainer
    from vlm_grpo.sft_jsonl import parse_args as sft_args

    script, *_ = parse_args(
        [
            *("--model_name_or_path", "m", "--tools", "python", "--tool_protocol", "pyvision"),
            *("--max_turn_tokens", "64", "--max_tool_images", "3", "--max_context_tokens", "4096"),
        ]
    )
    assert (script.tool_protocol, script.max_turn_tokens, script.max_tool_images) == ("pyvision", 64, 3)
    assert script.max_context_tokens == 4096
    argv = ["--model_name_or_path", str(tmp_path / "never-loaded"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(UserError, match="--max_context_tokens: vlm-grpo-sft generates nothing"):
        build_trainer(*sft_args([*argv, "--tools", "zoom_in", "--max_context_tokens", "64"]))
    with pytest.raises(UserError, match="--tool_protocol without --tools"):
        build_trainer(*sft_args([*argv, "--tool_protocol", "hermes"]))


@pytest.mark.parametrize(
    ("image", "why"),
    [
        (Image.new("RGB", (1, 201)), "1x201 image"),  # over the processors' 200:1 aspect ratio
        ("not an image", "str where an image was expected"),
        (None, "NoneType where an image was expected"),
    ],
)
@pytest.mark.parametrize("protocol", ["pyvision", "hermes"])
def test_an_image_the_processor_cannot_take_is_a_tool_error(protocol, image, why, tokenizer):
    env = build_tool_environment(["zoom_in"])()
    env.reset(images=[quadrants()])
    env.successes = env.calls = 1  # as run_tool counts a call that returned

    def returns(**kwargs):
        return [{"type": "text", "text": "here"}, {"type": "image", "image": image}]

    tool = ToolTurns(PROTOCOLS.get(protocol), tokenizer).wrap(returns, env, 1, {"images": 0})
    if protocol == "hermes":
        with pytest.raises(ValueError, match=why):
            tool()
    else:
        assert why in tool()[0]["text"] and "Execution error" in tool()[0]["text"]
    assert env.errors >= 1 and env.successes <= 0


def test_images_the_processor_takes_pass_as_rgb(tokenizer):
    def returns(**kwargs):
        return [
            {"type": "image", "image": Image.new("L", (1, 200))},
            {"type": "image", "image": Image.new("P", (9, 9))},
        ]

    reply = ToolTurns(PROTOCOLS.get("hermes"), tokenizer).wrap(returns, None, 1, {"images": 0})()
    assert [b["image"].mode for b in reply] == ["RGB", "RGB"] and reply[0]["image"].size == (1, 200)


def test_tool_flags_are_checked_before_a_model_loads(tmp_path):
    from vlm_grpo.cli_errors import UserError
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.tools.rollouts import check_tool_flags

    def check(*argv):
        check_tool_flags(parse_args(["--model_name_or_path", "never-loaded", *argv])[0])

    check("--tools", "zoom_in", "--tool_protocol", "deepeyes", "--max_tool_images", "0")  # fine
    with pytest.raises(UserError, match=r"--tool_protocol, --max_turn_tokens without --tools"):
        check("--tool_protocol", "hermes", "--max_turn_tokens", "8")
    with pytest.raises(UserError, match="Unknown tool protocol 'pyvison'"):
        check("--tools", "python", "--tool_protocol", "pyvison")
    with pytest.raises(ValueError, match="--tool_protocol pyvision runs the python tool"):
        check("--tools", "zoom_in", "--tool_protocol", "pyvision")
    with pytest.raises(UserError, match="--max_turn_tokens must be a positive"):
        check("--tools", "zoom_in", "--max_turn_tokens", "0")
    with pytest.raises(ValueError, match="--max_context_tokens must be a positive"):
        check("--tools", "zoom_in", "--max_context_tokens", "0")

    # A protocol of the user's own, by file: the class or an instance
    plugin = tmp_path / "my_protocol.py"
    plugin.write_text(
        "from vlm_grpo.tools.protocols import HermesProtocol\n\n"
        "class Bracket(HermesProtocol):\n    name = 'bracket'\n\n"
        "INSTANCE = Bracket()\nNOT_ONE = 3\n"
    )
    for spec in (f"{plugin}:Bracket", f"{plugin}:INSTANCE"):
        turns = tool_turns([], build_tool_environment(["zoom_in"]), None, spec)
        assert turns.protocol.name == "bracket"
    with pytest.raises(ValueError, match="is not a ToolProtocol"):
        check("--tools", "zoom_in", "--tool_protocol", f"{plugin}:NOT_ONE")


def test_image_clues_are_numbered_by_conversation_index(tokenizer):
    """Two prompt images, then a call returning a grey image (converted to RGB for the processor): it is
    image_clue_2, the index the environment gave it; a second call's image is image_clue_3."""
    env = build_tool_environment(["zoom_in"])()
    env.reset(images=[quadrants(), quadrants()])

    def grey(**kwargs):
        return [{"type": "image", "image": Image.new("L", (40, 40))}]

    def shown(**kwargs):
        image = grey()[0]["image"]
        env._add_image(image)
        return [{"type": "image", "image": image}]

    tool = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer).wrap(shown, env, 2, {"images": 0})
    for index in (2, 3):
        texts = [b["text"] for b in tool() if b["type"] == "text"]
        assert f"<image_clue_{index}>" in texts and f"</image_clue_{index}>" in texts
    plain = ToolTurns(PROTOCOLS.get("pyvision"), tokenizer).wrap(grey, None, 2, {"images": 0})  # no environment
    assert "<image_clue_2>" in [b.get("text") for b in plain()]
