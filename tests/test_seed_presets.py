"""The seeds' own runs: the ViVQA-X preset scores correct answers, its seed names mean what the seed meant, and it
trains on rows converted from ViVQA-X-style JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from vlm_grpo.data.cli import main as data_main
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.rewards import build_reward_funcs

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "vivqa_x_internvl.yaml"
ITEMS = [
    {"question": "Màu của chiếc xe là gì?", "answer": "đỏ", "image_name": "car.png",
     "explanation": ["chiếc xe có màu đỏ tươi", "thân xe sơn màu đỏ"]},
    {"question": "Có bao nhiêu con mèo?", "answer": "hai", "image_name": "cats.png",
     "explanation": ["có hai con mèo nằm trên ghế"]},
]  # fmt: skip


@pytest.fixture(scope="module")
def vivqa_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("vivqa")
    for name, colour in (("car.png", (200, 20, 20)), ("cats.png", (90, 90, 90))):
        Image.new("RGB", (64, 48), colour).save(root / name)
    (root / "vivqa.json").write_text(json.dumps(ITEMS, ensure_ascii=False))
    out = root / "train.jsonl"
    prompt = REPO / "configs" / "templates" / "vivqa_x_prompt.txt"
    assert data_main(["convert-vqa", "-i", str(root / "vivqa.json"), "-o", str(out), "--prompt_file", str(prompt)]) == 0
    return out


def _preset_rewards(**kwargs):
    config = yaml.safe_load(PRESET.read_text())
    return config, build_reward_funcs(config["reward_funcs"], reward_kwargs=config["reward_kwargs"], **kwargs)


def test_converted_rows_keep_every_explanation_and_ask_for_explain_in_vietnamese(vivqa_rows):
    rows = [json.loads(line) for line in vivqa_rows.read_text().splitlines()]
    assert len(rows) == 2  # several explanations: one row with several references, not several rows
    human, gpt = rows[0]["conversations"][0]["value"], rows[0]["conversations"][1]["value"]
    assert "Respond in Vietnamese" in human and "<explain>" in human and human.endswith("Màu của chiếc xe là gì?")
    assert gpt == "<answer>đỏ</answer><explain>chiếc xe có màu đỏ tươi</explain><explain>thân xe sơn màu đỏ</explain>"
    assert rows[0]["task_type"] == "raw"  # no think/answer-only instruction appended


def test_the_preset_scores_a_correct_answer_on_every_reward(vivqa_rows):
    _, funcs = _preset_rewards()
    assert [f.__name__ for f in funcs] == ["vqa_graded", "format_explain", "explanation"]
    right = "<think>xe màu đỏ</think><answer>đỏ</answer><explain>chiếc xe có màu đỏ tươi</explain>"
    wrong = "<answer>xanh</answer>"
    solution = json.loads(vivqa_rows.read_text().splitlines()[0])["conversations"][1]["value"]
    scores = [f([right, wrong], solution=[solution] * 2) for f in funcs]
    assert scores[0] == [3.0, 0.0] and scores[1] == [1.0, 0.0]
    assert scores[2][0] > 0.5 and scores[2][1] == 0.0


def test_the_seeds_own_names_mean_the_seeds_rewards_only_when_asked():
    seed_names = ["accuracy", "format", "explanation"]
    answer = "<think>x</think><answer>đỏ</answer><explain>xe đỏ</explain>"
    solution = "<answer>đỏ</answer><explain>xe đỏ</explain>"
    aliased = build_reward_funcs(seed_names, seed_aliases="vivqa_x")
    assert [f.__name__ for f in aliased] == seed_names  # the seed's labels stay
    assert [f([answer], solution=[solution])[0] for f in aliased[:2]] == [3.0, 1.0]
    plain = build_reward_funcs(seed_names)  # our names: accuracy in [0, 1], format = think/answer only
    assert [f([answer], solution=[solution])[0] for f in plain[:2]] == [1.0, 0.0]
    lewis = build_reward_funcs(["length"], seed_aliases="lewis")
    assert lewis[0].fn.__name__ == "one_sentence_reward"  # never the cosine length reward
    with pytest.raises(ValueError, match=r"Unknown --reward_aliases 'nope'\. Available: lewis, vivqa_x"):
        build_reward_funcs(seed_names, seed_aliases="nope")


def test_the_preset_trains_two_steps_on_converted_rows(tiny_models, vivqa_rows, tmp_path):
    argv = [
        "--config", str(PRESET),
        "--model_name_or_path", str(tiny_models["internvl"]),
        "--data_file_paths", str(vivqa_rows),
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--gradient_accumulation_steps", "1", "--max_completion_length", "8", "--bf16", "false",
        "--gradient_checkpointing", "false", "--save_strategy", "no", "--max_anyres_num", "1",
    ]  # fmt: skip
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 2
    logged = {k for entry in trainer.state.log_history for k in entry}
    for name in ("vqa_graded", "format_explain", "explanation"):
        assert f"rewards/{name}/mean" in logged
