"""The Lewis loop: concept games with same-concept distractors, listener rows, the seed's LoRA flags, and
``run_scripts/run_lewis_game.sh`` alternating speaker and listener for 2 rounds on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.data.lewis import make_concept_games, read_concepts
from vlm_grpo.grpo_jsonl import parse_args
from vlm_grpo.serve.lewis_listener import listener_rows
from vlm_grpo.serve.threaded import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def concepts(tmp_path) -> Path:
    """PerVA-style folder: 3 concepts x 3 images (2 colours apart inside a concept)."""
    root = tmp_path / "perva"
    for c, concept in enumerate(("dog_bo", "mug_red", "cat_mo")):
        (root / concept).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (56, 56), (60 * c, 80 * i, 100)).save(root / concept / f"{i}.png")
    return root


def _answer(game: dict) -> dict:
    return json.loads(game["conversations"][1]["value"])


def test_concept_games_draw_distractors_from_the_targets_concept(concepts):
    items = read_concepts(concepts)
    assert len(items) == 9 and ("dog_bo/0.png", "dog_bo") in items
    games = make_concept_games(items, rows=9, k=3, seed=1)
    for game in games:
        answer = _answer(game)
        concept = game["image"].split("/")[0]
        assert answer["candidates"][answer["target"]] == game["image"]
        assert len(set(answer["candidates"])) == 3
        assert {c.split("/")[0] for c in answer["candidates"]} == {concept}
    # the control: other_concepts distractors never share the target's concept
    for game in make_concept_games(items, rows=9, k=3, seed=1, distractors="other_concepts"):
        answer = _answer(game)
        others = [c for i, c in enumerate(answer["candidates"]) if i != answer["target"]]
        assert all(c.split("/")[0] != game["image"].split("/")[0] for c in others)
    with pytest.raises(ValueError, match="no concept has enough images for k=4"):
        make_concept_games(items, rows=2, k=4)


def test_listener_reward_resolves_concept_candidates_under_the_image_root():
    from vlm_grpo.rewards.listener import parse_lewis_target

    solution = json.dumps({"candidates": ["dog/0.png", "dog/1.png"], "target": 1})
    assert parse_lewis_target(solution, ["/data/perva/dog/1.png"]) == (
        ["/data/perva/dog/0.png", "/data/perva/dog/1.png"],
        1,
    )
    # flat names (one image folder) still resolve next to the target image
    flat = json.dumps({"candidates": ["a.png", "b.png"], "target": 0})
    assert parse_lewis_target(flat, ["/data/imgs/a.png"]) == (["/data/imgs/a.png", "/data/imgs/b.png"], 0)


def test_concept_dataset_file_and_its_bad_rows(concepts, tmp_path):
    good = tmp_path / "concepts.jsonl"
    good.write_text('{"image": "dog_bo/0.png", "concept": "dog"}\n{"image": "dog_bo/1.png", "concept": "dog"}\n')
    assert read_concepts(good, concepts) == [("dog_bo/0.png", "dog"), ("dog_bo/1.png", "dog")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "dog_bo/0.png", "concept": "dog"}\n{"image": "dog_bo/1.png"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'concept'"):
        read_concepts(bad, concepts)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"image": "dog_bo/9.png", "concept": "dog"}\n')
    with pytest.raises(ValueError, match=r"missing.jsonl:1: field 'image'.*does not exist"):
        read_concepts(missing, concepts)


def test_listener_rows_letter_the_candidates_and_answer_the_target(concepts):
    games = make_concept_games(read_concepts(concepts), rows=3, k=3, seed=0)
    rows = listener_rows(games, ["<thinking>x</thinking><coarse>a dog</coarse><detailed>brown ears</detailed>"] * 3)
    for game, row in zip(games, rows, strict=True):
        answer = _answer(game)
        assert row["image"] == answer["candidates"]
        question = row["conversations"][0]["value"]
        assert question.count("<image>") == 3 and '"a dog brown ears"' in question
        assert row["conversations"][1]["value"] == f"<answer>{'ABC'[answer['target']]}</answer>"


def test_seed_lora_flags_are_trls(tmp_path):
    base = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--use_peft", "true"]
    _, _, default = parse_args(base)
    _, _, model_args = parse_args([*base, "--lo_rank", "8", "--lo_alpha=24", "--lo_dropout", "0.25"])
    assert (model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout) == (8, 24, 0.25)
    assert (default.lora_r, default.lora_alpha, default.lora_dropout) != (8, 24, 0.25)
    with pytest.raises(SystemExit, match="--lora_r and --lo_rank are the same option"):
        parse_args([*base, "--lora_r", "4", "--lo_rank", "8"])


@pytest.mark.slow  # 4 model services and 4 trainer runs: ~2 min on 2 idle cores
def test_lewis_game_alternates_speaker_and_listener_for_two_rounds(tiny_models, concepts, tmp_path):
    out = tmp_path / "game"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SPEAKER_MODEL": str(tiny_models["qwen2_5_vl"]),
        "IMAGES": str(concepts),
        "CONCEPTS": str(concepts),
        "OUTPUT_DIR": str(out),
        "ROUNDS": "2",
        "STEPS": "1",
        "ROWS": "2",
        "MASTER_PORT": str(free_port()),
        "HEALTH_TIMEOUT": "180",
    }
    result = subprocess.run(
        ["bash", str(REPO / "run_scripts" / "run_lewis_game.sh"), "--lo_rank", "4"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[lewis-game] 2 rounds done" in output
    for role in ("speaker", "listener"):
        assert (out / "round_2" / role / "model.safetensors").is_file(), role
    # round 2 starts from round 1's checkpoints: the swap happened
    assert f"round 2/2: speaker phase (listener {out}/round_1/listener served)" in output
    assert f"round 2/2: listener phase (speaker {out}/round_2/speaker served)" in output
    assert f"MODEL        = {out}/round_1/speaker" in output and f"MODEL        = {out}/round_1/listener" in output
    rows = (out / "round_2" / "listener_rows.jsonl").read_text().splitlines()
    assert len(rows) == 2 and json.loads(rows[0])["conversations"][0]["value"].count("<image>") == 3
    # one prediction line per game the listener answered: 2 rounds x 1 step x 2 completions
    games = [json.loads(line) for line in (out / "lewis_predictions.json").read_text().splitlines()]
    assert len(games) == 4
    for game in games:
        assert game["correct"] == (game["predicted_index"] == game["target"])
        assert len({Path(c).parent.name for c in game["candidates"]}) == 1  # same-concept distractors
    assert "speaker (pid" in output and "listener (pid" in output  # both services stopped
