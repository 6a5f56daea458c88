"""SFT stage: assistant-only labels, loss falling over 30 steps, two learning rates, outputs GRPO can load."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from e2e_utils import make_dataset, original_params
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.sft_jsonl import build_trainer, main, parse_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    data, _ = make_dataset(tmp_path_factory.mktemp("sft_data"), kinds=("single", "multi", "text"), n=2)
    return data


def sft_args(model, data, output_dir, steps=2, *extra):
    return [
        "--model_name_or_path", str(model),
        "--data_file_paths", str(data),
        "--image_folders", str(data.parent / "images"),
        "--output_dir", str(output_dir),
        "--max_steps", str(steps),
        "--per_device_train_batch_size", "3",
        "--learning_rate", "1e-3",
        "--gradient_checkpointing", "false",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "7",
        "--dataloader_num_workers", "0",
        *extra,
    ]  # fmt: skip


def labelled_text(trainer, examples):
    """The text of the tokens that carry loss, per example, and the labels tensor."""
    batch = trainer.data_collator(examples)
    tokenizer = trainer.processing_class.tokenizer
    texts = []
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        texts.append(tokenizer.decode(ids[labels != -100], skip_special_tokens=False))
    return texts, batch


def assert_labels_are_the_answers(trainer, n):
    rows = [dict(trainer.train_dataset[i]) for i in range(n)]
    assert {r["id"].split("-")[0] for r in rows} == {"single", "multi", "text"}
    texts, batch = labelled_text(trainer, [dict(r) for r in rows])
    for row, text in zip(rows, texts, strict=True):
        # the answer and the end-of-turn token; prompt/completion rows also keep the template's trailing newline
        assert text in (row["solution"] + "<|im_end|>", row["solution"] + "<|im_end|>\n"), (row["id"], text)
    # nothing of the prompt (system, question, image placeholders) is a label
    image_token = trainer.processing_class.tokenizer.convert_tokens_to_ids(trainer.processing_class.image_token)
    assert (batch["input_ids"] == image_token).any()
    assert not (batch["labels"] == image_token).any()
    return rows


@pytest.mark.parametrize(("family", "assistant_masks"), [("qwen2_5_vl", True), ("internvl", False)])
def test_only_assistant_tokens_carry_loss(family, assistant_masks, tiny_models, dataset, tmp_path):
    trainer, resume = build_trainer(*parse_args(sft_args(tiny_models[family], dataset, tmp_path / "out")))
    assert resume is None
    # the tiny Qwen template has {% generation %} markers; InternVL's processor cannot return the mask
    # (transformers 5.2x), so its rows go prompt/completion with completion-only loss
    assert trainer.args.assistant_only_loss is assistant_masks
    assert trainer.completion_only_loss is not assistant_masks
    rows = assert_labels_are_the_answers(trainer, 6)
    assert ("messages" in rows[0]) is assistant_masks


def test_template_without_generation_markers_falls_back_to_completion_only_loss(tiny_models, dataset, tmp_path):
    model = shutil.copytree(tiny_models["qwen2_5_vl"], tmp_path / "model")
    template = (model / "chat_template.jinja").read_text()
    stripped = re.sub(r"\{%-?\s*(end)?generation\s*-?%\}", "", template)
    assert stripped != template
    (model / "chat_template.jinja").write_text(stripped)
    trainer, _ = build_trainer(*parse_args(sft_args(model, dataset, tmp_path / "out")))
    assert not trainer.args.assistant_only_loss and trainer.completion_only_loss
    rows = assert_labels_are_the_answers(trainer, 6)
    assert "completion" in rows[0] and "messages" not in rows[0]


def test_loss_falls_over_30_steps_with_separate_learning_rates(tiny_models, dataset, tmp_path):
    model_dir = tiny_models["qwen2_5_vl"]
    out = tmp_path / "out"
    trainer = main(*parse_args(sft_args(model_dir, dataset, out, 30, "--llm_lr", "3e-3", "--vision_encoder_lr", "0")))
    assert trainer.state.global_step == 30
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.7 * first, f"loss did not fall: {losses}"

    # two parameter groups per part, each with its own learning rate; the vision group did not move (lr 0)
    module = get_vlm_module(str(model_dir))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for group in trainer.optimizer.param_groups:
        is_vision = {module.is_vision_parameter(names[id(p)]) for p in group["params"]}
        assert len(is_vision) == 1
        assert group["initial_lr"] == (0.0 if is_vision.pop() else 3e-3)
    before = original_params(model_dir)
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert changed and all(not module.is_vision_parameter(n) for n in changed)

    # the output folder is a model GRPO can start from
    assert (out / "config.json").is_file() and (out / "chat_template.jinja").is_file()
    assert get_vlm_module(str(out)).name == "qwen2_5_vl"


def test_lora_sft_writes_merged_model_and_adapter(tiny_models, dataset, tmp_path):
    from transformers import AutoModelForImageTextToText

    model_dir = tiny_models["qwen2_5_vl"]
    out = tmp_path / "out"
    lora = ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "1e-2"]
    main(*parse_args(sft_args(model_dir, dataset, out, 2, *lora)))
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    merged = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    before = original_params(model_dir)
    after = dict(merged.named_parameters())
    assert before.keys() == after.keys()
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all("visual" not in n for n in changed)  # LoRA stays off the vision tower


@pytest.mark.parametrize("batched", [True, False])
def test_sft_batches_the_vision_towers_attention_unless_turned_off(batched, tiny_models, dataset, tmp_path):
    from vlm_grpo.fastpath.vision_attention import NAME

    flag = [] if batched else ["--batch_vision_attention", "false"]
    trainer, _ = build_trainer(*parse_args(sft_args(tiny_models["qwen2_5_vl"], dataset, tmp_path / "out", 1, *flag)))
    vision = trainer.model.config.vision_config._attn_implementation
    assert vision == (NAME if batched else "sdpa")
    trainer.train()


def test_help_lists_the_sft_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flags = ("--llm_lr", "--vision_encoder_lr", "--assistant_only_loss", "--use_peft", "--freeze_vision_modules")
    for flag in (*flags, "--batch_vision_attention"):
        assert flag in out


def test_a_run_shorter_than_logging_steps_still_reports_its_mean_loss():
    """Two steps with logging_steps=10 log no per-step loss; the closing line gives the run's mean instead."""
    from types import SimpleNamespace

    from vlm_grpo.sft_jsonl import loss_summary

    args = SimpleNamespace(logging_steps=10)
    assert loss_summary([{"train_loss": 7.426, "epoch": 1}], args) == (
        "mean loss 7.4260 (no step logged its own: logging_steps=10)"
    )
    assert (
        loss_summary([{"loss": 2.0}, {"loss": 1.5}, {"train_loss": 1.7}], args) == "first loss 2.0000, last loss 1.5000"
    )
    assert loss_summary([], args) == "no loss logged"
