"""DeepEyes parity: the ``deepeyes`` reward scores rollouts as DeepEyes' ``vl_agent.py`` does (expected numbers worked
out by hand from its definition: 0.8 acc + 0.2 format + 1.2 tool), its own function loaded as a plugin agrees, and
``image_zoom_in_tool`` clamps and grows boxes as DeepEyes does."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.rewards import REWARDS, build_reward_funcs
from vlm_grpo.rewards.tools import deepeyes_judge_template, deepeyes_reward
from vlm_grpo.tools import TOOLS, ToolError, make_environment_factory
from vlm_grpo.tools.image import DEEPEYES_TURN_PROMPT

IMG = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
TOOL_TURN = (
    "<think>find the frame</think>\n<tool_call>\n"
    '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [1, 2, 40, 50]}}\n</tool_call>\n'
    f"<tool_response>\n{IMG}\n</tool_response>\n"
)
LONG = "a" * 999

# (case, response text, ground truth, expected with rule "vstar", expected with rule "common"), by hand:
TABLE = [
    ("tool, right", TOOL_TURN + "<think>it reads 12</think><answer>12</answer>", "12", 2.0, 2.0),
    ("no tool, right", "<think>x</think><answer>12</answer>", "12", 0.8, 0.8),
    ("tool, wrong", TOOL_TURN + "<think>y</think><answer>13</answer>", "12", 0.0, 0.0),
    ("tool, right, think unbalanced", TOOL_TURN + "<think>y<answer>12</answer>", "12", 1.8, 1.8),
    ("bare answer, no tags", "12", "12", 0.8, -0.2),
    ("999-char answer, right", TOOL_TURN + f"<answer>{LONG}</answer>", LONG, 2.0, 2.0),
    ("1000-char answer, right", TOOL_TURN + f"<answer>{LONG}a</answer>", LONG + "a", -0.2, -0.2),
    ("two answers", "<think>x</think><answer>13</answer><answer>12</answer>", "12", 0.8, 0.0),
    ("image markers unbalanced", "<think>a</think><|vision_start|><|image_pad|><answer>12</answer>", "12", 1.8, 1.8),
    ("answer before think", "<answer>12</answer><think>x</think>", "12", 0.8, -0.2),
    ("answer not closed", "<think>x</think><answer>12", "12", 0.6, -0.2),
    ("two tool images, right", TOOL_TURN * 2 + "<think>z</think><answer>12</answer>", "12", 2.0, 2.0),
    ("empty answer", "<think>x</think><answer></answer>", "12", 0.0, -0.2),
    ("tool, never answered", TOOL_TURN, "12", 0.0, -0.2),
]
INTERNVL = "<think>a</think><tool_response><img><IMG_CONTEXT><IMG_CONTEXT></img></tool_response><answer>12</answer>"


def score(texts, solutions, rule="vstar", **kwargs):
    n = len(texts)
    return deepeyes_reward(texts, solution=solutions, accu_reward_method=["exact"] * n, rule=rule, **kwargs)


@pytest.mark.parametrize("rule", ["vstar", "common"])
def test_the_table_worked_out_by_hand(rule):
    texts = [t for _, t, _, _, _ in TABLE]
    solutions = [s for _, _, s, _, _ in TABLE]
    expected = [v if rule == "vstar" else c for _, _, _, v, c in TABLE]
    got = score(texts, solutions, rule)
    assert [round(g, 6) for g in got] == pytest.approx(expected), list(zip([c for c, *_ in TABLE], got, strict=True))
    assert REWARDS.get("deepeyes") is deepeyes_reward


def test_the_old_weight_would_fail_the_table():  # negative control: the tool weight DeepEyes does not use
    got = score([TABLE[0][1]], ["12"], tool_weight=0.4)
    assert got != pytest.approx([TABLE[0][3]])


def test_internvl_image_markers_count_as_tool_images():
    assert score([INTERNVL], ["12"]) == pytest.approx([2.0])


def test_message_rollouts_are_read_with_their_tool_images():
    image = Image.new("RGB", (8, 8))
    call = {"type": "function", "function": {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 4, 4]}}}

    def rollout(tool_content, final="<think>b</think><answer>12</answer>"):
        return [
            {"role": "assistant", "content": "<think>find</think>", "tool_calls": [call]},
            {"role": "tool", "name": "image_zoom_in_tool", "content": tool_content},
            {"role": "assistant", "content": final},
        ]

    ok = rollout([{"type": "image", "image": image}, {"type": "text", "text": DEEPEYES_TURN_PROMPT}])
    failed = rollout("{'error': 'ZOOM IN ARGUMENTS ARE INVALID'}")
    wrong = rollout([{"type": "image", "image": image}], final="<think>b</think><answer>13</answer>")
    for rule in ("vstar", "common"):
        assert score([ok, failed, wrong], ["12"] * 3, rule) == pytest.approx([2.0, 0.8, 0.0])


@pytest.mark.parametrize(("rule", "function"), [("vstar", "compute_score"), ("common", "compute_common_reasoning")])
def test_deepeyes_own_function_as_a_plugin_agrees(rule, function):
    plugin = Path(__file__).with_name("deepeyes_vl_agent.py")
    (theirs,) = build_reward_funcs([f"{plugin}:{function}"])
    assert theirs.kind == "verl"
    texts = [t for _, t, _, _, _ in TABLE]
    solutions = [s for _, _, s, _, _ in TABLE]
    columns = {"solution": solutions, "question": ["What is the number?"] * len(texts)}
    expected = theirs(texts, **columns)
    assert score(texts, solutions, rule) == pytest.approx(expected)
    assert expected == pytest.approx([v if rule == "vstar" else c for _, _, _, v, c in TABLE])


def test_the_judge_prompt_is_deepeyes():
    vstar = Path(deepeyes_judge_template("vstar")).read_text()
    assert vstar.count("Judgement:") == 8 and vstar.endswith("[Model_answer] : {answer}\nJudgement:")
    assert "[Standard Answer]: {solution}" in vstar and "[Question]: {question}" in vstar
    common = Path(deepeyes_judge_template("common")).read_text()
    assert "## Equivalence Judgement" in common and common.endswith("## Student Final Answer\n{answer}")


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="vstar"):
        score(["<answer>1</answer>"], ["1"], rule="v*")


# ------------------------------------------------------------------------------------------- the zoom tool
def gradient(width=200, height=100):
    image = Image.new("RGB", (width, height))
    image.putdata([(x % 256, y % 256, (x * y) % 256) for y in range(height) for x in range(width)])
    return image


def environment(image, coord_sizes=None, version="v5"):
    """The tool in DeepEyes' tool box ``version`` (the geometry tests below are v5's; v2's table follows)."""
    options = {} if version is None else {"image_zoom_in_tool": {"version": version}}
    env = make_environment_factory([TOOLS.get("image_zoom_in_tool")], options)()
    env.reset(images=[image], **({"coord_sizes": coord_sizes} if coord_sizes else {}))
    return env


def crop_of(result, prompt=DEEPEYES_TURN_PROMPT):
    image, text = result
    assert text == {"type": "text", "text": prompt}
    return image["image"]


def test_zoom_crops_the_box_and_returns_deepeyes_reply():
    image = gradient()
    env = environment(image)
    region = crop_of(env.image_zoom_in_tool(bbox_2d=[20, 10, 80, 70], label="frame"))
    assert region.size == (60, 60) and region.tobytes() == image.crop((20, 10, 80, 70)).tobytes()
    assert len(env.images) == 2 and env.successes == 1


def test_out_of_range_boxes_are_clamped():
    image = gradient()
    region = crop_of(environment(image).image_zoom_in_tool(bbox_2d=[150, -40, 260, 60]))
    assert region.tobytes() == image.crop((150, 0, 200, 60)).tobytes()  # clamped to x <= 200, y >= 0


def test_boxes_under_28_pixels_grow_around_their_centre():
    image = gradient()
    # 10 x 20: ratio 28/10 = 2.8, half sides ceil(14) and ceil(28) around (105, 50) -> [91, 22, 119, 78]
    region = crop_of(environment(image).image_zoom_in_tool(bbox_2d=[100, 40, 110, 60]))
    assert region.size == (28, 56) and region.tobytes() == image.crop((91, 22, 119, 78)).tobytes()
    # 28 x 28 exactly is left alone; 27 wide grows
    assert crop_of(environment(image).image_zoom_in_tool(bbox_2d=[0, 0, 28, 28])).size == (28, 28)
    assert crop_of(environment(image).image_zoom_in_tool(bbox_2d=[0, 0, 27, 28])).size[0] >= 28


def test_boxes_in_the_models_frame_map_to_pixels():
    image = gradient(400, 200)  # a 0-1000 frame (Qwen2-VL, InternVL)
    region = crop_of(environment(image, [(1000, 1000)]).image_zoom_in_tool(bbox_2d=[100, 100, 500, 600]))
    assert region.tobytes() == image.crop((40, 20, 200, 120)).tobytes()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"bbox_2d": [50, 50, 40, 60]}, "ZOOM IN ARGUMENTS ARE INVALID"),  # inverted
        ({"bbox_2d": [300, 10, 400, 60]}, "ZOOM IN ARGUMENTS ARE INVALID"),  # wholly outside: empty once clamped
        ({"bbox_2d": [0, 0, 199, 1.5]}, "ZOOM IN ARGUMENTS ARE INVALID"),  # aspect over 100
        ({"bbox_2d": [1, 2, 3]}, "list of 4 numbers"),
        ({"bbox_2d": ["a", 2, 3, 4]}, "4 numbers"),
        ({"bbox_2d": [0, 0, float("nan"), 4]}, "finite"),
        ({"bbox": [0, 0, 40, 40]}, "bad arguments for image_zoom_in_tool"),  # wrong argument name
        ({"bbox_2d": [0, 0, 40, 40], "image_index": 1}, "bad arguments"),  # DeepEyes' tool has no image_index
    ],
)
def test_bad_calls_are_tool_errors_the_model_reads(arguments, message):
    env = environment(gradient())
    with pytest.raises(ToolError, match=message):
        env.image_zoom_in_tool(**arguments)
    assert env.errors == 1 and len(env.images) == 1


def test_an_aspect_of_exactly_100_is_accepted():
    # 200 x 2 grows by 28/2 = 14 on both sides (the aspect stays): half sides 1400 and 14 around (100, 1)
    region = crop_of(environment(gradient()).image_zoom_in_tool(bbox_2d=[0, 0, 200, 2]))
    assert region.size == (2800, 28)


# DeepEyes' visual_toolbox_v2 (the default: DeepEyes' README trains on its data): clamp to the image, then refuse a
# box that is empty, inverted, over 100:1, or whose shorter side is 30 px or less; never grow. Boxes in pixels of a
# 200 x 100 image; expected crops worked out by hand from that rule.
V2_TABLE = [
    ([20, 10, 80, 70], (20, 10, 80, 70)),  # inside, 60 x 60
    ([0, 0, 31, 31], (0, 0, 31, 31)),  # just over 30 on both sides
    ([0, 0, 30, 40], None),  # 30 wide: refused (needs > 30)
    ([0, 0, 40, 30], None),
    ([150, -40, 260, 60], (150, 0, 200, 60)),  # clamped: 50 x 60
    ([170, 0, 260, 60], None),  # clamped to 30 wide: refused
    ([169, 0, 260, 60], (169, 0, 200, 60)),  # clamped to 31 wide
    ([100, 40, 110, 60], None),  # 10 x 20: v5 grows it, v2 refuses it
    ([50, 50, 40, 60], None),  # inverted
    ([0, 0, 200, 2], None),  # aspect 100 but 2 high
]


@pytest.mark.parametrize(("box", "crop"), V2_TABLE)
@pytest.mark.parametrize("version", ["v2", None])  # None: no option, the default is v2
def test_v2_box_rules(box, crop, version):
    from vlm_grpo.tools.protocols import DEEPEYES_USER_PROMPT

    image = gradient()
    env = environment(image, version=version)
    if crop is None:
        with pytest.raises(ToolError, match="ZOOM IN ARGUMENTS ARE INVALID"):
            env.image_zoom_in_tool(bbox_2d=box)
        return
    region = crop_of(env.image_zoom_in_tool(bbox_2d=box), DEEPEYES_USER_PROMPT)
    assert region.tobytes() == image.crop(crop).tobytes()


# v5 on the same boxes: clamp, grow a side under 28 around the centre, refuse only empty / inverted / over 100:1.
V5_TABLE = [
    ([0, 0, 30, 40], (0, 0, 30, 40)),
    ([170, 0, 260, 60], (170, 0, 200, 60)),
    ([100, 40, 110, 60], (91, 22, 119, 78)),  # 10 x 20 -> ratio 2.8, halves 14 and 28 around (105, 50)
    ([0, 0, 27, 28], (-1, -1, 28, 29)),  # ratio 28/27: halves ceil(14) and ceil(14.52) around (13.5, 14)
    ([50, 50, 40, 60], None),
]


@pytest.mark.parametrize(("box", "crop"), V5_TABLE)
def test_v5_box_rules(box, crop):
    image = gradient()
    env = environment(image, version="v5")
    if crop is None:
        with pytest.raises(ToolError, match="ZOOM IN ARGUMENTS ARE INVALID"):
            env.image_zoom_in_tool(bbox_2d=box)
        return
    assert crop_of(env.image_zoom_in_tool(bbox_2d=box)).tobytes() == image.crop(crop).tobytes()


def test_an_unknown_version_is_refused_when_the_run_starts():
    with pytest.raises(ValueError, match="version must be one of v2, v5"):
        make_environment_factory([TOOLS.get("image_zoom_in_tool")], {"image_zoom_in_tool": {"version": "v3"}})


def test_v5_runs_the_first_three_calls_and_v2_the_last():
    from vlm_grpo.tools.protocols import DEEPEYES_TURN_PROMPT_V5, DeepEyesProtocol

    blocks = [f'<tool_call>{{"name": "image_zoom_in_tool", "arguments": {{"bbox_2d": [{i}, 0, 40, 40]}}}}</tool_call>'
              for i in range(4)]  # fmt: skip
    v2, v5 = DeepEyesProtocol("v2"), DeepEyesProtocol("v5")
    assert [c["function"]["arguments"]["bbox_2d"][0] for c in v5.parse("".join(blocks)).calls] == [0, 1, 2]
    assert [c["function"]["arguments"]["bbox_2d"][0] for c in v2.parse("".join(blocks)).calls] == [3]
    bad = blocks[0] + "<tool_call>{oops}</tool_call>"
    assert v5.parse(bad).calls == [] and v5.parse(bad).error.startswith("Expecting property name")
    assert v2.parse(bad).error.startswith("Invalid tool call format: {oops}. Error: Expecting property name")
    # the turn prompt once after the replies; none after errors alone
    image = Image.new("RGB", (4, 4))
    joined = v5.join([v5.reply([{"type": "image", "image": image}], 1), v5.error("boom", False)])
    assert [b.get("text") for b in joined] == ["<tool_response>\n", None, "\n</tool_response>\n", "Error: boom",
                                              DEEPEYES_TURN_PROMPT_V5]  # fmt: skip
    assert [b["text"] for b in v5.join([v5.error("boom", False)])] == ["Error: boom"]
