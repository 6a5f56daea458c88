"""EasyR1's nested YAML: converted field by field (ignored ones listed), and accepted by --config directly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlm_grpo.convert_config import ConfigError, convert, main

REPO = Path(__file__).resolve().parents[1]

EASYR1 = {
    "data": {
        "train_files": "hiyouga/geometry3k@train",
        "val_files": "hiyouga/geometry3k@test",
        "prompt_key": "problem",
        "answer_key": "answer",
        "image_key": "images",
        "max_prompt_length": 2048,
        "max_response_length": 2048,
        "rollout_batch_size": 512,
        "format_prompt": "./examples/format_prompt/math.jinja",
        "seed": 1,
        "max_pixels": 4194304,
        "min_pixels": 262144,
        "filter_overlong_prompts": True,
    },
    "algorithm": {
        "adv_estimator": "grpo",
        "disable_kl": False,
        "use_kl_loss": True,
        "kl_penalty": "low_var_kl",
        "kl_coef": 0.01,
        "online_filtering": True,
        "filter_key": "accuracy",
        "filter_low": 0.01,
        "filter_high": 0.99,
    },
    "worker": {
        "actor": {
            "global_batch_size": 128,
            "micro_batch_size_per_device_for_update": 4,
            "max_grad_norm": 1.0,
            "padding_free": True,
            "model": {"model_path": "Qwen/Qwen2.5-VL-7B-Instruct", "freeze_vision_tower": False},
            "optim": {"lr": 1.0e-6, "weight_decay": 0.01, "strategy": "adamw"},
            "fsdp": {"enable_full_shard": True},
        },
        "rollout": {"n": 5, "temperature": 1.0, "gpu_memory_utilization": 0.6, "tensor_parallel_size": 2},
        "reward": {"reward_type": "batch", "reward_function": "./examples/reward_function/math.py:compute_score"},
    },
    "trainer": {
        "total_epochs": 15,
        "project_name": "easy_r1",
        "experiment_name": "qwen2_5_vl_7b_geo3k_grpo",
        "logger": ["file", "wandb"],
        "nnodes": 1,
        "n_gpus_per_node": 8,
        "max_try_make_batch": 20,
        "val_freq": 5,
        "save_freq": 5,
        "save_limit": 3,
    },
}


def test_easyr1_fields_map_and_the_rest_is_listed():
    flags, notes = convert(EASYR1)
    assert flags["data_file_paths"] == "hiyouga/geometry3k@train"
    assert flags["eval_file_paths"] == "hiyouga/geometry3k@test"
    assert flags["max_completion_length"] == 2048 and flags["max_prompt_length"] == 2048
    assert flags["model_name_or_path"] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert flags["num_generations"] == 5 and flags["learning_rate"] == 1.0e-6
    assert flags["beta"] == 0.01
    assert flags["dynamic_sampling"] is True and flags["filter_key"] == "accuracy"
    assert flags["max_sampling_rounds"] == 20
    assert flags["reward_funcs"] == ["./examples/reward_function/math.py:compute_score"]
    assert flags["report_to"] == ["wandb"]
    assert flags["output_dir"] == "checkpoints/easy_r1/qwen2_5_vl_7b_geo3k_grpo"
    assert flags["save_steps"] == 5 and flags["eval_steps"] == 5 and flags["save_total_limit"] == 3
    # 128 prompts x 5 per update over 8 processes = 80 rows each, in micro-batches of 4: 20 accumulation
    # steps; 512 / 128 = 4 updates per rollout
    assert flags["per_device_train_batch_size"] == 4
    assert flags["gradient_accumulation_steps"] == 20
    assert flags["steps_per_generation"] == 80
    ignored = [n.removeprefix("ignored: ").split(" (")[0] for n in notes if n.startswith("ignored")]
    assert set(ignored) == {
        "worker.actor.padding_free=True",
        "worker.actor.optim.strategy='adamw'",
        "worker.actor.fsdp.enable_full_shard=True",
        "worker.rollout.gpu_memory_utilization=0.6",
        "worker.rollout.tensor_parallel_size=2",
        "worker.reward.reward_type='batch'",
    }
    assert all(n.endswith(")") for n in notes if n.startswith("ignored"))  # each with its reason
    assert any("trainer.logger 'file'" in n for n in notes)
    assert any("WANDB_PROJECT=easy_r1" in n for n in notes)


def test_not_an_easyr1_config_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="not an EasyR1 config"):
        convert({"learning_rate": 1e-6})
    path = tmp_path / "ours.yaml"
    path.write_text("learning_rate: 1.0e-6\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not an EasyR1 config" in err and err.count("\n") == 1


def test_broken_yaml_is_one_error_line_with_its_line(tmp_path, capsys):
    path = tmp_path / "easyr1.yaml"
    path.write_text("data:\n  train_files: [a.parquet\n")
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: not valid YAML: line 3, column 1:") and err.count("\n") == 1


def test_cli_writes_a_yaml_trl_parses(tmp_path, capsys):
    source = tmp_path / "easyr1.yaml"
    source.write_text(yaml.safe_dump(EASYR1))
    assert main([str(source), "-o", str(tmp_path / "ours.yaml")]) == 0
    assert "note: ignored: worker.rollout.tensor_parallel_size=2 (a setting of EasyR1's vLLM" in capsys.readouterr().err
    from vlm_grpo.grpo_jsonl import parse_args

    script, training, model = parse_args(["--config", str(tmp_path / "ours.yaml")])
    assert script.prompt_key == "problem" and script.format_prompt == "./examples/format_prompt/math.jinja"
    assert training.dynamic_sampling and training.steps_per_generation == 80 and training.beta == 0.01
    assert model.model_name_or_path == "Qwen/Qwen2.5-VL-7B-Instruct" and model.max_pixels == 4194304


BATCH_REWARD = """
def compute_score(reward_inputs, **kwargs):
    return [{"overall": float(len(x["response"]) % 3), "accuracy": 0.0} for x in reward_inputs]
"""


@pytest.mark.usefixtures("one_torch_thread")
def test_easyr1_yaml_trains_through_config(tiny_models, tmp_path):
    from test_data_sources import easyr1_table
    from vlm_grpo.grpo_jsonl import main as train
    from vlm_grpo.grpo_jsonl import parse_args

    easyr1_table(2).to_parquet(str(tmp_path / "train.parquet"))
    (tmp_path / "reward.py").write_text(BATCH_REWARD)
    config = {
        "data": {"train_files": str(tmp_path / "train.parquet"), "prompt_key": "question", "answer_key": "gt",
                 "image_key": "pics", "max_response_length": 8, "rollout_batch_size": 1,
                 "format_prompt": str(REPO / "configs" / "templates" / "r1v.jinja")},
        "algorithm": {"disable_kl": True, "online_filtering": False},
        "worker": {"actor": {"global_batch_size": 1, "model": {"model_path": str(tiny_models["qwen2_5_vl"]),
                                                              "enable_gradient_checkpointing": False}},
                   "rollout": {"n": 4}, "reward": {"reward_function": f"{tmp_path / 'reward.py'}:compute_score"}},
        "trainer": {"max_steps": 2, "logger": ["file"], "save_freq": -1},
    }  # fmt: skip
    path = tmp_path / "easyr1.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = ["--config", str(path), "--output_dir", str(tmp_path / "out"), "--save_strategy", "no"]
    trainer = train(*parse_args([*argv, "--dataloader_num_workers", "0", "--logging_steps", "1"]))
    assert trainer.state.global_step == 2
    assert trainer.args.per_device_train_batch_size == 4 and trainer.num_generations == 4
    assert "rewards/compute_score/accuracy" in trainer.state.log_history[0]


def test_shipped_dapo_config_parses():
    from vlm_grpo.grpo_jsonl import parse_args

    script, training, _ = parse_args(["--config", str(REPO / "configs" / "grpo_geo3k_dapo.yaml")])
    assert script.data_file_paths == "hiyouga/geometry3k@train" and script.prompt_key == "problem"
    assert (REPO / script.format_prompt).is_file()
    assert training.dynamic_sampling and training.filter_key == "accuracy" and training.report_to == ["tensorboard"]
    assert training.rollout_log == "runs/geo3k_dapo/rollouts.jsonl"
