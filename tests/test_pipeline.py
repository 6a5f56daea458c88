"""run_scripts/run_sft_then_grpo.sh end to end on the demo data with a tiny model, on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sft_then_grpo_pipeline_on_demo_data(tiny_models, tmp_path):
    out = tmp_path / "pipeline"
    rewards = ["accuracy", "format", "iou"]
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MODEL": str(tiny_models["qwen2_5_vl"]),
        "OUTPUT_DIR": str(out),
        "SFT_STEPS": "2",
        "GRPO_STEPS": "1",
        "EVAL_MAX_NEW_TOKENS": "8",
        "EVAL_ARGS": "--max_samples 6",
        "GRPO_ARGS": "--max_completion_length 8",
        "REWARDS": " ".join(rewards),
        "MASTER_PORT": str(_free_port()),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",  # tiny models: one thread is fastest, and robust to a busy machine
    }
    result = subprocess.run(
        ["bash", str(REPO / "run_scripts" / "run_sft_then_grpo.sh")],
        cwd=tmp_path,  # the script finds the repository itself
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    data = out / "data"
    for stage in ("rl", "cot"):
        assert (data / stage / "train.jsonl").is_file() and (data / stage / "test.jsonl").is_file()
    assert json.loads((out / "check.json").read_text())["bad_rows"] == 0
    assert (out / "sft" / "config.json").is_file()  # GRPO started from this folder
    assert "[vlm-grpo] step 1" in result.stdout
    assert (out / "grpo" / "config.json").is_file()

    summary = json.loads((out / "eval" / "summary.json").read_text())
    assert summary["model"] == str(out / "grpo")
    assert summary["count"] == 6 and set(summary["rewards"]) == set(rewards)
    for name in rewards:
        assert "mean" in summary["rewards"][name] and "pass@1" in summary["rewards"][name]
    assert summary["failures"]["generation"] == 0
    assert len((out / "eval" / "predictions.jsonl").read_text().splitlines()) == 6
