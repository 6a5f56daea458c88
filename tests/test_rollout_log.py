"""--rollout_log (and VLM-R1's DEBUG_MODE / LOG_PATH): every rollout of a step as one JSON line."""

from __future__ import annotations

import json

import pytest
import torch

from e2e_utils import base_args, make_dataset
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.rollout_log import rollout_log_path

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_path_per_rank_and_vlm_r1_environment():
    assert rollout_log_path("runs/r.jsonl", 0, {}) == "runs/r.jsonl"
    assert rollout_log_path("runs/r.jsonl", 3, {}) == "runs/r.rank3.jsonl"
    assert rollout_log_path(None, 0, {"DEBUG_MODE": "true", "LOG_PATH": "dbg.txt"}) == "dbg.txt"
    assert rollout_log_path(None, 1, {"DEBUG_MODE": "true", "LOG_PATH": "dbg.txt"}) == "dbg.rank1.txt"
    assert rollout_log_path(None, 0, {"DEBUG_MODE": "false", "LOG_PATH": "dbg.txt"}) is None
    assert rollout_log_path("mine.jsonl", 0, {"DEBUG_MODE": "true", "LOG_PATH": "dbg.txt"}) == "mine.jsonl"


def test_debug_mode_log_holds_every_rollout_with_rewards_and_advantages(tiny_models, tmp_path, monkeypatch):
    data, plugin = make_dataset(tmp_path / "data")
    log = tmp_path / "debug_log.txt"
    monkeypatch.setenv("DEBUG_MODE", "true")
    monkeypatch.setenv("LOG_PATH", str(log))
    argv = base_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out", steps=3)
    argv += ["--rollout_log_every", "2", "--rollout_log_max_chars", "12", "--reward_weights", "1.0", "0.5"]
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 3
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted({r["step"] for r in lines}) == [1, 3]  # every second step, from the first
    assert len(lines) == 2 * 4 and {r["round"] for r in lines} == {1} and {r["rank"] for r in lines} == {0}
    for record in lines:
        assert set(record) >= {"id", "prompt", "images", "solution", "completion", "rewards", "reward", "advantage"}
        assert set(record["rewards"]) == {"text_shape", "format"}
        assert len(record["completion"]) <= 12 or "...[+" in record["completion"]
        assert record["prompt"].startswith(("<image>What colo", "Here is one")) and record["prompt"].endswith("chars]")
        assert all(p.endswith(".png") for p in record["images"])
        expected = record["rewards"]["text_shape"] + 0.5 * record["rewards"]["format"]
        assert record["reward"] == pytest.approx(expected)
    # advantages are the group-normalised rewards (hand-computed from the logged rewards)
    for step in (1, 3):
        rows = [r for r in lines if r["step"] == step]
        rewards = torch.tensor([r["reward"] for r in rows])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # one group of 4 per step
        assert [r["advantage"] for r in rows] == pytest.approx(expected.tolist(), abs=1e-5)
        assert len({r["id"] for r in rows}) == 1 and {r["group"] for r in rows} == {0}
