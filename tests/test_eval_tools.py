"""Agentic evaluation: the tool loop run over held-out rows. A scripted policy (a stand-in for ``generate`` that
writes fixed turns) drives the real tiny processor, chat template, parser and tools."""

from __future__ import annotations

import json

import pytest
import torch

from vlm_grpo.data.zoom_in_demo import MARKED, generate_tool_demo, zoom_call
from vlm_grpo.eval_tools import ToolLoop

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScriptedPolicy:
    """``generate`` answers each call with the next scripted turn (+ the end-of-turn token); records the inputs."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns, self.inputs = tokenizer, list(turns), []

    def generate(self, input_ids, **kwargs):
        self.inputs.append({"input_ids": input_ids, **kwargs})
        text = self.turns.pop(0) + self.tokenizer.eos_token
        new = torch.tensor([self.tokenizer(text, add_special_tokens=False)["input_ids"]])
        return torch.cat([input_ids, new], dim=1)


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    from vlm_grpo.demo_tools import _dataset
    from vlm_grpo.merge_lora import load_model_and_processor

    data = tmp_path_factory.mktemp("zoom")
    generate_tool_demo(data, n_train=4, n_val=4)
    _, processor, module = load_model_and_processor(str(tiny_models["qwen2_5_vl"]))
    rows = _dataset(data / "val.jsonl", data / "images", module, processor)
    return processor, module, rows, data


def loop_for(setup, turns, **kwargs):
    processor, module, rows, _ = setup
    policy = ScriptedPolicy(processor.tokenizer, turns)
    options = {"max_iterations": 4, "max_new_tokens": 512, **kwargs}
    loop = ToolLoop(policy, processor, module, ["zoom_in"], '{"zoom_in": {"size": 56}}', **options)
    return loop, policy, rows[0]


def context(policy, i):
    return policy.tokenizer.decode(policy.inputs[i]["input_ids"][0])


def test_a_call_runs_the_tool_and_its_image_comes_back(setup):
    loop, policy, row = loop_for(setup, [zoom_call(), "<answer>red</answer>"])
    out = loop.run(row)
    assert (out.turns, out.calls, out.errors, out.images, out.stop) == (2, 1, 0, 1, "answer")
    assert policy.inputs[0]["image_grid_thw"].shape[0] == 1  # the prompt's image
    assert policy.inputs[1]["image_grid_thw"].shape[0] == 2  # and the zoomed view
    second = context(policy, 1)
    assert second.count("<tool_response>") == 1
    assert f"Zoomed in on the region {list(MARKED)}" in second and second.endswith("<|im_start|>assistant\n")
    assert [m["role"] for m in out.messages] == ["assistant", "tool", "assistant"]
    assert out.messages[0]["tool_calls"][0]["function"]["arguments"] == {"bbox_2d": list(MARKED)}
    assert "suppress_tokens" in policy.inputs[0]  # the model cannot write image placeholders itself


@pytest.mark.parametrize(
    ("turn", "error"),
    [
        ('<tool_call>\n{"name": "zoom_in", "arguments": {"box": [1, 2, 3, 4]}}\n</tool_call>', "bad arguments"),
        ('<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [0, 0, 500, 40]}}\n</tool_call>', "outside"),
        ('<tool_call>\n{"name": "magnify", "arguments": {}}\n</tool_call>', "there is no tool named 'magnify'"),
        ('<tool_call>\n{"name": "zoom_in", "arguments": [1}\n</tool_call>', "could not be read"),
    ],
)
def test_bad_calls_are_errors_the_model_reads(setup, turn, error):
    loop, policy, row = loop_for(setup, [turn, "<answer>red</answer>"])
    out = loop.run(row)
    assert (out.turns, out.calls, out.errors, out.images) == (2, 1, 1, 0)
    assert error in context(policy, 1)


def test_the_rollout_ends_at_the_answer_and_later_calls_are_not_run(setup):
    loop, policy, row = loop_for(setup, [f"<answer>red</answer>{zoom_call()}", "never asked"])
    out = loop.run(row)
    assert (out.turns, out.calls, out.calls_after_answer, out.stop) == (1, 0, 1, "answer")
    assert len(policy.inputs) == 1


@pytest.mark.parametrize(("limit", "turns"), [(1, 2), (2, 3)])
def test_max_tool_calling_iterations_bounds_the_rounds(setup, limit, turns):
    loop, _, row = loop_for(setup, [zoom_call()] * 4, max_iterations=limit)
    out = loop.run(row)
    assert (out.turns, out.calls, out.stop) == (turns, limit, "max_tool_calling_iterations")


def test_replay_gives_the_tokens_the_loop_shows(setup):
    processor, *_ = setup
    loop, policy, row = loop_for(setup, [zoom_call(), "<answer>red</answer>"])
    loop.run(row)
    segments = loop.replay(row, [zoom_call(), "<answer>red</answer>"])
    eos = processor.tokenizer.eos_token
    assert [w for _, _, w in segments] == [False, True, False, True]
    assert [len(i) for _, i, _ in segments] == [1, 0, 1, 0]
    assert segments[1][0] == zoom_call() + eos and segments[3][0] == "<answer>red</answer>" + eos
    # what the loop showed the model before its second turn (image pads expanded) is the replay's first three
    rendered = "".join(t for t, _, _ in segments[:3])
    assert context(policy, 1).replace("<|image_pad|>", "") == rendered.replace("<|image_pad|>", "")


def test_eval_with_tools_logs_every_sample(tiny_models, setup, tmp_path, capsys):
    from vlm_grpo.evaluate import main

    *_, data = setup
    argv = [
        "--model_name_or_path", str(tiny_models["qwen2_5_vl"]), "--data_file_paths", str(data / "val.jsonl"),
        "--image_folders", str(data / "images"), "--output_dir", str(tmp_path), "--reward_funcs", "accuracy",
        "deepeyes", "--tools", "zoom_in", "--max_tool_calling_iterations", "2", "--max_new_tokens", "8",
        "--device", "cpu", "--progress", "false",
    ]  # fmt: skip
    summary = main(argv)
    assert summary["count"] == 4 and summary["tools"]["rollouts"] == 4
    assert set(summary["tools"]) >= {"tool_call_rate", "calls_per_sample", "errors_per_sample", "turns_per_sample"}
    lines = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    log = lines[0]["tool_rollouts"][0]
    assert {"turns", "tool_calls", "tool_errors", "conversation", "stop"} <= set(log)
    assert log["generated_tokens"] <= 8
    assert "tool-call rate" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--max_tool_calling_iterations", "2"], ["--tool_kwargs", "{}"]])
def test_tool_flags_without_tools_are_refused(tiny_models, setup, tmp_path, flag):
    from vlm_grpo.evaluate import main

    *_, data = setup
    argv = ["--model_name_or_path", str(tiny_models["qwen2_5_vl"]), "--data_file_paths", str(data / "val.jsonl")]
    with pytest.raises(ValueError, match="needs --tools"):
        main([*argv, "--output_dir", str(tmp_path), *flag])
