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
    argv = ["--out", str(out), "--data", str(DATA), "--sft_true_steps", "60", "--sft_lr", "1e-2", "--sft_steps", "0"]
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


def test_sft_sees_the_prompt_the_loop_shows(tiny_models):
    """The replayed trajectory, as ``vlm-grpo-sft --tools`` encodes and collates it, gives the model the same view
    of the prompt as a tool rollout (image token types included: without them the 3D positions differ and SFT
    trains another context)."""
    import torch

    from vlm_grpo.demo_tools import TOOLS, _dataset, tool_kwargs
    from vlm_grpo.eval_tools import ToolLoop
    from vlm_grpo.merge_lora import load_model_and_processor
    from vlm_grpo.sft_tools import ToolRolloutCollator, encode_rollout, type_key

    model, processor, module = load_model_and_processor(str(tiny_models["qwen2_5_vl"]))
    loop = ToolLoop(model, processor, module, TOOLS, tool_kwargs(), max_iterations=2)
    row = _dataset(DATA / "val.jsonl", DATA / "images", module, processor)[0]
    text = loop._start(row)[-1]
    shown = processor(text=[text], images=row["images"], return_tensors="pt")
    encoded = encode_rollout(processor, loop.replay(row, [zoom_call(), "<answer>red</answer>"]))
    batch = ToolRolloutCollator(processor.tokenizer.pad_token_id, type_key(model))([encoded])
    n = shown["input_ids"].shape[1]
    assert encoded["input_ids"][:n] == shown["input_ids"][0].tolist()
    with torch.no_grad():
        trained = model(**batch).logits[0, n - 1]
        generated = model(**shown).logits[0, -1]
        without_types = model(**{k: v for k, v in batch.items() if k != "mm_token_type_ids"}).logits[0, n - 1]
    torch.testing.assert_close(trained, generated, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(without_types, generated, atol=1e-5)  # control: the bug this guards against
