"""``vlm-grpo-convert-config verl``: a verl ``main_ppo`` line, RynnBrain's included, means the same run here."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from e2e_utils import make_dataset
from vlm_grpo.convert_verl import VerlConfigError, convert, main, parse_overrides

# RynnBrain's RL stage: its single-node main_ppo line plus the keys of its "RL Training Configuration Details".
RYNNBRAIN_LINE = """python3 -m verl.trainer.main_ppo
    algorithm.adv_estimator=grpo
    data.train_files=/path/to/train.parquet
    data.val_files=/path/to/test.parquet
    data.train_batch_size=128
    data.val_batch_size=128
    data.max_prompt_length=16384
    data.max_response_length=2048
    actor_rollout_ref.model.path=/path/to/sft_model
    actor_rollout_ref.actor.optim.lr=2e-6
    trainer.n_gpus_per_node=8
    trainer.nnodes=1
    trainer.total_epochs=10
    actor_rollout_ref.actor.ppo_mini_batch_size=128
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2
    actor_rollout_ref.actor.ppo_epochs=2
    actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.02
    actor_rollout_ref.rollout.name=sglang
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6
    actor_rollout_ref.rollout.n=5
    trainer.save_freq=50
    trainer.test_freq=10""".split()
ACTOR = "actor_rollout_ref.actor."


def translate(words):
    return convert(parse_overrides(words))


def test_rynnbrain_main_ppo_line(tmp_path):
    flags, notes = translate(RYNNBRAIN_LINE)
    # 128 prompts x 5 = 640 completions per verl step over 8 GPUs: 80 per GPU per optimizer step (mini = 128
    # prompts = the whole batch), in micro-batches of 2 -> 40 accumulation steps; the batch is generated once
    # (40 micro-batches per GPU) and trained on twice (ppo_epochs=2): 2 optimizer steps per verl step.
    assert flags["per_device_train_batch_size"] == 2
    assert flags["gradient_accumulation_steps"] == 40
    assert flags["steps_per_generation"] == 40
    assert flags["num_generations"] == 5 and flags["num_iterations"] == 2
    assert flags["beta"] == 0.02 and flags["learning_rate"] == 2e-6 and isinstance(flags["learning_rate"], float)
    assert (flags["max_prompt_length"], flags["max_completion_length"]) == (16384, 2048)
    assert flags["save_steps"] == 100 and flags["eval_steps"] == 20  # verl steps x 2 optimizer steps
    assert flags["num_train_epochs"] == 10
    # verl's defaults where TRL's differ: constant LR, weight decay 0.01, token-mean loss, gradient checkpointing
    assert flags["lr_scheduler_type"] == "constant" and flags["weight_decay"] == 0.01
    assert flags["loss_type"] == "dapo" and flags["gradient_checkpointing"] is True
    assert flags["model_name_or_path"] == "/path/to/sft_model"
    assert flags["data_file_paths"] == "/path/to/train.parquet"
    assert any("rollout.name='sglang'" in n and n.startswith("ignored") for n in notes)
    assert main([*RYNNBRAIN_LINE, "-o", str(tmp_path / "rl.yaml")]) == 0
    assert yaml.safe_load((tmp_path / "rl.yaml").read_text()) == flags


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [  # (train_batch_size, mini, n, micro, gpus) -> (per_device, accumulation, steps_per_generation, updates)
        ((1024, 256, 5, 4, 8), (4, 40, 160, 4)),
        ((64, 16, 8, 8, 4), (8, 4, 16, 4)),
        ((8, 8, 2, 16, 1), (16, 1, 1, 1)),
    ],
)
def test_batch_sizes_keep_verls_meaning(sizes, expected):
    prompts, mini, n, micro, gpus = sizes
    flags, _ = translate(
        [
            "algorithm.adv_estimator=grpo",
            f"data.train_batch_size={prompts}",
            f"{ACTOR}ppo_mini_batch_size={mini}",
            f"actor_rollout_ref.rollout.n={n}",
            f"{ACTOR}ppo_micro_batch_size_per_gpu={micro}",
            f"trainer.n_gpus_per_node={gpus}",
            "trainer.total_training_steps=3",
        ]
    )
    got = (flags["per_device_train_batch_size"], flags["gradient_accumulation_steps"], flags["steps_per_generation"])
    assert got == expected[:3]
    assert flags["max_steps"] == 3 * expected[3]
    # the invariant behind it: one generation is train_batch_size x n completions over all GPUs
    assert flags["per_device_train_batch_size"] * gpus * flags["steps_per_generation"] == prompts * n


BASE = ["algorithm.adv_estimator=grpo", f"{ACTOR}ppo_micro_batch_size_per_gpu=2", "data.train_batch_size=256"]


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (BASE[1:], "GAE needs a critic"),  # verl's default estimator
        (BASE[:1], "ppo_micro_batch_size_per_gpu is not set"),
        ([*BASE, "data.train_batch_size=200"], "given twice"),
        ([*BASE[:2], "data.train_batch_size=300"], "not a multiple of"),
        ([*BASE, f"{ACTOR}ppo_micro_batch_size_per_gpu=3"], "given twice"),
        ([*BASE[::2], f"{ACTOR}ppo_micro_batch_size_per_gpu=3", "actor_rollout_ref.rollout.n=2"], "not a multiple"),
        ([*BASE, f"{ACTOR}entropy_coeff=0.001"], "no entropy bonus"),
        ([*BASE, f"{ACTOR}loss_agg_mode=seq-mean-token-sum"], "no TRL loss aggregates"),
        ([*BASE, f"{ACTOR}use_kl_loss=True", f"{ACTOR}kl_loss_type=mse"], "k3"),
        ([*BASE, "algorithm.use_kl_in_reward=True"], "KL penalty inside the reward"),
        ([*BASE, "custom_reward_function.path=r.py"], "compute_score"),
        ([*BASE, "data.truncation=left"], "never truncated"),
        ([*BASE, "trainer.some_new_key=1"], "no translation for trainer.some_new_key"),
        ([*BASE, "~data.val_files"], "deleting a key"),
    ],
)
def test_what_cannot_be_kept_is_an_error(words, message):
    with pytest.raises(VerlConfigError, match=message):
        translate(words)


def test_defaults_and_spellings():
    flags, _ = translate([*BASE, "+trainer.logger=[console]", f"{ACTOR}optim.lr_warmup_steps_ratio=0.1"])
    assert flags["report_to"] == "none" and flags["warmup_steps"] == 0.1
    assert flags["lr_scheduler_type"] == "constant_with_warmup"
    assert flags["num_train_epochs"] == 30 and flags["beta"] == 0.0 and flags["top_k"] == 0  # verl's defaults
    cosine, _ = translate([*BASE, f"{ACTOR}optim.lr_scheduler_type=cosine", f"{ACTOR}optim.min_lr_ratio=0.1"])
    assert cosine["lr_scheduler_type"] == "cosine_with_min_lr" and cosine["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    lora, _ = translate([*BASE, "actor_rollout_ref.model.lora_rank=8"])
    assert (lora["use_peft"], lora["lora_r"], lora["lora_alpha"]) == (True, 8, 16)


def test_cli_error_is_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", "from vlm_grpo.convert_config import cli; cli()", "verl", *BASE[1:]],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: verl main_ppo line: algorithm.adv_estimator='gae'")
    assert "Traceback" not in result.stderr and result.stdout == ""


COUNTER = """
import os
from vlm_grpo.rewards import completion_text

def counted(completions, **kwargs):
    with open(os.environ["SCORED"], "a") as f:
        f.write(f"{len(completions)}\\n")
    return [float(len(completion_text(c)) % 3) for c in completions]
"""


def test_translated_line_trains_one_verl_step(tiny_models, tmp_path, monkeypatch):
    """RynnBrain's line sized for one CPU: one verl step = one generation of 2 prompts x 2, trained on twice."""
    from vlm_grpo.grpo_jsonl import main as train
    from vlm_grpo.grpo_jsonl import parse_args

    data, _ = make_dataset(tmp_path / "data", kinds=("single",), n=2)
    plugin = tmp_path / "counted.py"
    plugin.write_text(COUNTER)
    monkeypatch.setenv("SCORED", str(tmp_path / "scored.txt"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    changed = [
        "data.train_files=" + str(data), "data.val_files=null",
        "actor_rollout_ref.model.path=" + str(tiny_models["qwen2_5_vl"]),
        "trainer.n_gpus_per_node=1", "data.train_batch_size=2", f"{ACTOR}ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "data.max_response_length=8", "trainer.total_training_steps=1",
        "trainer.logger=[console]", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    ]  # fmt: skip
    keys = {w.split("=")[0] for w in changed}
    line = [w for w in RYNNBRAIN_LINE[3:] if w.split("=")[0] not in keys] + changed
    config = tmp_path / "rl.yaml"
    assert main([*line, "-o", str(config)]) == 0
    trainer = train(
        *parse_args(
            [
                "--config", str(config),
                "--image_folders", str(data.parent / "images"),
                "--reward_funcs", f"{plugin}:counted",
                "--output_dir", str(tmp_path / "out"),
                "--dataloader_num_workers", "0",
            ]
        )
    )  # fmt: skip
    assert trainer.state.global_step == 2  # ppo_epochs=2: two optimizer steps on the one generation
    assert (tmp_path / "scored.txt").read_text().split() == ["4"]  # 2 prompts x n=2, generated once


def test_verl_overrides_on_the_training_command_line(tmp_path):
    """``vlm-grpo key=value ...`` with verl's keys: the same translation, the --flags winning."""
    from vlm_grpo.grpo_jsonl import parse_args

    line = [w.replace("/path/to/sft_model", "m") for w in RYNNBRAIN_LINE[3:] if not w.startswith("data.val_files")]
    script, training, model = parse_args([*line, "--output_dir", str(tmp_path), "--save_steps", "7"])
    assert model.model_name_or_path == "m" and script.data_file_paths == "/path/to/train.parquet"
    assert (training.per_device_train_batch_size, training.gradient_accumulation_steps) == (2, 40)
    assert (training.steps_per_generation, training.num_generations, training.num_iterations) == (40, 5, 2)
    assert training.beta == 0.02 and training.save_steps == 7  # the flag after the overrides wins
    # EasyR1's overrides (no verl-only section) are left for the EasyR1 reader; the same words twice is an error
    from vlm_grpo.convert_verl import verl_overrides_argv

    assert verl_overrides_argv(["data.train_files=a.jsonl", "--x", "1"]) == ["data.train_files=a.jsonl", "--x", "1"]
    with pytest.raises(VerlConfigError, match="--config both"):
        verl_overrides_argv([*line, "--config", "c.yaml"])
