"""``vlm-grpo-sft --tools``: a tool rollout is trained on the very tokens the GRPO run builds for it (per protocol),
with the loss on the model's turns only; flags it cannot honour are errors."""

from __future__ import annotations

import json

import pytest

from e2e_utils import make_dataset
from test_tool_protocols_e2e import ANSWER, first_turns, run
from vlm_grpo.eval_tools import ToolLoop
from vlm_grpo.sft_tools import ToolRolloutCollator, ToolRolloutTransform
from vlm_grpo.testing.tiny import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("sft_tools"), kinds=("single",))


def assert_sft_trains_grpo_tokens(trainer, seen, protocol, family):
    """Each rollout of a scripted GRPO step (:func:`test_tool_protocols_e2e.run`), replayed as SFT encodes it:
    the same tokens, prompt to answer (image tokens included), and labels exactly on the tokens the loss of GRPO
    keeps (the model's turns; prompt and tool replies masked)."""
    batch = seen["batches"][0]
    processor = trainer.processing_class
    tools = ["python"] if protocol == "pyvision" else ["zoom_in"]
    options = '{"python": {"timeout": 20, "pool_size": 1}}' if protocol == "pyvision" else None
    loop = ToolLoop(None, processor, trainer.vlm_module, tools, options, protocol=protocol)
    transform = ToolRolloutTransform(trainer.vlm_module, loop, processor)
    rows = list(trainer.train_dataset)
    for i in range(batch["completion_ids"].size(0)):
        image = trainer.environments[i].images[0].tobytes()
        row = next(r for r in rows if r["images"][0].tobytes() == image)
        turns = [first_turns(protocol, family)[i % 2].removesuffix("<|im_end|>"), ANSWER]
        encoded = transform.encode({**row, "assistant_turns": turns})
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        kept = batch["completion_mask"][i].bool()
        completion = batch["completion_ids"][i][kept].tolist()
        assert encoded["input_ids"] == prompt + completion  # the same tokens, image tokens included
        trained = [label != -100 for label in encoded["labels"]]
        model_tokens = [bool(m) for m in batch["tool_mask"][i][kept].tolist()]
        assert trained == [False] * len(prompt) + model_tokens
        assert [t for t, keep in zip(encoded["labels"], trained, strict=True) if keep] == [
            t for t, m in zip(completion, model_tokens, strict=True) if m
        ]


# Qwen2.5-VL's three protocols are checked with the evaluation loop (test_eval_tool_protocols.py, one GRPO run)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "qwen2_5_vl"])
def test_sft_trains_the_tokens_grpo_builds(family, tiny_models, data, tmp_path):
    trainer, seen = run("deepeyes", family, tiny_models, data, tmp_path / "grpo", stage="_generate_turn")
    assert_sft_trains_grpo_tokens(trainer, seen, "deepeyes", family)


def sft_argv(tiny_models, path, out, *extra):
    return [
        "--model_name_or_path", str(tiny_models["qwen2_5_vl"]), "--data_file_paths", str(path),
        "--image_folders", str(path.parent / "images"), "--output_dir", str(out), "--max_steps", "1",
        "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--report_to", "none",
        "--save_strategy", "no", "--gradient_checkpointing", "false", "--dataloader_num_workers", "0",
        "--logging_steps", "1", *extra,
    ]  # fmt: skip


def write_trajectories(data, folder, box=(4, 4, 44, 44)):
    """The test rows with ``assistant_turns``: a zoom on ``box`` (in the family's frame), then the answer."""
    path, _ = data
    out = folder / "train.jsonl"
    call = json.dumps({"name": "zoom_in", "arguments": {"bbox_2d": list(box)}})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    turns = [f"<tool_call>\n{call}\n</tool_call>", ANSWER]
    out.write_text("".join(json.dumps({**r, "assistant_turns": turns}) + "\n" for r in rows))
    (folder / "images").symlink_to(path.parent / "images")
    return out


@pytest.fixture(scope="module")
def trajectories(data, tmp_path_factory):
    return write_trajectories(data, tmp_path_factory.mktemp("trajectories"))


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_with_tools_runs_and_learns_from_the_turns(family, tiny_models, data, tmp_path):
    from test_tool_protocols_e2e import BOX
    from vlm_grpo.sft_jsonl import main, parse_args

    (tmp_path / "rows").mkdir()
    path = write_trajectories(data, tmp_path / "rows", BOX[family])
    argv = sft_argv(tiny_models, path, tmp_path / "out", "--tools", "zoom_in")
    argv[1] = str(tiny_models[family])
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 1 and trainer.state.log_history[0]["loss"] > 0
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    assert batch["pixel_values"].size(0) > 0
    if "image_grid_thw" in batch:  # the Qwen families: two images per row, their tokens typed as images
        assert batch["image_grid_thw"].size(0) == 4 and trainer.train_dataset[0]["types"].count(1) > 0
    assert (batch["labels"] != -100).sum() < batch["attention_mask"].sum()  # the prompt and replies are masked


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tools", "zoom_in", "--max_turn_tokens", "8"], "--max_turn_tokens: vlm-grpo-sft generates nothing"),
        (["--tool_protocol", "pyvision"], "--tool_protocol without --tools"),
        (["--tools", "zoom_in", "--tool_protocol", "nope"], "nope"),
        (["--tools", "zoom_in", "--max_length", "64"], "--max_length with --tools"),
        (["--tools", "zoom_in", "--assistant_only_loss", "false"], "--assistant_only_loss false with --tools"),
    ],
)
def test_flags_it_cannot_honour_are_errors(tiny_models, trajectories, tmp_path, extra, message):
    from vlm_grpo.cli_errors import UserError
    from vlm_grpo.sft_jsonl import main, parse_args

    with pytest.raises((UserError, KeyError, ValueError), match=message):
        main(*parse_args(sft_argv(tiny_models, trajectories, tmp_path / "out", *extra)))


def test_rows_without_turns_are_named(tiny_models, data, tmp_path):
    from vlm_grpo.cli_errors import UserError
    from vlm_grpo.sft_jsonl import main, parse_args

    path, _ = data
    with pytest.raises(UserError, match="needs 'assistant_turns'"):
        main(*parse_args(sft_argv(tiny_models, path, tmp_path / "out", "--tools", "zoom_in")))


def test_the_collator_pads_and_keeps_every_image():
    import torch

    one = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "types": [0, 1, 0], "fields": [{"x": torch.ones(2, 3)}]}
    two = {"input_ids": [4], "labels": [4], "types": [0], "fields": [{"x": torch.zeros(1, 3)}]}
    batch = ToolRolloutCollator(0, "mm_token_type_ids")([one, two])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["mm_token_type_ids"].tolist() == [[0, 1, 0], [0, 0, 0]] and batch["x"].shape == (3, 3)
