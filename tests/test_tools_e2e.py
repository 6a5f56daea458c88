"""Multi-turn tool rollouts end to end through grpo_jsonl.py's main: a scripted policy really calls tools.

The scripted policy: the first turn of every rollout is fixed tool-call text (one good call, or a bad one
for every other rollout); the turns after a tool result are the tiny model's own sampled tokens. Everything
else (TRL's tool loop, tool execution, images returned into the conversation, masks, loss) is the real path.
"""

from __future__ import annotations

import json

import pytest
import torch

from e2e_utils import base_args, make_dataset, original_params, own_forward_logps
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A box valid in each family's frame: Qwen2.5-VL writes resized-image pixels (>= 56 here), the others 0-1000.
GOOD_BOX = {"qwen2_5_vl": [4, 4, 44, 44], "qwen2_vl": [100, 100, 800, 800], "qwen3_vl": [100, 100, 800, 800]}
GOOD_BOX["internvl"] = GOOD_BOX["qwen2_vl"]


def short_args(*args, **kwargs) -> list[str]:
    """e2e_utils' arguments, with the model's own turns cut at 24 tokens (tool results are not)."""
    return [*base_args(*args, **kwargs), "--generation_kwargs", '{"max_new_tokens": 24}']


def tool_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call><|im_end|>"


def scripted_calls(family: str, tool: str) -> list[str]:
    if tool == "zoom_in":
        good = tool_call("zoom_in", {"bbox_2d": GOOD_BOX[family], "image_index": 0, "label": "square"})
        bad = tool_call("zoom_in", {"bbox_2d": [50, 50, 10, 10]})  # inverted: a tool error for the model
    else:
        good = tool_call("python", {"code": "print('size', image.size)\ndisplay(image.crop((0, 0, 24, 24)))"})
        bad = tool_call("python", {"code": "open('/etc/passwd').read()"})
    return [good, bad]


@pytest.fixture
def scripted_policy(monkeypatch):
    """Replace only the first generation of each rollout (num_generations > 1) by tool-call text."""
    calls: list[str] = []
    seen = {"first_turns": 0, "tool_turns": 0, "tool_images": 0, "tool_rounds": 0}
    original = VLMGRPOTrainer._generate_single_turn

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations == 1 and seen.get("later_turns"):  # scripted turns after tool results, one per round
            text = seen["later_turns"][seen["tool_rounds"]]
            seen["tool_rounds"] += 1
            seen["tool_turns"] += len(prompt_ids)
            return [self._tokenizer.encode(text, add_special_tokens=False) for _ in prompt_ids], None
        if num_generations == 1 and seen.get("always_call"):  # a policy that never stops calling tools
            seen["tool_turns"] += len(prompt_ids)
            return [self._tokenizer.encode(calls[0], add_special_tokens=False) for _ in prompt_ids], None
        if num_generations == 1:  # TRL's tool loop: the model continues after the tool result
            seen["tool_turns"] += len(prompt_ids)
            seen["tool_images"] += int(has_tool_images)
            return original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        seen["first_turns"] += len(prompt_ids)
        ids = [self._tokenizer.encode(calls[i % len(calls)], add_special_tokens=False) for i in range(len(prompt_ids))]
        return ids, None

    monkeypatch.setattr(VLMGRPOTrainer, "_generate_single_turn", generate)
    return calls, seen


def with_released_template(model_dir, family: str, out):
    """A copy of the tiny checkpoint whose processor carries the family's released chat template."""
    import shutil

    from transformers import AutoProcessor
    from trl.chat_template_utils import qwen2_5_vl_chat_template, qwen3_vl_chat_template

    shutil.copytree(model_dir, out)
    processor = AutoProcessor.from_pretrained(out)
    processor.chat_template = {"qwen3_vl": qwen3_vl_chat_template, "qwen2_5_vl": qwen2_5_vl_chat_template}[family]
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("tools_data"), kinds=("single",))


@pytest.mark.parametrize(
    ("family", "tool"),
    [
        ("qwen2_5_vl", "zoom_in"),
        ("qwen2_5_vl", "python+lora"),
        ("internvl", "zoom_in+beta"),
        ("internvl", "python"),
        ("qwen2_vl", "zoom_in"),
        ("qwen2_vl", "python"),
        ("qwen3_vl", "zoom_in"),
        ("qwen3_vl", "python"),
        ("qwen3_vl", "zoom_in+released"),  # the released Qwen3-VL template (it renders tools)
        ("qwen2_5_vl", "zoom_in+released"),  # the released Qwen2.5-VL template (no tools: ours replaces it)
    ],
)
def test_two_grpo_steps_with_tool_calls(family, tool, tiny_models, dataset, scripted_policy, tmp_path):
    data, plugin = dataset
    calls, seen = scripted_policy
    tool, _, variant = tool.partition("+")  # beta: a reference pass that also sees the tool images; lora: PEFT
    calls += scripted_calls(family, tool)
    model_dir = tiny_models[family]
    if variant == "released":
        model_dir = with_released_template(model_dir, family, tmp_path / "model")
    argv = short_args(model_dir, data, plugin, tmp_path / "out")
    argv += {"beta": ["--beta", "0.04"], "lora": ["--use_peft", "true", "--lora_r", "4"]}.get(variant, [])
    argv += ["--tools", tool, "--max_tool_calling_iterations", "2", "--max_completion_length", "320"]
    argv[argv.index("--reward_funcs") + 1 : argv.index("--reward_funcs") + 3] = [f"{plugin}:text_shape", "tool_use"]
    if tool == "python":
        argv += ["--tool_kwargs", '{"python": {"timeout": 20, "pool_size": 1}}']
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 2
    if variant == "released":  # Qwen3-VL's own template kept; Qwen2.5-VL's replaced by one that renders tools
        from trl.chat_template_utils import qwen3_vl_chat_template

        template = trainer.processing_class.chat_template
        assert (template == qwen3_vl_chat_template) == (family == "qwen3_vl") and "<tool_response>" in template

    # Tools were called, half of the calls failed with an error message, images came back into the conversation.
    logs = [entry for entry in trainer.state.log_history if "tools/calls_per_rollout" in entry]
    assert len(logs) == 2
    assert all(entry["tools/calls_per_rollout"] == 1.0 for entry in logs)
    assert all(entry["tools/errors_per_rollout"] == 0.5 for entry in logs)
    assert all(entry["tools/images_returned"] == 0.5 for entry in logs)
    assert all(entry["tools/turns"] == 2.0 for entry in logs)  # every rollout: tool call, then an answer
    assert seen["first_turns"] == 8 and seen["tool_turns"] == 8 and seen["tool_images"] == 2
    # tool_use pays the successful half of the rollouts only
    assert all(entry["rewards/tool_use/mean"] == pytest.approx(0.5) for entry in logs)

    # the language model learned from the multi-turn batch
    if variant == "lora":
        lora = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
        assert lora and any(p.abs().sum() > 0 for p in lora)
        return
    before = original_params(model_dir)
    after = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert any(not torch.equal(before[n], after[n]) for n in before if "layers" in n)


def test_tool_tokens_are_masked_and_images_reach_the_loss_pass(tiny_models, dataset, scripted_policy, tmp_path):
    """The batch the loss sees: tool-result tokens (with the zoomed image's tokens) masked, image passed in."""
    data, plugin = dataset
    calls, _ = scripted_policy
    calls += scripted_calls("qwen2_5_vl", "zoom_in")[:1]
    model_dir = tiny_models["qwen2_5_vl"]
    argv = short_args(model_dir, data, plugin, tmp_path / "out", steps=1)
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", "1", "--max_completion_length", "160"]
    batches = []
    original = VLMGRPOTrainer._generate_and_score_completions

    def keep(self, inputs):
        out = original(self, inputs)
        batches.append(out)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_generate_and_score_completions", keep)
        trainer = main(*parse_args(argv))
    batch = batches[0]
    image_pad = trainer._tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids, mask = batch["completion_ids"], batch["tool_mask"]
    for row in range(ids.size(0)):
        tool_tokens = ids[row][mask[row] == 0]
        assert (tool_tokens == image_pad).sum() > 0, "the zoomed image's tokens are not in the tool result"
        assert (ids[row][mask[row] == 1] == image_pad).sum() == 0, "image tokens left in the loss"
    # 4 prompt images + 4 zoomed images go to the log-prob passes, in conversation order
    assert batch["image_grid_thw"].size(0) == 8
    assert batch["num_images"] == [2, 2, 2, 2]

    # Parity: the batched log-prob pass (ours, which hands tool batches to TRL's path, and TRL's own) equals an
    # independent per-row forward fed the images the rollout saw: the prompt image and the zoomed view the tool
    # returned. Negative control: the prompt image in place of the zoomed view changes the log-probs.
    from trl import GRPOTrainer

    model = trainer.model.eval()
    input_ids = torch.cat([batch["prompt_ids"], ids], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    mm = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids") if k in batch}
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, attention, ids.size(1), **mm)
        trls, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, input_ids, attention, ids.size(1), **mm
        )
    torch.testing.assert_close(ours, trls, rtol=0, atol=1e-5)

    def row_logps(row: int, images: list) -> torch.Tensor:
        return own_forward_logps(trainer, input_ids, attention, batch["completion_mask"], row, images)

    for row, env in enumerate(trainer.environments):
        n = int(batch["completion_mask"][row].sum())
        assert len(env.images) == 2
        torch.testing.assert_close(ours[row, :n], row_logps(row, env.images), rtol=0, atol=1e-5)
        wrong = row_logps(row, [env.images[0], env.images[0].resize(env.images[1].size)])
        assert (wrong - ours[row, :n]).abs().max() > 1e-3


def test_a_malformed_first_call_is_answered_with_an_error(tiny_models, dataset, scripted_policy, tmp_path):
    data, plugin = dataset
    calls, _ = scripted_policy
    calls.append('<tool_call>\n{"name": "zoom_in", "arguments": [1, 2}\n</tool_call><|im_end|>')
    argv = short_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out", steps=1)
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", "1", "--max_completion_length", "200"]
    argv[argv.index("--reward_funcs") + 1 : argv.index("--reward_funcs") + 3] = [f"{plugin}:text_shape", "tool_format"]
    rollouts = []
    original = VLMGRPOTrainer._tool_call_loop

    def keep(self, *args):
        out = original(self, *args)
        rollouts.extend(out[1])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_tool_call_loop", keep)
        trainer = main(*parse_args(argv))
    assert len(rollouts) == 4
    for turns in rollouts:
        assert [m["role"] for m in turns] == ["assistant", "tool", "assistant"]
        assert '"arguments": [1, 2}' in turns[0]["content"]
        assert turns[1]["content"].startswith("{'error': 'the <tool_call> block could not be read")
    log = trainer.state.log_history[0]
    assert log["tools/failure_frequency"] == 1.0 and log["rewards/tool_format/mean"] == 0.0
    assert log["tools/calls_per_rollout"] == 1.0 and log["tools/errors_per_rollout"] == 1.0


@pytest.mark.parametrize("wrapper", [True, False])
def test_a_malformed_later_call_is_answered_with_an_error(wrapper, tiny_models, dataset, scripted_policy, tmp_path):
    """Call, tool result, a malformed call, the error message, an answer: TRL parses the turns after a tool
    result inside its own loop. Negative control: without the parser that marks them (``wrapper=False``) the
    malformed call ends the rollout as a plain answer."""
    import contextlib

    import vlm_grpo.trainer
    from vlm_grpo.tools.protocols import HERMES_MALFORMED
    from vlm_grpo.tools.rollouts import MALFORMED_CALL

    data, plugin = dataset
    calls, seen = scripted_policy
    calls += scripted_calls("qwen2_5_vl", "zoom_in")[:1]
    seen["later_turns"] = ["<tool_call>{not json</tool_call><|im_end|>", "<answer>4</answer><|im_end|>"]
    argv = short_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out", steps=1)
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", "3", "--max_completion_length", "300"]
    rollouts, batches = [], []
    loop, score = VLMGRPOTrainer._tool_call_loop, VLMGRPOTrainer._generate_and_score_completions

    def keep_rollouts(self, *args):
        out = loop(self, *args)
        rollouts.extend(out[1])
        return out

    def keep_batch(self, inputs):
        batches.append(score(self, inputs))
        return batches[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_tool_call_loop", keep_rollouts)
        mp.setattr(VLMGRPOTrainer, "_generate_and_score_completions", keep_batch)
        if not wrapper:
            mp.setattr(vlm_grpo.trainer, "parse_with_protocol", lambda trainer, turns: contextlib.nullcontext())
        trainer = main(*parse_args(argv))
    log = trainer.state.log_history[0]
    assert len(rollouts) == 4
    if not wrapper:  # the malformed call is read as the answer: the rollout ends at its second turn
        assert all([m["role"] for m in turns] == ["assistant", "tool", "assistant"] for turns in rollouts)
        assert all("tool_calls" not in turns[-1] for turns in rollouts)
        assert seen["tool_rounds"] == 1 and log["tools/errors_per_rollout"] == 0.0
        return
    assert seen["tool_rounds"] == 2  # the answer came after the error message, not by the iteration limit
    marker = [{"type": "function", "function": {"name": MALFORMED_CALL, "arguments": {"message": HERMES_MALFORMED}}}]
    for turns in rollouts:
        assert [m["role"] for m in turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert turns[0]["tool_calls"][0]["function"]["name"] == "zoom_in" and turns[1]["name"] == "zoom_in"
        assert turns[2]["content"] == "<tool_call>{not json</tool_call>" and turns[2]["tool_calls"] == marker
        assert turns[3]["name"] == MALFORMED_CALL
        assert turns[3]["content"].startswith("{'error': 'the <tool_call> block could not be read")
        assert turns[4] == {"role": "assistant", "content": "<answer>4</answer>"}
    # Both calls counted, the malformed one as a failure, by TRL and per rollout
    assert log["tools/call_frequency"] == 2.0 and log["tools/failure_frequency"] == 0.5
    assert log["tools/calls_per_rollout"] == 2.0 and log["tools/errors_per_rollout"] == 1.0
    assert log["tools/turns"] == 3.0

    # The loss sees the model's three turns; both tool results, the error message included, are masked.
    batch = batches[0]
    tokenizer = trainer._tokenizer
    assert type(tokenizer).__name__ != "ProtocolParser"  # the tokenizer is back after the loop
    ids, mask, kept = batch["completion_ids"], batch["tool_mask"], batch["completion_mask"]
    for row in range(ids.size(0)):
        model_text = tokenizer.decode(ids[row][(mask[row] == 1) & (kept[row] == 1)])
        tool_text = tokenizer.decode(ids[row][(mask[row] == 0) & (kept[row] == 1)])
        assert "{not json" in model_text and "<answer>4</answer>" in model_text and "zoom_in" in model_text
        assert "could not be read" not in model_text and "could not be read" in tool_text


@pytest.mark.parametrize("case", ["never_stops", "overflow"])
def test_endless_callers_stop_and_overflowing_results_end_the_rollout(
    case, tiny_models, dataset, scripted_policy, tmp_path
):
    data, plugin = dataset
    calls, seen = scripted_policy
    calls += scripted_calls("qwen2_5_vl", "zoom_in")[:1]
    seen["always_call"] = case == "never_stops"
    budget = "400" if case == "never_stops" else "80"  # 80: the call (74 tokens) fits, the tool result does not
    argv = short_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out", steps=1)
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", "2", "--max_completion_length", budget]
    trainer = main(*parse_args(argv))
    log = trainer.state.log_history[0]
    if case == "never_stops":  # call, result, call, result, call: stopped after 2 rounds
        assert log["tools/turns"] == 3.0 and log["tools/calls_per_rollout"] == 2.0
    else:  # the tool ran, its result did not fit: the rollout ends after its first turn, nothing appended
        assert log["tools/turns"] == 1.0 and log["tools/calls_per_rollout"] == 1.0
        assert log["completions/max_length"] <= 80 and seen["tool_turns"] == 0
