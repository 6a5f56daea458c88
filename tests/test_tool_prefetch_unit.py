"""Calls of parallel tools started ahead of TRL's tool loop (``prefetch_tool_calls``, ``ToolBatch``), fast: which
rollouts' calls start (the last assistant turn's calls of parallel tools, up to the first of another tool), which
never start (a turn already started, a rollout whose calls ran as its turn ended, a rollout at its image budget,
rows without an environment), and that each call runs once. The tools log every run, so a call run twice or never
shows in the log."""

from __future__ import annotations

from concurrent.futures import wait

import pytest

from test_early_calls_unit import LOG, double, fresh_tool_threads, halve  # noqa: F401  (autouse: own tool threads)
from vlm_grpo.tools import rollouts
from vlm_grpo.tools.base import make_environment_factory
from vlm_grpo.tools.protocols import PROTOCOLS, function_call
from vlm_grpo.tools.rollouts import ToolBatch, ToolTurns, prefetch_tool_calls


@pytest.fixture
def factory():
    return make_environment_factory([double, halve], {})


def settle(*envs) -> list[tuple[str, int]]:
    """The tool runs once every started call has finished."""
    wait([f for env in envs for futures in env._prefetched.values() for f in futures])
    return sorted(LOG)


def turn(*calls) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [function_call(n, {"x": x}) for n, x in calls]}


def test_the_last_turns_parallel_calls_start_once_up_to_another_tools_call(factory):
    first, second, third = factory(), factory(), factory()
    for env in (first, second, third):
        env.reset()
    completions = [
        [turn(("double", 1), ("double", 2), ("halve", 8), ("double", 3))],
        [turn(("double", 4)), {"role": "tool", "name": "double", "content": "8"}],  # the reply is in: nothing new
        [turn(("halve", 6), ("double", 5))],  # its first call is not of a parallel tool
        [turn(("double", 7))],  # no environment: plain tools
    ]
    seen: set[int] = set()
    assert prefetch_tool_calls([first, second, third, None], completions, seen) == 1
    assert settle(first, second, third) == [("double", 1), ("double", 2)]
    assert prefetch_tool_calls([first, second, third, None], completions, seen) == 0  # the same turns: not again
    assert first.double(x=1) == "2" and first.double(x=2) == "4"  # TRL's calls collect the results
    assert sorted(LOG) == [("double", 1), ("double", 2)]


def test_rollouts_started_already_or_at_their_image_budget_start_nothing(factory):
    ahead, full, free = factory(), factory(), factory()
    for env in (ahead, full, free):
        env.reset()
    ahead._ahead = True  # its calls started as its turn ended
    turns = ToolTurns(PROTOCOLS.get("hermes"), None, max_tool_images=1)
    for env in (ahead, full, free):
        turns.tools_for({}, env, 0)
    turns.image_counts[id(full)]["images"] = 1
    completions = [[turn(("double", 1))], [turn(("double", 2))], [turn(("double", 3))]]
    assert prefetch_tool_calls([ahead, full, free], completions, set(), turns) == 1
    assert settle(ahead, full, free) == [("double", 3)]


def test_a_tool_batch_starts_each_round_once_and_lets_go_of_its_rollouts(factory):
    envs = [factory(), factory()]
    for env in envs:
        env.reset()
    completions = [[turn(("double", 1))], [turn(("double", 2))]]
    with ToolBatch([*envs, None], completions) as batch:
        assert [env._batch for env in envs] == [batch, batch]
        assert settle(*envs) == [("double", 1), ("double", 2)]
        assert [envs[0].double(x=1), envs[1].double(x=2)] == ["2", "4"]
        for row, x in ((0, 5), (1, 6)):  # TRL appends the replies and the next turns
            completions[row] += [{"role": "tool", "content": "r"}, turn(("double", x))]
        assert envs[0].double(x=5) == "10"  # the round's first call starts every rollout's calls
        assert settle(*envs) == [("double", 1), ("double", 2), ("double", 5), ("double", 6)]
        assert batch.prefetch() == 0
    assert [env._batch for env in envs] == [None, None]
    assert rollouts._EXECUTOR is not None


def test_calls_whose_arguments_are_not_an_object_end_what_starts(factory):
    env = factory()
    env.reset()
    unread = {"type": "function", "function": {"name": "double", "arguments": '{"x": 2}'}}
    completions = [[{"role": "assistant", "tool_calls": [*turn(("double", 1))["tool_calls"], unread]}]]
    assert prefetch_tool_calls([env], completions, set()) == 1
    assert settle(env) == [("double", 1)]
    env.reset()
    completions = [[{"role": "assistant", "tool_calls": [{"type": "function"}, *turn(("double", 3))["tool_calls"]]}]]
    assert prefetch_tool_calls([env], completions, set()) == 0


def test_internvl_tiles_are_counted_per_rollout():
    import torch

    from vlm_grpo.tools.rollouts import tile_fields

    a, b, c = object(), object(), object()
    asked = []

    def processor(images, crop_to_patches, return_tensors):
        asked.append((images, crop_to_patches))
        return {"num_patches": torch.tensor([2, 4, 1])}

    one_each = [torch.full((1, 3, 2, 2), 1.0), torch.full((2, 3, 2, 2), 2.0)]
    out = tile_fields(processor, [[a], [b, c], None], {"pixel_values": one_each, "input_ids": "kept"})
    assert out["num_tiles"] == [1, 2, 0] and out["input_ids"] == "kept" and asked == []  # one tile per image
    assert torch.equal(out["pixel_values"], torch.cat(one_each))
    tiles = [torch.full((3, 2, 2), 1.0), torch.full((6, 3, 2, 2), 2.0)]  # a one-tile prompt comes as 3 dims
    out = tile_fields(processor, [[a], None, [b, c]], {"pixel_values": tiles})
    assert out["num_tiles"] == [2, 0, 5] and asked == [([a, b, c], True)]
    assert out["pixel_values"].shape == (7, 3, 2, 2) and out["pixel_values"][1].eq(2.0).all()


def test_llava_onevision_tiles_are_padded_to_one_tensor():
    import torch

    from vlm_grpo.tools.rollouts import tile_fields

    pixels = [torch.ones(2, 3, 2, 2), torch.full((3, 3, 2, 2), 2.0)]
    fields = {"pixel_values": pixels, "image_sizes": [[10, 20], [30, 40]], "batch_num_images": [1, 1], "x": 1}
    out = tile_fields(None, [[object()], [object()]], fields)
    assert sorted(out) == ["image_sizes", "pixel_values", "x"]
    assert out["pixel_values"].shape == (2, 3, 3, 2, 2)
    assert out["pixel_values"][0, :2].eq(1).all() and out["pixel_values"][0, 2].eq(0).all()
    assert out["pixel_values"][1].eq(2).all()
    assert torch.equal(out["image_sizes"], torch.tensor([[10, 20], [30, 40]]))


def test_fields_tile_fields_leaves_alone():
    import torch

    from vlm_grpo.tools.rollouts import tile_fields

    listed = [torch.ones(1, 3, 2, 2)]
    for images, fields in (
        (None, {"pixel_values": listed}),
        ([[object()]], {"pixel_values": listed, "image_grid_thw": torch.ones(1, 3)}),
        ([[object()]], {"pixel_values": [listed[0], "not a tensor"]}),
        ([[object()]], {"pixel_values": torch.ones(1, 3, 2, 2)}),
        ([[object()]], {"pixel_values": []}),
    ):
        assert tile_fields(None, images, fields) is fields


def test_tool_names_from_every_form_trl_hands():
    import functools

    from vlm_grpo.tools.rollouts import tool_names

    def crop(env) -> str:
        return ""

    schemas = [{"type": "function", "function": {"name": "zoom_in"}}, {"name": "rotate"}, "python", crop]
    assert tool_names([*schemas, functools.partial(crop, None), {"type": "function", "function": {}}]) == {
        "zoom_in",
        "rotate",
        "python",
        "crop",
    }
    assert tool_names({"a": crop, "b": crop}) == {"a", "b"} and tool_names(None) == set()


NO_TOOLS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_tool_run_reads_calls_in_the_familys_own_turns(tiny_models, caplog):
    """Gemma 3's replies open after its end of the user's turn and its generation prompt; a response template the
    user set (or a schema) is kept; a template without tools gets Qwen2.5's tool format, with one info line."""
    from transformers import AutoProcessor

    from vlm_grpo.tools.rollouts import prepare_for_tools

    gemma = AutoProcessor.from_pretrained(tiny_models["gemma3"])
    prepare_for_tools(None, gemma)
    opener = gemma.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    assert opener.endswith("<start_of_turn>model\n")
    # what the template writes between the user's words and the reply
    assert gemma.tokenizer.response_template["start_anchor"] == "<end_of_turn>\n<start_of_turn>model\n"
    for field, value in (("response_template", {"mine": 1}), ("response_schema", {"schema": 1})):
        qwen = AutoProcessor.from_pretrained(tiny_models["qwen2_5_vl"])
        qwen.chat_template = qwen.tokenizer.chat_template = NO_TOOLS
        setattr(qwen.tokenizer, field, value)
        with caplog.at_level("INFO", logger="vlm_grpo.tools.rollouts"):
            prepare_for_tools(None, qwen)
        assert getattr(qwen.tokenizer, field) == value
        assert qwen.tokenizer.chat_template == qwen.chat_template and "tools" in qwen.chat_template
    if field == "response_schema":
        assert qwen.tokenizer.response_template is None
    assert "The checkpoint's chat template renders no tools: using Qwen2.5's tool format with it" in caplog.messages


def test_every_rollout_started_is_counted(factory):
    envs = [factory(), factory()]
    for env in envs:
        env.reset()
    assert prefetch_tool_calls(envs, [[turn(("double", 1))], [turn(("double", 2))]], set()) == 2
    assert settle(*envs) == [("double", 1), ("double", 2)]


def test_the_runs_budgets_reach_its_tool_turns_and_the_users_suppressed_tokens_stay(tiny_models):
    from types import SimpleNamespace

    from transformers import AutoProcessor

    from vlm_grpo.tools.rollouts import build_tool_environment, prepare_for_tools, tool_turns

    qwen = AutoProcessor.from_pretrained(tiny_models["qwen2_5_vl"])
    turns = tool_turns([], build_tool_environment(["zoom_in"]), qwen, "hermes", 64, 2)
    assert (turns.max_context_tokens, turns.max_tool_images) == (64, 2)
    args = SimpleNamespace(generation_kwargs={"suppress_tokens": [5], "top_k": 3})
    prepare_for_tools(args, qwen)
    pad = qwen.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert 5 in args.generation_kwargs["suppress_tokens"] and pad in args.generation_kwargs["suppress_tokens"]
    assert args.generation_kwargs["top_k"] == 3
