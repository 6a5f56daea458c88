"""Tool registry, options, image tools (hand-computed crops, every bad argument) and the tool rewards."""

from __future__ import annotations

import pytest
from PIL import Image
from transformers.utils import get_json_schema

from vlm_grpo.grpo_jsonl import parse_args
from vlm_grpo.rewards import REWARDS
from vlm_grpo.rewards.tools import deepeyes_reward, tool_format_reward, tool_use_reward
from vlm_grpo.tools import TOOLS, ToolError, make_environment_factory, parse_tool_kwargs
from vlm_grpo.tools.rollouts import build_tool_environment


def quadrants(width: int = 100, height: int = 80) -> Image.Image:
    """Red top-left, green top-right, blue bottom-left, white bottom-right."""
    img = Image.new("RGB", (width, height), (255, 255, 255))
    img.paste((255, 0, 0), (0, 0, width // 2, height // 2))
    img.paste((0, 255, 0), (width // 2, 0, width, height // 2))
    img.paste((0, 0, 255), (0, height // 2, width // 2, height))
    return img


def colors(image: Image.Image) -> set[tuple[int, int, int]]:
    return {color for _, color in image.getcolors()}


def env_with(tools=("zoom_in", "crop", "rotate"), coord_sizes=None, kwargs=None):
    env = build_tool_environment(list(tools), kwargs)()
    row = {"images": [quadrants()], "solution": "x"}
    if coord_sizes is not None:
        row["coord_sizes"] = coord_sizes
    env.reset(**row)
    return env


def test_unknown_tool_lists_the_available_ones():
    with pytest.raises(KeyError) as info:
        build_tool_environment(["zoom"])
    assert str(info.value) == "Unknown tool 'zoom'. Available: crop, image_zoom_in_tool, python, rotate, zoom_in"


def test_plugin_tool_from_a_file_gets_the_rows_images(tmp_path):
    plugin = tmp_path / "my_tools.py"
    plugin.write_text(
        "def image_width(env, image_index: int = 0) -> str:\n"
        '    """Width of an image.\n\n    Args:\n        image_index: which image\n    """\n'
        "    return str(env._image(image_index).width + env._tool_options('image_width').get('add', 0))\n"
    )
    env = build_tool_environment([f"{plugin}:image_width"], '{"image_width": {"add": 5}}')()
    env.reset(images=[quadrants(64, 10)])
    assert env.image_width() == "69"
    schema = get_json_schema(env.image_width)["function"]
    assert schema["name"] == "image_width" and list(schema["parameters"]["properties"]) == ["image_index"]


def test_tool_kwargs_errors_are_clear():
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_tool_kwargs("{python: 1}")
    with pytest.raises(ValueError, match="names tools that are not in --tools: python"):
        build_tool_environment(["zoom_in"], {"python": {"timeout": 3}})
    with pytest.raises(ValueError, match="Unknown python tool option"):
        TOOLS.get("python").setup({"timeout_s": 3})
    with pytest.raises(ValueError, match="cannot be a tool"):
        make_environment_factory([lambda env: 1])


def test_the_malformed_call_name_is_reserved():
    """A user tool under the hidden tool's name would be replaced by it: refused, before any model loads."""
    from vlm_grpo.trainer import VLMGRPOTrainer

    def malformed_tool_call(env, text: str) -> str:
        """A user's tool that happens to take the reserved name.

        Args:
            text: anything.
        """
        return text

    def echo(env, text: str) -> str:
        """Echo.

        Args:
            text: anything.
        """
        return text

    with pytest.raises(ValueError, match=r"cannot be a tool: .*malformed_tool_call"):
        make_environment_factory([malformed_tool_call])
    make_environment_factory([echo])  # control: another name is fine
    with pytest.raises(ValueError, match="cannot be named 'malformed_tool_call'"):
        VLMGRPOTrainer(model="never-loaded", reward_funcs=[lambda **kw: [0.0]], tools=[malformed_tool_call])


def test_cli_and_yaml_fields(tmp_path):
    script, *_ = parse_args(["--model_name_or_path", "m", "--tools", "zoom_in", "python", "--tool_kwargs", "{}"])
    assert script.tools == ["zoom_in", "python"] and script.tool_kwargs == "{}"
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: m\ntools: [zoom_in]\ntool_kwargs:\n  zoom_in: {size: 224}\n")
    script, *_ = parse_args(["--config", str(config)])
    assert script.tools == ["zoom_in"] and parse_tool_kwargs(script.tool_kwargs) == {"zoom_in": {"size": 224}}


def test_schemas_hide_the_environment_parameter():
    env = env_with()
    params = get_json_schema(env.zoom_in)["function"]["parameters"]
    assert set(params["properties"]) == {"bbox_2d", "image_index", "label"} and params["required"] == ["bbox_2d"]


def test_zoom_in_crops_the_box_mapped_from_the_model_frame():
    env = env_with(coord_sizes=[[1000, 1000]], kwargs={"zoom_in": {"size": 200}})
    text, image = env.zoom_in([100, 250, 400, 500], label="red")  # pixels (10, 20, 40, 40): red only
    assert image["image"].size == (200, 133)  # 30x20 region, longer side scaled to 200
    assert colors(image["image"]) == {(255, 0, 0)}
    assert text["text"] == "Zoomed in on 'red' [100, 250, 400, 500] of image 0 (image 1):"
    # the returned image can be zoomed again, in its own frame (pixels here: no coord_size callable)
    _, again = env.zoom_in([0, 0, 100, 50], image_index=1)
    assert again["image"].size == (200, 100)
    # Qwen2.5-VL style frame: the resized image's pixels (here 200x160 for a 100x80 image)
    env = env_with(coord_sizes=[[200, 160]])
    _, image = env.crop([100, 80, 200, 160])  # the white quadrant at full resolution
    assert image["image"].size == (50, 40) and colors(image["image"]) == {(255, 255, 255)}
    assert env.successes == 1 and env.errors == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"bbox_2d": [0, 0, 1200, 10]}, "lies outside image 0: coordinates go from (0, 0) to (1000, 1000)"),
        ({"bbox_2d": [500, 500, 100, 900]}, "empty or inverted"),
        ({"bbox_2d": [100, 100, 100, 300]}, "empty or inverted"),
        ({"bbox_2d": [0, 0, 20, 20]}, "a region needs at least 4x4"),
        ({"bbox_2d": ["a", 0, 10, 10]}, "must hold 4 numbers"),
        ({"bbox_2d": [0, 0, 10]}, "must be a list of 4 numbers"),
        ({"bbox_2d": "0,0,10,10"}, "must be a list of 4 numbers"),
        ({"bbox_2d": [0, 0, float("nan"), 10]}, "finite"),
        ({"bbox_2d": [0, 0, 500, 500], "image_index": 3}, "image_index 3 does not exist: valid indices are 0 to 0"),
        ({"bbox_2d": [0, 0, 500, 500], "image_index": "first"}, "image_index must be an integer"),
        ({"box": [0, 0, 500, 500]}, "bad arguments for zoom_in"),
    ],
)
def test_bad_zoom_arguments_are_tool_errors(args, message):
    env = env_with(coord_sizes=[[1000, 1000]])
    with pytest.raises(ToolError) as info:
        env.zoom_in(**args)
    assert message in str(info.value)
    assert env.errors == 1 and env.successes == 0 and len(env.images) == 1


def test_rotate_and_its_bad_arguments():
    env = env_with()
    text, image = env.rotate(90)
    assert text["text"] == "Image 0 rotated by 90 degrees (image 1):"
    assert image["image"].size == (80, 100) and image["image"].getpixel((5, 95)) == (255, 0, 0)
    for bad in ("left", 1e9, True):
        with pytest.raises(ToolError, match="angle must be a number"):
            env.rotate(bad)
    no_images = build_tool_environment(["rotate"])()
    no_images.reset(prompt=[])
    with pytest.raises(ToolError, match="no images"):
        no_images.rotate(90)


def conversation(*tool_results: str, final: str = "<think>look</think><answer>red</answer>") -> list[dict]:
    messages = []
    for result in tool_results:
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]})
        messages.append({"role": "tool", "name": "zoom_in", "content": result})
    return [*messages, {"role": "assistant", "content": final}]


def test_tool_use_and_deepeyes_rewards_by_hand():
    ok, err = "[{'type': 'text', 'text': 'Zoomed'}]", "{'error': 'bbox_2d [5] must be a list of 4 numbers'}"
    completions = [
        conversation(ok),  # tool worked, right answer, good format
        conversation(err),  # tool failed
        conversation(),  # no tool
        conversation(ok, final="<answer>blue</answer>"),  # tool worked, wrong answer
        conversation(ok, final="<think>x<answer>red</answer>"),  # unbalanced think
        conversation(ok, final="<answer>red</answer><|image_pad|>"),  # the model wrote an image marker
    ]
    assert tool_use_reward(completions) == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    scores = deepeyes_reward(completions, solution=["red"] * 6, accu_reward_method=["default"] * 6)
    # DeepEyes' tool term counts tool images in the response: these text-only results earn none
    assert scores == pytest.approx([0.8, 0.8, 0.8, 0.0, 0.8 - 0.2, 0.8])
    assert REWARDS.get("deepeyes") is deepeyes_reward and REWARDS.get("tool_use") is tool_use_reward


def test_tool_use_prefers_the_environment_counts():
    env = env_with()
    env.zoom_in([0, 0, 50, 50])
    failed = env_with()
    with pytest.raises(ToolError):
        failed.zoom_in([0, 0, 0, 0])
    assert tool_use_reward([[], []], environments=[env, failed], bonus=0.5) == [0.5, 0.0]


def test_tool_format_reward():
    good = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]}]
    malformed = [{"role": "assistant", "content": '<tool_call>\n{"name": "zoom_in", "arguments": [1}\n</tool_call>'}]
    unclosed = [{"role": "assistant", "content": '<tool_call>{"name": "zoom_in", "arguments": {}}'}]
    no_name = [{"role": "assistant", "content": '<tool_call>{"arguments": {}}</tool_call>'}]
    plain = [{"role": "assistant", "content": "<answer>4</answer>"}]
    assert tool_format_reward([good, malformed, unclosed, no_name, plain]) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert tool_format_reward([good, plain], require_call=True) == [1.0, 0.0]


def test_zoom_demo_data_and_config(tmp_path):
    """The demo set: rows the data checker accepts, the number inside a red frame at the row's box; the config
    parses into a tool run."""
    from vlm_grpo.data.records import read_any_rows
    from vlm_grpo.data.zoom_in_demo import generate

    path = generate(tmp_path, n=3, size=(320, 240), seed=1)
    assert path.read_text() == generate(tmp_path / "again", n=3, size=(320, 240), seed=1).read_text()
    rows, bad = read_any_rows(str(path), str(tmp_path / "images"))
    assert not bad and len(rows) == 3
    for row in rows:
        x1, y1, x2, y2 = json_box(path, row["id"])
        image = Image.open(row["image_path"][0]).convert("RGB")
        assert image.getpixel((x1, y1)) == (220, 20, 20) and image.getpixel((x2, y2)) == (220, 20, 20)
        inside = image.crop((x1 + 2, y1 + 2, x2 - 1, y2 - 1))
        assert min(sum(c) for c in colors(inside)) < 150  # the digits: dark pixels on the white label
        assert row["solution"].startswith("<answer>") and row["accu_reward_method"] == "exact"
    script, training, model = parse_args(["--config", "configs/grpo_zoom_in.yaml"])
    assert script.tools == ["image_zoom_in_tool"] and training.max_tool_calling_iterations == 4
    assert script.reward_funcs == ["deepeyes", "tool_format"] and model.max_pixels == 262144


def json_box(path, row_id):
    import json

    return next(r["mark_box"] for r in map(json.loads, path.read_text().splitlines()) if r["id"] == row_id)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_checkpoints_without_a_tool_template_get_one(family, tiny_models):
    """Qwen2.5-VL's released template renders no tools: TRL would refuse it. The replacement renders plain
    prompts exactly as the released one, and tool conversations as TRL's loop needs."""
    from transformers import AutoProcessor
    from trl.chat_template_utils import (
        is_chat_template_prefix_preserving,
        qwen2_5_vl_chat_template,
        supports_tool_calling,
    )

    from vlm_grpo.tools.rollouts import prepare_for_tools

    processor = AutoProcessor.from_pretrained(tiny_models[family])
    released = qwen2_5_vl_chat_template
    if family == "internvl":  # the same turns, InternVL's placeholder, no default system prompt
        released = released.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n")
        released = released.replace("{% if loop.first and message['role'] != 'system' %}", "{% if false %}")
    processor.chat_template = released
    assert not supports_tool_calling(processor)
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    before = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    prepare_for_tools(None, processor)
    assert supports_tool_calling(processor) and is_chat_template_prefix_preserving(processor)
    assert processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False) == before
    tools = [build_tool_environment(["zoom_in"])().zoom_in]
    with_tools = processor.apply_chat_template(prompt, tools=tools, tokenize=False)
    assert "<tools>" in with_tools and '"name": "zoom_in"' in with_tools


def test_an_unknown_tool_fails_before_the_model_is_loaded(tmp_path):
    from vlm_grpo.grpo_jsonl import main

    argv = ["--model_name_or_path", str(tmp_path / "no_model"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(
        KeyError, match=r"Unknown tool 'zoom'\. Available: crop, image_zoom_in_tool, python, rotate, zoom_in"
    ):
        main(*parse_args([*argv, "--tools", "zoom"]))
    with pytest.raises(ValueError, match="--tool_kwargs was given without --tools"):
        main(*parse_args([*argv, "--tool_kwargs", '{"python": {}}']))

    with pytest.raises(ValueError, match=r"unknown zoom_in tool option\(s\) \['sise'\]; known: size, upscale_only"):
        main(*parse_args([*argv, "--tools", "zoom_in", "--tool_kwargs", '{"zoom_in": {"sise": 224}}']))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"zoom_in": {"size": 224, "upscale_only": False}}, None),
        ({"zoom_in": {"sise": 224}}, r"unknown zoom_in tool option\(s\) \['sise'\]"),
        ({"zoom_in": {"size": "224"}}, "zoom_in tool option size must be a positive integer, got '224'"),
        ({"zoom_in": {"size": 0}}, "must be a positive integer, got 0"),
        ({"zoom_in": {"upscale_only": "no"}}, "upscale_only must be true or false"),
        ({"crop": {"size": 224}}, r"unknown crop tool option\(s\) \['size'\]; it takes none"),
        ({"rotate": {"fill": 0}}, r"unknown rotate tool option\(s\) \['fill'\]; it takes none"),
    ],
)
def test_image_tool_options_are_checked_when_the_run_starts(options, message):
    """A misspelt --tool_kwargs option of an image tool was silently not applied."""
    if message is None:
        build_tool_environment(["zoom_in", "crop", "rotate"], options)
        return
    with pytest.raises(ValueError, match=message):
        build_tool_environment(["zoom_in", "crop", "rotate"], options)


@pytest.fixture(scope="module")
def tool_tokenizer():
    from trl.chat_template_utils import qwen3_template

    from vlm_grpo.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer("qwen2_5_vl")
    tokenizer.response_template = qwen3_template  # as prepare_for_tools sets it
    return tokenizer


@pytest.mark.parametrize(
    ("text", "malformed"),
    [
        ("<tool_call>{not json</tool_call><|im_end|>", True),
        ('<tool_call>\n{"name": "zoom_in", "arguments": [1, 2}\n</tool_call><|im_end|>', True),
        ('<tool_call>\n{"arguments": {}}\n</tool_call><|im_end|>', True),  # parses; TRL's checks reject it
        ('I will zoom. <tool_call>\n{"name": "zoom_in"', True),  # cut off by the length limit
        ('<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [1, 2, 3, 4]}}\n</tool_call><|im_end|>', False),
        ("<answer>4</answer><|im_end|>", False),
    ],
)
def test_the_tool_loops_parser_marks_malformed_calls(tool_tokenizer, text, malformed):
    """TRL's tool loop parses later turns with ``parse_response(trainer._tokenizer, ...)``: with the wrapper in
    place a malformed call becomes a call of the hidden tool, its text as TRL's fallback decodes it; anything
    else parses exactly as without the wrapper (which reads the malformed ones as plain answers)."""
    from trl.chat_template_utils import parse_response

    from vlm_grpo.tools.protocols import HERMES_MALFORMED, PROTOCOLS
    from vlm_grpo.tools.rollouts import MALFORMED_CALL, ProtocolParser, ToolTurns

    ids = tool_tokenizer.encode(text, add_special_tokens=False)
    prefix = tool_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    plain = parse_response(tool_tokenizer, ids, prefix=prefix, tools=None)
    turns = ToolTurns(PROTOCOLS.get("hermes"), tool_tokenizer)
    parsed = parse_response(ProtocolParser(tool_tokenizer, turns), ids, prefix=prefix, tools=None)
    if not malformed:
        assert parsed == plain
        return
    assert "tool_calls" not in plain  # TRL alone: a plain answer, the rollout would end here
    assert parsed == {
        **plain,
        "tool_calls": [
            {"type": "function", "function": {"name": MALFORMED_CALL, "arguments": {"message": HERMES_MALFORMED}}}
        ],
    }
    assert parsed["content"] == tool_tokenizer.decode(ids, skip_special_tokens=True)


def test_the_parser_is_the_tokenizer_otherwise_and_is_put_back():
    from vlm_grpo.tools.protocols import PROTOCOLS
    from vlm_grpo.tools.rollouts import ProtocolParser, ToolTurns, parse_with_protocol

    class Tokenizer:
        pad_token_id = 0

        def __len__(self):
            return 7

        def __call__(self, text):
            return {"input_ids": [len(text)]}

        def parse_response(self, response, schema=None, **kwargs):
            return {"raw": response, **kwargs}

    class Trainer:
        _tokenizer = Tokenizer()

    trainer, tokenizer = Trainer(), Trainer._tokenizer
    with pytest.raises(RuntimeError), parse_with_protocol(trainer, ToolTurns(PROTOCOLS.get("hermes"), tokenizer)):
        parser = trainer._tokenizer
        assert isinstance(parser, ProtocolParser)
        assert parser.pad_token_id == 0 and len(parser) == 7 and parser("abc") == {"input_ids": [3]}
        parser.pad_token_id = 5  # a write reaches the tokenizer
        # Calls other than the tool loop's (one turn's token ids) are the tokenizer's own
        assert parser.parse_response("text") == {"raw": "text"}
        assert parser.parse_response([[1], [2]], prefix=[0]) == {"raw": [[1], [2]], "prefix": [0]}
        raise RuntimeError
    assert trainer._tokenizer is tokenizer and tokenizer.pad_token_id == 5


def test_the_hidden_tool_answers_with_an_error_counted_as_a_failed_call():
    from vlm_grpo.tools.rollouts import MALFORMED_CALL, malformed_call_tool

    env = env_with()
    tool = malformed_call_tool(env)
    assert tool.__name__ == MALFORMED_CALL
    with pytest.raises(ValueError, match="the <tool_call> block could not be read"):
        tool()
    assert (env.calls, env.errors, env.successes) == (1, 1, 0)
    with pytest.raises(ValueError):
        malformed_call_tool(None)()  # plain callables as tools: no environment to count in
