"""Each tool protocol end to end through grpo_jsonl.py's main, for every family: a scripted policy writes the
protocol's calls (one good, one bad, in turn), the tools run, images come back in the protocol's reply, the model
answers; the loss masks the replies, the log-prob passes equal TRL's, and rewards read the rollout as written.

The expected replies are written out here from PyVision's and DeepEyes' own observation strings, not from the code
under test.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from e2e_utils import base_args, make_dataset, own_forward_logps
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.rewards import completion_text
from vlm_grpo.testing.tiny import FAMILIES
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BOX = {"qwen2_5_vl": [4, 4, 44, 44], "qwen2_vl": [100, 100, 800, 800], "qwen3_vl": [100, 100, 800, 800]}
BOX["internvl"] = BOX["qwen2_vl"]
# One image of a tool reply as the model reads it, image tokens collapsed to one.
MARKER = {"internvl": "<img><IMG_CONTEXT></img>\n"}
ANSWER = "<think>seen</think><answer>4</answer>"
DEEPEYES_PROMPT = (
    "\nThink first, call **image_zoom_in_tool** if needed, then answer. Format strictly as:  <think>...</think>  "
    "<tool_call>...</tool_call> (if tools needed)  <answer>...</answer> "
)


def first_turns(protocol: str, family: str) -> list[str]:
    """The good call, then the bad one (each a whole first turn)."""
    if protocol == "pyvision":
        code = "print('size', image.size)\ndisplay(image.crop((0, 0, 24, 24)))"
        good = f"<think>look</think>\n<code>\n```python\n{code}\n```\n</code>"
        bad = "```python\nraise ValueError('boom')\n```"
    elif protocol == "deepeyes":
        call = {"name": "zoom_in", "arguments": {"bbox_2d": BOX[family], "image_index": 0}}
        good = f"<think>zoom</think>\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
        bad = '<tool_call>\n{"name": "zoom_in", "arguments": [1, 2}\n</tool_call>'
    else:
        call = {"name": "zoom_in", "arguments": {"bbox_2d": BOX[family]}}
        good = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        bad = '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>'
    return [good + "<|im_end|>", bad + "<|im_end|>"]


def expected_replies(protocol: str, family: str, size: tuple[int, int]) -> tuple[str, str]:
    """The good call's reply and the bad call's, as the model reads them (the chat turn around them left out)."""
    marker = MARKER.get(family, "<|vision_start|><|image_pad|><|vision_end|>")
    if protocol == "pyvision":
        good = (
            f"<tool_response>\n<interpreter>Text Result:\nsize {size}\nImage Result:\n"
            f"<image_clue_1>{marker}</image_clue_1></interpreter>\n\n</tool_response>"
        )
        return good, "<tool_response>\n<interpreter>Execution error: "
    if protocol == "deepeyes":
        bad = 'Error: Invalid tool call format: {"name": "zoom_in", "arguments": [1, 2}. Error: '
        return f"<tool_response>{marker}{DEEPEYES_PROMPT}</tool_response>", bad
    return (
        "<tool_response>\nZoomed in on the region",
        "<tool_response>\n{'error': \"there is no tool named 'no_such_tool'",
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("protocol_data"), kinds=("single",))


def run(protocol, family, tiny_models, dataset, out, first=None, extra=(), stage="_generate_single_turn"):
    """One GRPO step with scripted turns; returns the trainer, the scored batch and the completions rewards got.
    ``stage``: the trainer method the script replaces (``_generate_turn``: the turns pass the protocol's stop)."""
    data, plugin = dataset
    texts = first or first_turns(protocol, family)
    seen = {"batches": [], "completions": [], "rounds": 0}
    score, rewards = VLMGRPOTrainer._generate_and_score_completions, VLMGRPOTrainer._calculate_rewards

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations == 1:  # after a tool reply: the answer
            seen["rounds"] += 1
            return [self._tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False) for _ in prompt_ids], None
        return [self._tokenizer.encode(texts[i % 2], add_special_tokens=False) for i in range(len(prompt_ids))], None

    def keep_batch(self, inputs):
        seen["batches"].append(score(self, inputs))
        return seen["batches"][-1]

    def keep_completions(self, inputs, prompts, completions, completion_ids_list):
        seen["completions"].extend(completions)
        return rewards(self, inputs, prompts, completions, completion_ids_list)

    argv = base_args(tiny_models[family], data, plugin, out, steps=1)
    argv += ["--max_completion_length", "400", "--max_tool_calling_iterations", "2"]
    argv += ["--tools", "python" if protocol == "pyvision" else "zoom_in", "--tool_protocol", protocol, *extra]
    if protocol == "pyvision":
        argv += ["--tool_kwargs", '{"python": {"timeout": 20, "pool_size": 1}}']
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, stage, scripted)
        mp.setattr(VLMGRPOTrainer, "_generate_and_score_completions", keep_batch)
        mp.setattr(VLMGRPOTrainer, "_calculate_rewards", keep_completions)
        trainer = main(*parse_args(argv))
    return trainer, seen


def segments(tokenizer, ids, mask, kept):
    """The completion's runs of model tokens and of tool tokens, decoded with special tokens."""
    ids, mask = ids[kept.bool()].tolist(), mask[kept.bool()].tolist()
    runs, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            runs.append((mask[start], tokenizer.decode(ids[start:end], skip_special_tokens=False)))
            start = end
    return runs


# hermes runs for every family in test_tools_e2e.py; here once, for what rewards read of it
CASES = [(p, f) for p in ("pyvision", "deepeyes") for f in FAMILIES] + [("hermes", "qwen2_5_vl")]


@pytest.mark.parametrize(("protocol", "family"), CASES)
def test_each_protocol_runs_its_tools_and_rewards_read_the_rollout(protocol, family, tiny_models, dataset, tmp_path):
    rollout_log = tmp_path / "rollouts.jsonl"
    extra = ["--rollout_log", str(rollout_log)]
    if protocol == "hermes":  # three tools, shown in this order (alphabetical would be crop, rotate, zoom_in)
        extra += ["--tools", "rotate", "zoom_in", "crop"]
    trainer, seen = run(protocol, family, tiny_models, dataset, tmp_path / "out", extra=extra)
    log = trainer.state.log_history[0]
    assert log["tools/calls_per_rollout"] == 1.0 and log["tools/errors_per_rollout"] == 0.5
    assert log["tools/images_returned"] == 0.5 and log["tools/turns"] == 2.0
    assert log["rewards/format/mean"] == 1.0  # every final turn is <think>..</think><answer>..</answer>
    assert seen["rounds"] == 1 and log["tools/calls_after_answer"] == 0.0

    prompt = trainer._tokenizer.decode(seen["batches"][0]["prompt_ids"][0], skip_special_tokens=False)
    if protocol == "hermes":
        positions = [prompt.index(f'"name": "{name}"') for name in ("rotate", "zoom_in", "crop")]
        assert positions == sorted(positions) and [t.__name__ for t in trainer.tools] == ["rotate", "zoom_in", "crop"]
    else:  # PyVision's and DeepEyes' prompts describe their tools: the template shows none
        assert "<tools>" not in prompt and '"name": "' not in prompt

    envs = trainer.environments
    size = envs[0].images[0].size
    good, bad = expected_replies(protocol, family, size)
    assert len(seen["completions"]) == 4
    for row, completion in enumerate(seen["completions"]):
        # What rewards get: the model's turns as written, the reply as read, in order
        assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
        assert completion[0]["content"] == first_turns(protocol, family)[row % 2].removesuffix("<|im_end|>")
        assert completion[2]["content"] == ANSWER
        if row % 2 == 0:
            if protocol == "hermes":
                assert completion[1]["content"].startswith(good) and "<|image_pad|>" in completion[1]["content"]
            else:
                assert completion[1]["content"] == good
        else:
            assert completion[1]["content"].startswith(bad)
            assert "<|image_pad|>" not in completion[1]["content"]
    if protocol == "pyvision":
        assert "boom" in seen["completions"][1][1]["content"]
    # --rollout_log shows the same: the turns as written, the replies as read
    logged = [json.loads(line)["completion"] for line in rollout_log.read_text().splitlines()]
    assert logged == [completion_text(c) for c in seen["completions"]]
    assert first_turns(protocol, family)[0].removesuffix("<|im_end|>") in logged[0] and good in logged[0]

    # The loss masks the replies: model runs are the two turns, the tool run is the reply in a user turn
    batch = seen["batches"][0]
    tokenizer = trainer._tokenizer
    for row in range(batch["completion_ids"].size(0)):
        runs = segments(tokenizer, batch["completion_ids"][row], batch["tool_mask"][row], batch["completion_mask"][row])
        assert [m for m, _ in runs] == [1, 0, 1]
        assert runs[0][1].startswith(first_turns(protocol, family)[row % 2])
        assert runs[1][1].startswith("\n<|im_start|>user\n") and runs[1][1].endswith(
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        assert "<answer>4</answer>" in runs[2][1] and "<answer>4</answer>" not in runs[1][1]
    assert batch["num_images"] == [2, 1, 2, 1]

    # Log-prob parity: the trainer's pass and TRL's own on the multi-turn batch
    from trl import GRPOTrainer

    ids = batch["completion_ids"]
    input_ids = torch.cat([batch["prompt_ids"], ids], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keys = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids", "num_tiles")
    mm = {k: batch[k] for k in keys if k in batch}
    model = trainer.model.eval()
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, ids.size(1), **mm)
        trls, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention, ids.size(1), **mm
        )
    torch.testing.assert_close(ours, trls, rtol=0, atol=1e-5)
    if family == "qwen2_5_vl":  # and an independent forward fed exactly the images each rollout saw
        check_against_own_forward(trainer, batch, ours, input_ids, attention)


def check_against_own_forward(trainer, batch, ours, input_ids, attention):
    def row_logps(row: int, images: list) -> torch.Tensor:
        return own_forward_logps(trainer, input_ids, attention, batch["completion_mask"], row, images)

    for row, env in enumerate(trainer.environments):
        n = int(batch["completion_mask"][row].sum())
        torch.testing.assert_close(ours[row, :n], row_logps(row, env.images), rtol=0, atol=1e-5)
        if len(env.images) == 2:  # control: the prompt image in place of the tool's changes the log-probs
            wrong = row_logps(row, [env.images[0], env.images[0].resize(env.images[1].size)])
            assert (wrong - ours[row, :n]).abs().max() > 1e-3


def test_a_call_in_the_answer_turn_is_not_run(tiny_models, dataset, tmp_path):
    """The answer ends the rollout: the call written after it is counted, not run (the control, the same call
    without an answer, runs in the hermes case above)."""
    call = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [4, 4, 44, 44]}}\n</tool_call><|im_end|>'
    answered = ["<think>done</think><answer>4</answer>\n" + call] * 2
    trainer, seen = run("hermes", "qwen2_5_vl", tiny_models, dataset, tmp_path / "a", first=answered)
    log = trainer.state.log_history[0]
    assert log["tools/calls_after_answer"] == 1.0 and log["tools/calls_per_rollout"] == 0.0
    assert log["tools/turns"] == 1.0 and seen["rounds"] == 0 and log["tools/call_frequency"] == 0.0
    assert all(len(c) == 1 and "<tool_call>" in c[0]["content"] for c in seen["completions"])


def test_the_image_budget_answers_with_an_error(tiny_models, dataset, tmp_path):
    trainer, seen = run(
        "deepeyes", "qwen2_5_vl", tiny_models, dataset, tmp_path / "out", extra=["--max_tool_images", "0"]
    )
    log = trainer.state.log_history[0]
    assert log["tools/images_returned"] == 0.0 and log["tools/image_budget_refusals"] == 0.5
    assert log["tools/errors_per_rollout"] == 1.0
    reply = seen["completions"][0][1]["content"]
    assert re.fullmatch(r"Error: this conversation already holds 0 tool images.*--max_tool_images 0.*", reply)


def test_the_context_budget_ends_the_rollout_without_running_the_call(tiny_models, dataset, tmp_path):
    """The prompts fit in 70 tokens, prompt and first turn do not: the first turn's call is not run, the rollout
    ends there."""
    extra = ["--max_context_tokens", "70"]
    trainer, seen = run("deepeyes", "qwen2_5_vl", tiny_models, dataset, tmp_path / "out", extra=extra)
    log = trainer.state.log_history[0]
    batch = seen["batches"][0]
    prompt = int(batch["prompt_mask"].sum(1).max())
    assert prompt < 70 <= prompt + int(batch["completion_mask"].sum(1).min())
    assert log["tools/context_stops"] == 1.0 and log["tools/calls_per_rollout"] == 0.0 and log["tools/turns"] == 1.0
    assert seen["rounds"] == 0 and all(len(c) == 1 for c in seen["completions"])


def test_the_turn_budget_cuts_real_generation(tiny_models, dataset, tmp_path):
    """The tiny model's own turns (the speed path's generation) stop at --max_turn_tokens."""
    data, plugin = dataset
    argv = base_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out", steps=1)
    argv += ["--max_completion_length", "24", "--tools", "zoom_in", "--max_turn_tokens", "3"]
    argv += ["--generation_kwargs", '{"min_new_tokens": 10}']  # control below: no end-of-turn before 10 tokens
    log = main(*parse_args(argv)).state.log_history[0]
    assert log["completions/max_length"] == 3.0 and log["tools/turns"] == 1.0
    control = main(
        *parse_args([*argv[:-4], "--generation_kwargs", '{"min_new_tokens": 10}', "--output_dir", str(tmp_path / "c")])
    )
    assert control.state.log_history[0]["completions/min_length"] >= 10
