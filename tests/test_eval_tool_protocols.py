"""``vlm-grpo-eval --tools --tool_protocol``: a scripted policy per protocol through the evaluation loop, and the
evaluation loop against the GRPO loop: for the same model outputs both build the same tokens, turn by turn.

The expected replies are written out from PyVision's and DeepEyes' observation strings, not from the code under
test."""

from __future__ import annotations

import json
import re

import pytest
import torch

from e2e_utils import make_dataset
from test_eval_tools import ScriptedPolicy
from test_sft_tools import assert_sft_trains_grpo_tokens
from test_tool_protocols_e2e import ANSWER, first_turns, run
from vlm_grpo.eval_tools import ToolLoop

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAD = re.compile(r"(?:<\|image_pad\|>)+")
CODE = "print('size', image.size)\ndisplay(image.crop((0, 0, 24, 24)))"
PYVISION_CALL = f"<think>look</think>\n<code>\n```python\n{CODE}\n```\n</code>"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("eval_protocols"), kinds=("single",))


@pytest.fixture(scope="module")
def setup(tiny_models, data):
    from vlm_grpo.demo_tools import _dataset
    from vlm_grpo.merge_lora import load_model_and_processor

    path, _ = data
    _, processor, module = load_model_and_processor(str(tiny_models["qwen2_5_vl"]))
    return processor, module, _dataset(path, path.parent / "images", module, processor)


def loop_for(setup, protocol, turns, **kwargs):
    processor, module, rows = setup
    tools = ["python"] if protocol == "pyvision" else ["zoom_in"]
    tool_kwargs = '{"python": {"timeout": 20, "pool_size": 1}}' if protocol == "pyvision" else None
    policy = ScriptedPolicy(processor.tokenizer, turns)
    options = {"max_iterations": 3, "max_new_tokens": 512, "protocol": protocol, **kwargs}
    return ToolLoop(policy, processor, module, tools, tool_kwargs, **options), policy, rows[0]


def context(policy, i):
    return PAD.sub("<|image_pad|>", policy.tokenizer.decode(policy.inputs[i]["input_ids"][0]))


def test_pyvision_code_runs_and_the_interpreter_replies(setup):
    loop, policy, row = loop_for(setup, "pyvision", [PYVISION_CALL, "```python\nraise ValueError('boom')\n```", ANSWER])
    out = loop.run(row)
    assert (out.turns, out.calls, out.errors, out.images, out.stop) == (3, 2, 1, 1, "answer")
    second = context(policy, 1)
    size = row["images"][0].size
    assert second.endswith(  # the turn ends at </code>: the user turn follows at once (PyVision's observation)
        f"</code>\n<|im_start|>user\n<tool_response>\n<interpreter>Text Result:\nsize {size}\nImage Result:\n"
        "<image_clue_1><|vision_start|><|image_pad|><|vision_end|></image_clue_1></interpreter>\n\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" not in second  # PyVision's prompt describes its tool: no schemas
    assert "<interpreter>Execution error: " in context(policy, 2) and "boom" in context(policy, 2)
    log = out.log()
    assert [m["role"] for m in log["conversation"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert log["conversation"][0]["content"] == PYVISION_CALL and log["tool_calls"] == 2


def test_pyvision_text_after_the_block_is_cut_and_not_run(setup):
    """PyVision stops at </code>: the second block and the answer written after it are neither kept nor run. The
    control (hermes, same text) keeps the turn whole."""
    after = "\n<code>\n```python\nprint('second')\n```\n</code><answer>9</answer>"
    loop, policy, row = loop_for(setup, "pyvision", [PYVISION_CALL + after, ANSWER])
    out = loop.run(row)
    assert (out.turns, out.calls, out.stop) == (2, 1, "answer")
    # the turn ends with the token that completes </code> (here ">\n", one token: kept whole, as vLLM keeps it)
    assert out.messages[0]["content"] == PYVISION_CALL + "\n"
    assert "second" not in context(policy, 1) and "<answer>9</answer>" not in context(policy, 1)
    hermes, _, row = loop_for(setup, "hermes", [PYVISION_CALL + after])
    assert "<answer>9</answer>" in hermes.run(row).messages[0]["content"]


@pytest.mark.parametrize("version", ["v2", "v5"])
def test_deepeyes_calls_and_replies_per_version(setup, version):
    from vlm_grpo.tools.protocols import DEEPEYES_TURN_PROMPT_V5, DEEPEYES_USER_PROMPT

    call = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [4, 4, 44, 44]}}\n</tool_call>'
    other = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [0, 0, 40, 40]}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "zoom_in", "arguments": [1, 2}\n</tool_call>'
    processor, module, rows = setup
    policy = ScriptedPolicy(processor.tokenizer, [call + other, bad, ANSWER])
    options = json.dumps({"zoom_in": {"size": 56}})
    # the version is image_zoom_in_tool's option; zoom_in stands in here (the protocol reads the option)
    loop = ToolLoop(policy, processor, module, ["zoom_in", "image_zoom_in_tool"], options, 3, 512, None, "deepeyes")
    if version == "v5":
        options = json.dumps({"zoom_in": {"size": 56}, "image_zoom_in_tool": {"version": "v5"}})
        loop = ToolLoop(policy, processor, module, ["zoom_in", "image_zoom_in_tool"], options, 3, 512, None, "deepeyes")
    out = loop.run(rows[0])
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    reply = context(policy, 1).split("<|im_start|>user\n")[-1]
    if version == "v2":  # the last call only
        assert (out.calls, out.images) == (2, 1)
        assert reply.startswith(f"<tool_response>{image}{DEEPEYES_USER_PROMPT}</tool_response><|im_end|>")
        assert "Error: Invalid tool call format: " in context(policy, 2)
    else:  # both calls, one <tool_response> each, the turn prompt once
        assert (out.calls, out.images) == (3, 2)
        one = f"<tool_response>\n{image}\n</tool_response>\n"
        assert reply.startswith(f"{one}{one}{DEEPEYES_TURN_PROMPT_V5}<|im_end|>")
        assert "<|im_start|>user\nError: Expecting ',' delimiter" in context(policy, 2)  # the exception alone
    assert out.errors == 1 and out.stop == "answer"


# ------------------------------------------------------------------ the evaluation loop = the GRPO loop
def collapse(text: str) -> str:
    return PAD.sub("<|image_pad|>", text).replace("<|endoftext|>", "")


@pytest.mark.parametrize("protocol", ["hermes", "pyvision", "deepeyes"])
def test_eval_sft_and_grpo_build_the_same_rollout(protocol, tiny_models, data, setup, tmp_path):
    """One GRPO step with scripted turns (a good call, a bad one; then the answer), and the evaluation loop on
    the same row with the same turns: each rollout's tokens, prompt to answer, are the same text; and SFT
    (``vlm-grpo-sft --tools``) encodes the same trajectory as the same tokens, trained where GRPO trains."""
    trainer, seen = run(protocol, "qwen2_5_vl", tiny_models, data, tmp_path / "grpo", stage="_generate_turn")
    batch = seen["batches"][0]
    tokenizer = trainer._tokenizer
    prompt = collapse(tokenizer.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()]))
    rows = list(trainer.train_dataset)
    for i in range(batch["completion_ids"].size(0)):
        grpo = tokenizer.decode(batch["completion_ids"][i][batch["completion_mask"][i].bool()])
        turns = [first_turns(protocol, "qwen2_5_vl")[i % 2].removesuffix("<|im_end|>"), ANSWER]
        loop, policy, _ = loop_for(setup, protocol, turns)
        image = trainer.environments[i].images[0].tobytes()  # the rollout's row: its prompt and its image
        matches = [r for r in rows if collapse(loop._start(r)[-1]) == prompt and r["images"][0].tobytes() == image]
        assert matches, "the evaluation renders the GRPO prompt"
        out = loop.run(matches[0])
        assert out.turns == 2
        evaluated = context(policy, 1) + ANSWER + "<|im_end|>"
        assert evaluated == prompt + collapse(grpo)
    assert_sft_trains_grpo_tokens(trainer, seen, protocol, "qwen2_5_vl")


def test_eval_command_takes_the_protocol(tiny_models, data, tmp_path):
    from vlm_grpo.evaluate import main

    path, _ = data
    argv = [
        "--model_name_or_path", str(tiny_models["qwen2_5_vl"]), "--data_file_paths", str(path),
        "--image_folders", str(path.parent / "images"), "--output_dir", str(tmp_path), "--reward_funcs", "format",
        "--tools", "zoom_in", "--tool_protocol", "deepeyes", "--max_tool_calling_iterations", "1",
        "--max_new_tokens", "6", "--device", "cpu", "--progress", "false",
    ]  # fmt: skip
    summary = main(argv)
    assert summary["tools"]["rollouts"] == summary["count"] and summary["tools"]["protocol"] == "deepeyes"
    with pytest.raises(KeyError, match="no_such"):
        main([*argv[:-8], "--tool_protocol", "no_such", "--device", "cpu", "--progress", "false"])
    with pytest.raises(ValueError, match="--tool_protocol needs --tools"):
        main([*argv[:10], "--tool_protocol", "pyvision"])


def test_a_turn_cut_at_the_stop_string_is_not_a_budget_stop(setup):
    loop, _, _ = loop_for(setup, "pyvision", [])
    tokenizer = setup[0].tokenizer
    ids = tokenizer(PYVISION_CALL + "\nmore text", add_special_tokens=False)["input_ids"]
    cut = loop.turns.cut(ids)
    assert tokenizer.decode(cut).rstrip().endswith("</code>") and loop.turns.ended(cut)
    assert not loop.turns.ended(cut[:-1])  # one token short: the budget stopped it
    assert torch.equal(torch.tensor(loop.turns.cut(cut)), torch.tensor(cut))  # cutting again changes nothing


def test_the_trainer_cuts_each_generated_turn_at_the_stop_string(setup):
    """Whatever path generated the turn (TRL's generate or the fast decode path: both are ``_generate_turn``),
    ``_generate_single_turn`` hands TRL's loop the turn cut after </code>, log-probs cut alike; a protocol
    without a stop string (the control) keeps the turn whole."""
    from vlm_grpo.tools.protocols import PROTOCOLS
    from vlm_grpo.tools.rollouts import ToolTurns
    from vlm_grpo.trainer import VLMGRPOTrainer

    tokenizer = setup[0].tokenizer
    whole = tokenizer(PYVISION_CALL + "\nprint('after')<answer>1</answer><|im_end|>", add_special_tokens=False)
    whole = whole["input_ids"]

    class Stub:
        max_turn_tokens = None
        _in_tool_loop, _round_sync, _turn_cache = False, None, None  # the first turn, one process, no held caches
        _generate_within_budgets = VLMGRPOTrainer._generate_within_budgets

        def __init__(self, protocol):
            self._tool_turns = ToolTurns(PROTOCOLS.get(protocol), tokenizer)

        def _generate_turn(self, prompt_ids, *args):
            return [list(whole) for _ in prompt_ids], [[0.1] * len(whole) for _ in prompt_ids]

    ids, logprobs = VLMGRPOTrainer._generate_single_turn(Stub("pyvision"), [[1], [2]], None, {}, 2)
    assert [tokenizer.decode(row) for row in ids] == [PYVISION_CALL + "\n"] * 2
    assert [len(row) for row in logprobs] == [len(row) for row in ids]
    ids, _ = VLMGRPOTrainer._generate_single_turn(Stub("hermes"), [[1]], None, {}, 1)
    assert ids == [whole]
