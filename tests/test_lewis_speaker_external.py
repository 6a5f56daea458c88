"""The Lewis seed's own launch: ``run_speaker_training.sh HOST PORT EPOCHS DATASET SEED`` against a listener that
is already serving, ``--dataset_name`` PerVA games, the prediction log in its own file, checkpoints cleaned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.cli_errors import UserError
from vlm_grpo.data.lewis import dataset_name_source, perva_games
from vlm_grpo.rollout_log import rollout_log_path
from vlm_grpo.serve.threaded import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_scripts" / "run_lewis_speaker.sh"
PERVA = "PerVA_all_test_subset_seed_23_K_3_subset_30"


@pytest.fixture
def perva(tmp_path) -> Path:
    """The seed's dataset folder: concepts x images (4 concepts x 2 images)."""
    root = tmp_path / PERVA
    for c, concept in enumerate(("bo", "mam", "dug", "ciin")):
        (root / concept).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (56, 56), (60 * c, 100 * i, 90)).save(root / concept / f"{i}.png")
    return root


def _answer(game: dict) -> dict:
    return json.loads(game["conversations"][1]["value"])


def test_perva_games_every_image_a_target_among_other_concepts(perva, tmp_path):
    games = perva_games(perva)
    assert sorted(g["image"] for g in games) == sorted(str(p) for p in perva.glob("*/*.png"))  # each image once
    for game in games:
        answer = _answer(game)
        candidates = answer["candidates"]
        assert len(candidates) == 3  # K_3 in the folder's name
        assert candidates[answer["target"]] == game["image"] and all(Path(c).is_file() for c in candidates)
        concepts = [Path(c).parent.name for c in candidates]
        assert len(set(concepts)) == 3  # distractors are other concepts
    assert perva_games(perva) == games  # seed_23 from the name: the same games every time
    renamed = perva.rename(tmp_path / "PerVA_all_test_subset_seed_5_K_2")
    assert {len(_answer(g)["candidates"]) for g in perva_games(renamed)} == {2}
    # the path training reads: the games as JSONL; any other name passes through as it is
    path = Path(dataset_name_source(str(renamed), tmp_path / "out"))
    assert path == tmp_path / "out" / "data" / "PerVA_all_test_subset_seed_5_K_2_games.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == perva_games(renamed)
    assert dataset_name_source("rows.jsonl", tmp_path) == "rows.jsonl"


def test_dataset_name_is_the_data(perva, tmp_path):
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.recipe import check_dataset_name

    base = ["--model_name_or_path", "m", "--output_dir", str(tmp_path / "o")]
    script, training, _ = parse_args([*base, "--dataset_name", str(perva)])
    check_dataset_name(script, training.output_dir, training.seed)
    assert script.data_file_paths == str(tmp_path / "o" / "data" / f"{PERVA}_games.jsonl")
    script, training, _ = parse_args([*base, "--dataset_name", str(perva), "--data_file_paths", "x.jsonl"])
    with pytest.raises(UserError, match="both name data; pass one"):
        check_dataset_name(script, training.output_dir, training.seed)


def test_rollout_log_moves_aside_for_the_prediction_log():
    env = {"DEBUG_MODE": "true", "LOG_PATH": "/r/lewis_7.json"}
    assert rollout_log_path(None, 0, env) == "/r/lewis_7.json"  # VLM-R1's meaning: LOG_PATH is the rollout log
    assert rollout_log_path(None, 0, env, predictions_in_log_path=True) == "/r/lewis_7.rollouts.jsonl"
    assert rollout_log_path(None, 2, env, predictions_in_log_path=True) == "/r/lewis_7.rollouts.rank2.jsonl"
    assert rollout_log_path("/x.jsonl", 0, env, predictions_in_log_path=True) == "/x.jsonl"


@pytest.mark.parametrize(
    ("args", "message"),
    [(["h", "p9000"], "must be whole numbers"), (["h", "1", "2", "d", "3", "extra"], "at most 5 arguments")],
)
def test_bad_positional_arguments_are_one_error_line(args, message, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(tmp_path / "o")}
    result = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error:") and message in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.slow  # a served listener and torchrun
def test_speaker_trains_against_an_external_listener_on_loopback(tiny_models, perva, tmp_path):
    port = free_port()
    listener_log = tmp_path / "external_listener.log"
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with listener_log.open("w") as log:
        listener = subprocess.Popen(
            [sys.executable, "-m", "vlm_grpo.serve", "listener", "--model", str(tiny_models["qwen2_5_vl"]),
             "--host", "127.0.0.1", "--port", str(port), "--image_root", str(perva)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    out = tmp_path / "speaker"
    try:
        result = subprocess.run(
            ["bash", str(SCRIPT), "127.0.0.1", str(port), "1", "YoLLaVA", "23",
             "--dataset_name", str(perva), "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1"],
            cwd=REPO,
            env={**env, "PYTHON": sys.executable, "MODEL": str(tiny_models["qwen2_5_vl"]), "OUTPUT_DIR": str(out),
                 "MASTER_PORT": str(free_port()), "HEALTH_TIMEOUT": "180", "SLURM_JOB_ID": "77"},
            capture_output=True, text=True, timeout=420,
        )  # fmt: skip
        assert listener.poll() is None, "the script stopped a listener it did not start"
    finally:
        listener.terminate()
        listener.wait(timeout=30)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[vlm-grpo] step 2; mean rewards:" in output, output[-4000:]
    assert f"listener: external, http://127.0.0.1:{port}" in output
    assert "listener (pid" not in output and not (out / "listener.log").exists()  # no listener of its own
    assert '"POST /batch_score HTTP/1.1" 200' in listener_log.read_text()
    assert "--num_train_epochs 1" in output and "--seed 23" in output  # EPOCHS and SEED reached the trainer
    # the PerVA games were built from --dataset_name and trained on
    assert (out / "data" / f"{PERVA}_games.jsonl").is_file()
    # DEBUG_MODE=true (the seed's default): predictions in LOG_PATH, rollouts in their own file
    predictions = [json.loads(line) for line in (out / "lewis_77.json").read_text().splitlines()]
    game_keys = {"description", "candidates", "target", "predicted_index"}
    assert predictions and all(game_keys <= set(p) for p in predictions)
    assert all("completion" not in p for p in predictions)
    rollouts = [json.loads(line) for line in (out / "lewis_77.rollouts.jsonl").read_text().splitlines()]
    assert rollouts and all("completion" in r and "description" not in r for r in rollouts)
    # the seed's cleanup: intermediate checkpoints gone, the final model kept
    assert "Removing " in output and not list(out.glob("checkpoint-*"))
    assert (out / "config.json").is_file()


def test_an_unreachable_external_listener_is_an_error_before_training(tiny_models, tmp_path):
    port = free_port()  # nothing listens there
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": str(tiny_models["qwen2_5_vl"]),
           "OUTPUT_DIR": str(tmp_path / "o"), "HEALTH_TIMEOUT": "1", "DATA": str(tmp_path / "games.jsonl")}  # fmt: skip
    result = subprocess.run(
        ["bash", str(SCRIPT), "127.0.0.1", str(port)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert f"error: no listener answers at http://127.0.0.1:{port}/health" in result.stderr
    assert "vlm-grpo run" not in result.stdout and "Traceback" not in result.stderr


def test_the_seeds_trainer_flag_line_parses_as_it_means(perva, tmp_path):
    """train_speaker_dist.py's flags from run_speaker_training.sh (paths changed; --deepspeed left out: it loads
    DeepSpeed, and the run scripts' tests cover it)."""
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.recipe import check_dataset_name

    script, training, model = parse_args(
        ["--output_dir", str(tmp_path / "save"),
         "--model_name_or_path", "ckpt", "--dataset_name", str(perva), "--max_prompt_length", "1024",
         "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "16", "--logging_steps", "1",
         "--bf16", "true", "--gradient_checkpointing", "true", "--attn_implementation", "flash_attention_2",
         "--max_pixels", "401408", "--num_train_epochs", "4", "--report_to", "wandb", "--run_name", "r",
         "--save_only_model", "true", "--num_generations", "4", "--use_peft", "true", "--lo_rank", "64",
         "--lo_alpha", "128", "--lo_dropout", "0.001"]
    )  # fmt: skip
    assert (model.lora_r, model.lora_alpha, model.lora_dropout, model.use_peft) == (64, 128, 0.001, True)
    assert (training.num_generations, training.gradient_accumulation_steps, training.num_train_epochs) == (4, 16, 4)
    assert model.max_pixels == 401408 and training.save_only_model is True
    check_dataset_name(script, training.output_dir, training.seed)
    assert script.data_file_paths.endswith(f"{PERVA}_games.jsonl")


@pytest.mark.parametrize(("n", "kept"), [(7, 7), (8, 8), (9, 8), (30, 8)])  # under, at and over the 8 images
def test_a_subset_suffix_keeps_that_many_games(perva, tmp_path, caplog, n, kept):
    import logging

    every = perva_games(perva.rename(tmp_path / "PerVA_all_test_subset_seed_23_K_3"))
    folder = (tmp_path / "PerVA_all_test_subset_seed_23_K_3").rename(tmp_path / f"{PERVA[: -len('30')]}{n}")
    with caplog.at_level(logging.INFO, logger="vlm_grpo.data.lewis"):
        games = perva_games(folder)
    assert len(games) == kept and len({g["image"] for g in games}) == kept
    strip = [json.dumps(g).replace(folder.name, "X") for g in games]
    assert set(strip) <= {json.dumps(g).replace("PerVA_all_test_subset_seed_23_K_3", "X") for g in every}
    assert perva_games(folder) == games  # drawn with the name's seed: the same subset every time
    assert f"_subset_{n}" in caplog.text


def test_a_subset_of_zero_is_an_error(perva, tmp_path):
    folder = perva.rename(tmp_path / "PerVA_seed_23_K_3_subset_0")
    with pytest.raises(ValueError, match="_subset_0 asks for no games"):
        perva_games(folder)
