"""One CPU training run per reward family through grpo_jsonl.py's main on a tiny model: each reward of the family
is built by name (with --reward_kwargs / --reward_weights where the family has parameters), scores real
completions, and its ``rewards/<name>/mean`` (and, for batch rewards, its extra metrics) reach the training log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from e2e_utils import base_args, make_dataset
from test_rewards_explanation import build_tiny_clip
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.tasks import RYNNBRAIN_OUTPUT_FORMATS as OUTPUT_FORMATS
from vlm_grpo.tasks import RYNNBRAIN_SYSTEM_PROMPTS as SYSTEM_PROMPTS

EASYR1_PLUGIN = '''
REWARD_TYPE = "batch"


def compute_score(reward_inputs, format_weight=0.1):
    """EasyR1 batch reward: overall + metrics."""
    out = []
    for item in reward_inputs:
        fmt = 1.0 if "<answer>" in item["response"] else 0.0
        acc = 1.0 if item["ground_truth"].strip() in item["response"] else 0.0
        out.append({"overall": (1 - format_weight) * acc + format_weight * fmt, "accuracy": acc, "format": fmt})
    return out
'''


def vlm_r1_row(i: int, question: str, solution: str, n_images: int = 1, **extra) -> dict:
    images = [f"img{(i + k) % 4}.png" for k in range(n_images)]
    return {
        "id": f"row-{i}",
        "image": images[0] if n_images == 1 else images,
        "conversations": [
            {"from": "human", "value": "<image>" * n_images + question},
            {"from": "gpt", "value": solution},
        ],
        **extra,
    }


def rynnbrain_row(i: int, task: str, solution) -> dict:
    return {
        "id": f"rynn-{task}",
        "task_type": task,
        "conversation": [
            {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPTS[task]}]},
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": f"img{i % 4}.png"},
                    {"type": "text", "text": f"Where is the square? {OUTPUT_FORMATS[task]}"},
                ],
            },
            {"role": "assistant", "content": solution},
        ],
    }


def family_rows(family: str) -> list[dict]:
    box = '[{"bbox_2d": [8, 8, 28, 28], "label": "square"}]'
    if family == "accuracy":
        return [
            vlm_r1_row(0, "What colour is the square?", "<answer>red</answer>", accu_reward_method="fuzzy"),
            vlm_r1_row(1, "Is there a square?", "<answer>yes</answer>", accu_reward_method="yes_no"),
            vlm_r1_row(2, "Which? (A) red (B) blue", "<answer>B</answer>", accu_reward_method="mcq"),
            vlm_r1_row(3, "Colour?", "<answer>xanh lá</answer>", accu_reward_method="vqa_graded"),
        ]
    if family in ("format", "shaping", "batch"):
        return [vlm_r1_row(i, "What is 1 + 1?", "<answer>2</answer>") for i in range(4)]
    if family == "detection":
        return [vlm_r1_row(i, "Detect the square.", f"<answer>{box}</answer>", task_type="rec") for i in range(4)]
    if family == "explanation":
        return [
            vlm_r1_row(i, "What colour is the square?", "<answer>đỏ</answer><explain>the square is red</explain>")
            for i in range(4)
        ]
    if family == "rynnbrain":
        return [
            rynnbrain_row(0, "trajectory", [{"frame1": [[100, 100], [300, 300], [500, 500]]}]),
            rynnbrain_row(1, "affordance", [{"frame1": [[300, 300]]}]),
            rynnbrain_row(2, "area", [{"frame1": [[100, 100], [600, 100], [600, 600], [100, 600]]}]),
            rynnbrain_row(3, "counting", [{"type": "text", "text": "#### <answer><counting>1</counting></answer>"}]),
            rynnbrain_row(4, "segment", [{"frame1": [[150, 150], [550, 550]]}]),
            rynnbrain_row(5, "general", [{"type": "text", "text": "#### red"}]),
        ]
    raise KeyError(family)


# family -> (model family, reward names, extra flags, metrics expected in the log besides rewards/<name>/mean)
FAMILIES = {
    "accuracy": (
        "qwen2_5_vl",
        ["accuracy", "vqa_graded"],
        ["--reward_weights", "1.0", "0.5", "--reward_kwargs", '{"vqa_graded": {"scale": 3.0}}'],
        [],
    ),
    "format": ("qwen2_5_vl", ["format", "format_explain", "format_speaker", "format_rynnbrain"], [], []),
    "detection": ("qwen2_5_vl", ["iou", "iou_threshold", "od_ap", "od_ap50", "od_length", "weighted_sum"], [], []),
    "rynnbrain": (
        "qwen2_5_vl",
        [
            "rynnbrain",
            "rynn_trajectory",
            "rynn_affordance",
            "rynn_area",
            "rynn_counting",
            "rynn_segment",
            "rynn_general",
            "format_rynnbrain",
        ],
        ["--reward_kwargs", '{"rynnbrain": {"counting": {"graded": true}}}'],
        [],
    ),
    "explanation": ("internvl", ["explanation", "format_explain"], [], []),
    "shaping": (
        "qwen2_5_vl",
        ["length", "one_sentence", "repetition", "overlong"],
        ["--reward_kwargs", '{"length": {"max_len": 8}, "overlong": {"max_len": 8, "cache_len": 4}}'],
        [],
    ),
    "batch": (
        "qwen2_5_vl",
        ["accuracy_format", "PLUGIN:compute_score"],
        [],
        ["rewards/accuracy_format/accuracy", "rewards/accuracy_format/format", "rewards/compute_score/accuracy"],
    ),
}


@pytest.fixture(scope="module")
def images_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reward_e2e")
    make_dataset(root, kinds=("single",), n=1)  # writes images/img0..3.png
    return root


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_reward_family_trains_and_logs(family, tiny_models, images_root, tmp_path):
    model_family, rewards, extra, metrics = FAMILIES[family]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in family_rows(family)))
    plugin = tmp_path / "easyr1_plugin.py"
    plugin.write_text(EASYR1_PLUGIN)
    rewards = [r.replace("PLUGIN", str(plugin)) for r in rewards]
    if family == "explanation":
        clip = build_tiny_clip(tmp_path / "clip")
        extra = ["--reward_kwargs", json.dumps({"explanation": {"clip_model": str(clip), "clip_weight": 0.3}})]

    argv = base_args(tiny_models[model_family], data, plugin, tmp_path / "out", steps=1)
    argv[argv.index("--image_folders") + 1] = str(images_root / "images")
    start = argv.index("--reward_funcs") + 1
    argv[start : start + 2] = rewards
    argv += extra
    trainer = main(*parse_args(argv))

    assert trainer.state.global_step == 1
    logged = {key: value for entry in trainer.state.log_history for key, value in entry.items()}
    for name in rewards:
        label = name.rpartition(":")[2]
        assert f"rewards/{label}/mean" in logged, f"rewards/{label}/mean missing from {sorted(logged)}"
        assert logged.get(f"rewards/{label}/failures", 0.0) == 0.0, f"{label} failed on a sample"
    for key in metrics:
        assert key in logged and math.isfinite(logged[key]), key
    if family == "accuracy":  # --reward_weights 1.0 0.5
        expected = logged["rewards/accuracy/mean"] + 0.5 * logged["rewards/vqa_graded/mean"]
        assert logged["reward"] == pytest.approx(expected, abs=1e-5)
    if family == "rynnbrain":
        assert math.isfinite(logged["rewards/rynnbrain/mean"])
    if family == "explanation":  # the CLIP term ran: its checkpoint is in the per-process cache
        from vlm_grpo.rewards.explanation import _CLIP_CACHE

        assert any(path == str(tmp_path / "clip") for path, _ in _CLIP_CACHE)
