"""Data sources EasyR1 / verl / DeepEyes users bring: parquet with HF Image features, save_to_disk folders,
name@split from the local HF cache, column keys, verl rows, a separate evaluation file."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict, Features, Image, List, Value
from PIL import Image as PILImage

from e2e_utils import REWARD_PLUGIN, base_args
from vlm_grpo.data import to_datasets
from vlm_grpo.data.jsonl import open_image
from vlm_grpo.data.sources import ColumnKeys, SourceError, read_sources

REPO = Path(__file__).resolve().parents[1]


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 32)) -> bytes:
    buffer = io.BytesIO()
    PILImage.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def easyr1_table(n: int = 3) -> Dataset:
    """EasyR1-style rows under non-default column names, images as HF Image features holding bytes."""
    names = list(COLORS)[:n]
    features = Features(
        {"question": Value("string"), "gt": Value("string"), "pics": List(Image()), "level": Value("int64")}
    )
    return Dataset.from_dict(
        {
            "question": [f"Which colour is this? ({i})" for i in range(n)],
            "gt": names,
            "pics": [[{"bytes": png(COLORS[c], (40 + 8 * i, 32)), "path": None}] for i, c in enumerate(names)],
            "level": list(range(n)),
        },
        features=features,
    )


KEYS = ColumnKeys(prompt="question", answer="gt", image="pics")


def test_parquet_with_image_bytes_and_easyr1_keys_reads_without_json(tmp_path):
    path = tmp_path / "geo.parquet"
    easyr1_table().to_parquet(str(path))
    rows, bad = read_sources(str(path), keys=KEYS)
    assert bad == []
    assert [r["solution"] for r in rows] == ["red", "green", "blue"]
    # EasyR1 puts the image in front when the question has no <image> marker
    assert rows[1]["question"] == "<image>Which colour is this? (1)"
    assert [r["image_sizes"] for r in rows] == [[[40, 32]], [[48, 32]], [[56, 32]]]
    assert open_image(rows[2]["image_path"][0]).convert("RGB").getpixel((3, 3)) == COLORS["blue"]
    assert [r["source"] for r in rows] == [f"{path}:{i}" for i in (1, 2, 3)]
    # columns the keys do not consume reach the rewards
    assert [r["extra"] for r in rows] == [{"level": 0}, {"level": 1}, {"level": 2}]


def test_image_given_by_path_in_an_image_feature_resolves_against_the_folder(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png(COLORS["red"]))
    # the layout datasets writes for List(Image()): a list of {bytes, path} structs
    rows = [
        {"problem": "<image>What?", "answer": "red", "images": [{"bytes": None, "path": "a.png"}]},
        {"problem": "<image>And this?", "answer": "red", "images": [{"bytes": None, "path": "missing.png"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    rows, bad = read_sources(str(tmp_path / "p.parquet"), str(tmp_path / "imgs"))
    assert [r["image_path"] for r in rows] == [[str(tmp_path / "imgs" / "a.png")]]
    assert [str(b) for b in bad] == [
        f"{tmp_path / 'p.parquet'}:2: field 'image': image file not found: {tmp_path / 'imgs' / 'missing.png'}"
    ]


def verl_rows() -> list[dict]:
    """verl / DeepEyes rows: a chat prompt with <image> markers, images, reward_model.ground_truth, extra_info."""
    return [
        {
            "data_source": "geo3k",
            "prompt": [
                {"role": "system", "content": "Think first."},
                {"role": "user", "content": "<image>Find x. <image>Same figure, rotated."},
            ],
            "images": [{"bytes": png(COLORS["red"]), "path": None}, {"bytes": png(COLORS["green"]), "path": None}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "42"},
            "extra_info": {"split": "train", "index": 7, "answer": "42"},
        },
        {
            "data_source": "chart",
            "prompt": [{"role": "user", "content": "<image>How many bars?"}],
            "images": [{"bytes": png(COLORS["blue"]), "path": None}],
            "ability": "vqa",
            "reward_model": {"style": "rule"},  # no ground truth: a bad row naming the field
            "extra_info": {"index": 8},
        },
    ]


def test_verl_parquet_rows_keep_their_columns_for_rewards(tmp_path):
    path = tmp_path / "verl.parquet"
    Dataset.from_list(verl_rows()).to_parquet(str(path))
    rows, bad = read_sources(str(path))
    assert [str(b) for b in bad] == [
        f"{path}:2: field 'reward_model.ground_truth': missing field 'reward_model.ground_truth' (the solution)"
    ]
    (row,) = rows
    assert row["question"] == "<image>Find x. <image>Same figure, rotated."
    assert row["system"] == "Think first."
    assert row["solution"] == "42"
    assert len(row["image_path"]) == 2 and row["image_path"][0].startswith("data:image/png;base64,")

    class Module:  # to_datasets only needs the question template
        def question_template(self, task_type):
            return "{question}"

    dataset, _ = to_datasets(rows, Module())
    sample = dataset[0]
    assert sample["data_source"] == "geo3k" and sample["ability"] == "math"
    # parquet gives every struct every field (None where absent); the row's own fields come back as written
    assert {k: v for k, v in sample["extra_info"].items() if v is not None} == {
        "split": "train",
        "index": 7,
        "answer": "42",
    }
    assert [im.getpixel((1, 1)) for im in sample["images"]] == [COLORS["red"], COLORS["green"]]


def test_verl_rows_in_jsonl_with_paths(tmp_path):
    (tmp_path / "a.png").write_bytes(png(COLORS["red"]))
    row = {"data_source": "x", "prompt": [{"role": "user", "content": "<image>Q"}], "images": ["a.png"],
           "reward_model": {"ground_truth": "A"}, "extra_info": {"k": [1, 2]}}  # fmt: skip
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    rows, bad = read_sources(str(tmp_path / "v.jsonl"))
    assert bad == [] and rows[0]["solution"] == "A"
    assert rows[0]["extra"] == {"data_source": "x", "extra_info": {"k": [1, 2]}}


def test_save_to_disk_folder_and_split(tmp_path):
    easyr1_table(2).save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": easyr1_table(3), "test": easyr1_table(1)}).save_to_disk(str(tmp_path / "dict"))
    rows, bad = read_sources(f"{tmp_path / 'one'}:{tmp_path / 'dict'}@test", keys=KEYS)
    assert bad == [] and [r["solution"] for r in rows] == ["red", "green", "red"]
    assert rows[2]["source"] == f"{tmp_path / 'dict'}@test:1"
    with pytest.raises(SourceError, match="no split 'val'"):
        read_sources(f"{tmp_path / 'dict'}@val", keys=KEYS)


def make_hub_cache(root: Path, name: str = "testorg/colors") -> Path:
    """A local HF hub cache holding one dataset snapshot, as `hf download --repo-type dataset` leaves it."""
    repo = root / f"datasets--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    (snapshot / "data").mkdir(parents=True)
    easyr1_table(3).to_parquet(str(snapshot / "data" / "train-00000-of-00001.parquet"))
    easyr1_table(1).to_parquet(str(snapshot / "data" / "test-00000-of-00001.parquet"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return root


def test_name_at_split_from_the_local_cache_and_a_clear_error_when_absent(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(make_hub_cache(tmp_path / "hub")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    rows, bad = read_sources("testorg/colors@test", keys=KEYS)
    assert bad == [] and [r["solution"] for r in rows] == ["red"]
    with pytest.raises(SourceError, match=r"'testorg/absent' .* hf download testorg/absent --repo-type dataset"):
        read_sources("testorg/absent@train", keys=KEYS)


def test_missing_hub_dataset_is_one_error_line_from_the_cli(tiny_models, tmp_path):
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, "-m", "vlm_grpo.grpo_jsonl", "--model_name_or_path", str(tiny_models["qwen2_5_vl"]),
         "--data_file_paths", "someorg/notdownloaded@train", "--output_dir", str(tmp_path / "o")],
        capture_output=True, text=True, env={**__import__("os").environ, **env}, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "someorg/notdownloaded" in errors[0] and "hf download" in errors[0]
    assert "Traceback" not in result.stderr


@pytest.mark.usefixtures("one_torch_thread")
def test_parquet_bytes_save_to_disk_and_hub_cache_train_two_steps(tiny_models, tmp_path, monkeypatch):
    from huggingface_hub import constants

    from vlm_grpo.grpo_jsonl import main, parse_args

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(make_hub_cache(tmp_path / "hub")))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds_cache"))
    easyr1_table(2).to_parquet(str(tmp_path / "train.parquet"))
    easyr1_table(2).save_to_disk(str(tmp_path / "disk"))
    easyr1_table(1).to_parquet(str(tmp_path / "eval.parquet"))
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(REWARD_PLUGIN)
    argv = base_args(tiny_models["qwen2_5_vl"], tmp_path / "train.parquet", plugin, tmp_path / "out")
    sources = f"{tmp_path / 'train.parquet'}:{tmp_path / 'disk'}:testorg/colors@train"
    argv[argv.index("--data_file_paths") + 1] = sources
    i = argv.index("--image_folders")
    del argv[i : i + 2]  # the images are embedded: no folder (a folder that does not exist would be refused)
    argv += ["--prompt_key", "question", "--answer_key", "gt", "--image_key", "pics"]
    # Evaluation at step 1000 of 2: the eval rows are read and checked, and no evaluation runs.
    argv += ["--eval_file_paths", str(tmp_path / "eval.parquet"), "--eval_strategy", "steps", "--eval_steps", "1000"]
    argv += ["--format_prompt", str(REPO / "configs" / "templates" / "r1v.jinja")]
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 2
    prompt = trainer.train_dataset[0]["prompt"][-1]["content"]
    assert prompt[0] == {"type": "image"}
    assert prompt[1]["text"].startswith("Which colour is this? (0) A conversation between User and Assistant.")
    assert len(trainer.train_dataset) == 7 and len(trainer.eval_dataset) == 1
    assert trainer.train_dataset[0]["level"] == 0  # an unmapped column reaches the rewards


def test_the_data_check_reads_what_training_reads(tmp_path):
    """vlm-grpo-data check on a parquet with embedded image bytes and on verl rows (RynnBrain's RL parquet)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from vlm_grpo.data.cli import main as data_main

    png = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 200, 0)).save(png, "PNG")
    rows = [
        {
            "prompt": [{"role": "user", "content": "<image>Where is the cup?"}],
            "images": [{"bytes": png.getvalue(), "path": None}],
            "reward_model": {"ground_truth": "<answer>left</answer>", "style": "rule"},
            "extra_info": {"split": "train", "index": 0},
            "data_source": "rynnbrain_rl",
        }
    ]
    path = tmp_path / "rl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert data_main(["check", str(path)]) == 0
