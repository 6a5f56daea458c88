"""VLM-R1's run_scripts/run_grpo_rec.sh flag list, run against grpo_jsonl.py under torchrun on CPU.

The flags are the script's own, bare ``--bf16``, ``--resume_from_checkpoint True`` on a new output dir,
``--dataset-name`` with a hyphen and ZeRO-3 included. Changed: the paths (model, data, images, output,
DeepSpeed config), ``--report_to none`` (wandb is not installed offline), and, appended, ``--max_steps 1``
and ``--max_completion_length 16`` so that a random tiny model does not sample 2048 tokens on CPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_utils import make_dataset

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

RUN_GRPO_REC = """
    --use_vllm False
    --output_dir {out}/checkpoints/rl/Qwen2.5-VL-3B-Instruct-rec
    --resume_from_checkpoint True
    --model_name_or_path {model}
    --data_file_paths {data}
    --image_folders {images}
    --is_reward_customized_from_vlm_module True
    --task_type rec
    --per_device_train_batch_size 8
    --gradient_accumulation_steps 2
    --gradient_checkpointing true
    --logging_steps 1
    --num_train_epochs 2
    --bf16
    --attn_implementation flash_attention_2
    --run_name Qwen2.5-VL-3B-Instruct-rec
    --data_seed 42
    --save_steps 100
    --num_generations 8
    --max_completion_length 2048
    --reward_funcs accuracy format
    --beta 0.04
    --report_to none
    --dataset-name this_is_not_used
    --deepspeed {zero3}
"""


def test_vlm_r1_run_grpo_rec_flags_train_on_cpu(tiny_models, tmp_path):
    data, _ = make_dataset(tmp_path / "data", kinds=("single",), n=2)
    flags = RUN_GRPO_REC.format(
        out=tmp_path,
        model=tiny_models["qwen2_5_vl"],
        data=data,
        images=data.parent / "images",
        zero3=REPO / "local_scripts" / "zero3.json",
    ).split()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port),
           str(REPO / "src" / "vlm_grpo" / "grpo_jsonl.py"), *flags, "--max_steps", "1",
           "--max_completion_length", "16"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "starting a fresh run" in log  # --resume_from_checkpoint True on a new output dir
    assert "[vlm-grpo] step 1; mean rewards: accuracy=" in log
    assert (tmp_path / "checkpoints" / "rl" / "Qwen2.5-VL-3B-Instruct-rec" / "model.safetensors").is_file()
