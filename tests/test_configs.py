"""The trainers read their options from one config class: a plain TRL config gets our documented defaults."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import TrainingArguments
from trl import GRPOConfig, SFTConfig

from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.sft_trainer import VLMSFTConfig
from vlm_grpo.trainer import VLMGRPOTrainer
from vlm_grpo.trainer_common import as_vlm_config

CPU = {"use_cpu": True, "bf16": False, "report_to": "none"}


def _our_fields(config_cls, base):
    return [f for f in dataclasses.fields(config_cls) if f.name not in {g.name for g in dataclasses.fields(base)}]


@pytest.mark.parametrize(("base", "ours"), [(GRPOConfig, VLMGRPOConfig), (SFTConfig, VLMSFTConfig)])
def test_a_plain_trl_config_keeps_its_values_and_gets_our_defaults(base, ours, tmp_path):
    extra = {"num_generations": 4, "per_device_train_batch_size": 4} if base is GRPOConfig else {}
    plain = base(output_dir=str(tmp_path), learning_rate=1.234e-5, max_steps=7, **CPU, **extra)
    converted = as_vlm_config(plain, ours, "org/model", "X")
    assert isinstance(converted, ours)
    assert (converted.learning_rate, converted.max_steps, converted.output_dir) == (1.234e-5, 7, str(tmp_path))
    reference = ours(output_dir=str(tmp_path), **CPU, **extra)
    added = _our_fields(ours, base)
    assert added, "the VLM config adds no field?"
    for f in added:
        assert getattr(converted, f.name) == getattr(reference, f.name), f.name


def test_none_and_our_own_config_and_a_wrong_type(tmp_path):
    ours = VLMGRPOConfig(output_dir=str(tmp_path), **CPU, num_generations=4, per_device_train_batch_size=4)
    assert as_vlm_config(ours, VLMGRPOConfig, "m", "GRPO") is ours
    assert as_vlm_config(None, VLMGRPOConfig, "Qwen/Qwen2-VL-2B", "GRPO").output_dir == "Qwen2-VL-2B-GRPO"
    with pytest.raises(TypeError, match=r"VLMGRPOConfig \(or a trl\.GRPOConfig\), not TrainingArguments"):
        as_vlm_config(TrainingArguments(output_dir=str(tmp_path), **CPU), VLMGRPOConfig, "m", "GRPO")


def test_the_grpo_trainer_runs_the_speed_path_from_a_plain_grpo_config(tiny_models, tmp_path):
    """The speed options are on by default: a plain GRPOConfig must not silently turn them off."""
    from vlm_grpo.data import prepare_rows, read_rows, to_datasets
    from vlm_grpo.modules import get_vlm_module

    model_dir = str(tiny_models["qwen2_5_vl"])
    module = get_vlm_module(model_dir)
    processor = module.load_processor(model_dir)
    row = {"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "hi"}]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    rows, bad = read_rows([str(tmp_path / "rows.jsonl")], task_type="raw")
    dataset, _ = to_datasets(prepare_rows(rows, bad, module, processor), module)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=1,
                      max_completion_length=4, **CPU)  # fmt: skip
    trainer = VLMGRPOTrainer(
        model=module.load_model(model_dir, dtype=torch.float32),
        reward_funcs=[lambda completions, **kw: [float(len(str(c))) for c in completions]],
        args=args,
        vlm_module=module,
        processing_class=processor,
        train_dataset=dataset,
    )
    assert isinstance(trainer.args, VLMGRPOConfig)
    assert trainer.args.share_prompt and trainer.args.share_prefill and trainer.args.fast_decode
