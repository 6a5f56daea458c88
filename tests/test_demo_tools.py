"""make demo-tools: its committed set is what the generator writes, its trajectories replay through the tool loop
without errors, and the numbers it prints are those ``vlm-grpo-eval --tools`` gives on the same model."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from vlm_grpo.data.zoom_in_demo import MARKED, MIXUPS, generate_tool_demo, zoom_call

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "demo" / "zoom_in"


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_committed_set_is_the_generators(tmp_path):
    generate_tool_demo(tmp_path)
    for name in ("train.jsonl", "val.jsonl", "sft.jsonl", "sft_true.jsonl"):
        assert (tmp_path / name).read_text() == (DATA / name).read_text(), name
    for name in ("train_0000.png", "train_0123.png", "val_0063.png"):
        assert (tmp_path / "images" / name).read_bytes() == (DATA / "images" / name).read_bytes(), name


def test_the_trajectories_call_the_tool_and_the_weak_labeller_errs_as_documented():
    true, weak = rows(DATA / "sft_true.jsonl"), rows(DATA / "sft.jsonl")
    assert len(true) == len(weak) == 256 and len(rows(DATA / "val.jsonl")) == 64
    mistakes = Counter()
    for t, w in zip(true, weak, strict=True):
        assert t["assistant_turns"][0] == w["assistant_turns"][0] == zoom_call(MARKED)
        said = re.fullmatch(r"<answer>(\w+)</answer>", w["assistant_turns"][1]).group(1)
        colour = re.fullmatch(r"<answer>(\w+)</answer>", t["assistant_turns"][1]).group(1)
        assert t["conversations"][1]["value"] == f"<answer>{colour}</answer>"
        if said != colour:
            assert MIXUPS[colour] == said
            mistakes[colour] += 1
    assert mistakes == {"red": 39, "blue": 39}  # 3 in 5 of the 64 red and 64 blue rows (rounded per block of 20)


def test_the_demo_prints_what_vlm_grpo_eval_gives(tmp_path, capsys):
    from vlm_grpo import demo_tools
    from vlm_grpo.evaluate import main as eval_main

    out = tmp_path / "demo"
    argv = ["--out", str(out), "--data", str(DATA), "--sft_true_steps", "40", "--sft_steps", "0"]
    argv += ["--grpo_steps", "1", "--grpo_batch", "4", "--num_generations", "2", "--eval_rows", "4"]
    demo_tools.main(argv)
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert f"held-out accuracy {summary['sft']['accuracy']:.3f} -> {summary['grpo']['accuracy']:.3f}" in printed
    assert summary["grpo"]["steps"] == 1
    command = next(line for line in printed.splitlines() if line.startswith("demo-tools: vlm-grpo-eval "))
    argv = shlex.split(command)[2:]
    assert argv[argv.index("--output_dir") + 1] == str(out / "eval_sft")
    again = eval_main([*argv, "--output_dir", str(tmp_path / "again")])  # the last --output_dir counts
    assert again["rewards"]["accuracy"]["mean"] == summary["sft"]["accuracy"]
    assert again["tools"]["tool_call_rate"] == summary["sft"]["tool_call_rate"]
    assert summary["sft"]["tool_call_rate"] > 0  # the SFT policy calls zoom_in
