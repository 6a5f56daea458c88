"""Row formats, validation errors with file:line, lazy decoding, placeholder positions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.data import DataValidationError, build_messages, prepare_rows, read_rows, split_paths, to_datasets
from vlm_grpo.data.formats import normalise_row


def _png(path: Path, size=(64, 48), color=(200, 10, 10)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def _write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _vlm_r1(image, question="<image>How many?", answer="<answer>2</answer>", **extra):
    row = {"id": "x", "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
    if image is not None:
        row["image"] = image
    row.update(extra)
    return row


def test_split_paths_follows_vlm_r1_colon_convention():
    assert split_paths("a.jsonl:b.jsonl") == ["a.jsonl", "b.jsonl"]
    assert split_paths(["a.jsonl", "b.jsonl:c.jsonl"]) == ["a.jsonl", "b.jsonl", "c.jsonl"]
    assert split_paths(None) == []


def test_three_formats_normalise_to_one_row():
    vlm = normalise_row(_vlm_r1(["a.png", "b.png"], "<image>first <image> second?", accu_reward_method="math"))
    assert vlm["image_path"] == ["a.png", "b.png"]
    assert vlm["question"] == "<image>first <image> second?"
    assert vlm["accu_reward_method"] == "math"

    rynn = normalise_row(
        {
            "conversation": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look: "},
                        {"type": "image", "image": "f1.jpg", "width": 10, "height": 10},
                        {"type": "text", "text": " then "},
                        {"type": "image", "image": "f2.jpg"},
                    ],
                },
                {"role": "Thinking", "content": [{"type": "text", "text": "hmm"}]},
                {"role": "assistant", "content": [{"frame1": [[1, 2]]}]},
            ],
            "task_type": "affordance",
        }
    )
    assert rynn["question"] == "Look: <image> then <image>"
    assert rynn["image_path"] == ["f1.jpg", "f2.jpg"]
    assert json.loads(rynn["solution"]) == {"frame1": [[1, 2]]}
    assert rynn["task_type"] == "affordance"

    easy = normalise_row({"problem": "What is it?", "answer": "cat", "images": ["c.png"]})
    assert easy["question"] == "<image>What is it?"
    assert easy["solution"] == "cat"


def test_solution_with_tags_is_kept_verbatim(tmp_path):
    _png(tmp_path / "img.png")
    sol = "<answer>con mèo</answer><explain>Nó có râu.</explain>"
    path = _write_jsonl(tmp_path / "d.jsonl", [_vlm_r1("img.png", answer=sol)])
    rows, bad = read_rows([str(path)])
    assert not bad
    assert rows[0]["solution"] == sol
    assert rows[0]["image_sizes"] == [[64, 48]]


def test_bad_rows_reported_together_with_file_line_and_field(tmp_path):
    _png(tmp_path / "imgs" / "ok.png")
    path = _write_jsonl(
        tmp_path / "train.jsonl",
        [
            _vlm_r1("ok.png"),
            '{"id": 2, "conversations": [',  # line 2: bad JSON
            _vlm_r1("missing.png"),  # line 3: missing image
            _vlm_r1(["ok.png", "ok.png"], "<image>only one marker"),  # line 4: count mismatch
            {"id": 5, "image": "ok.png"},  # line 5: no conversations
        ],
    )
    rows, bad = read_rows([str(path)], [str(tmp_path / "imgs")])
    assert len(rows) == 1
    with pytest.raises(DataValidationError) as info:
        prepare_rows(rows, bad, _NoModule(), None)
    message = str(info.value)
    assert "Found 4 bad row(s) out of 5" in message
    assert f"{path}:2: field '<json>': bad JSON" in message
    assert f"{path}:3: field 'image': image file not found" in message and "missing.png" in message
    assert f"{path}:4: field 'image': the prompt has 1 '<image>' placeholder(s) but the row has 2 image(s)" in message
    assert f"{path}:5: field 'conversations': unknown row format: expected 'conversations' (VLM-R1)" in message
    assert "--skip_bad_rows" in message


def test_skip_bad_rows_counts_and_logs(tmp_path, caplog):
    _png(tmp_path / "ok.png")
    path = _write_jsonl(tmp_path / "t.jsonl", [_vlm_r1("ok.png"), _vlm_r1("nope.png"), "not json"])
    rows, bad = read_rows([str(path)])
    with caplog.at_level("WARNING"):
        kept = prepare_rows(rows, bad, _NoModule(), None, skip_bad_rows=True)
    assert len(kept) == 1
    assert "Skipped 2 bad row(s) out of 3" in caplog.text


def test_more_than_twenty_bad_rows_are_summarised(tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", ["{"] * 25)
    rows, bad = read_rows([str(path)])
    with pytest.raises(DataValidationError) as info:
        prepare_rows(rows, bad, _NoModule(), None)
    assert "Found 25 bad row(s) out of 25 (showing the first 20)" in str(info.value)
    assert "... and 5 more" in str(info.value)


def test_image_folders_pair_with_files(tmp_path):
    _png(tmp_path / "A" / "x.png", color=(1, 2, 3))
    _png(tmp_path / "B" / "x.png", size=(32, 32))
    a = _write_jsonl(tmp_path / "a.jsonl", [_vlm_r1("x.png")])
    b = _write_jsonl(tmp_path / "b.jsonl", [_vlm_r1("x.png")])
    rows, bad = read_rows(f"{a}:{b}", f"{tmp_path / 'A'}:{tmp_path / 'B'}")
    assert not bad
    assert [r["image_sizes"] for r in rows] == [[[64, 48]], [[32, 32]]]
    with pytest.raises(ValueError, match="--image_folders has 3 entries for 2 data files"):
        read_rows(f"{a}:{b}", "x:y:z")


def test_placeholders_keep_their_position():
    row = {"question": "Compare <image> with <image>. Which is red?", "system": "Be brief."}
    messages = build_messages(row, "{question}")
    assert messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert [p["type"] for p in messages[1]["content"]] == ["text", "image", "text", "image", "text"]
    assert messages[1]["content"][0]["text"] == "Compare"
    assert messages[1]["content"][-1]["text"] == ". Which is red?"


def test_dataset_holds_paths_and_decodes_on_access(tmp_path, monkeypatch):
    _png(tmp_path / "a.png", color=(0, 255, 0))
    path = _write_jsonl(tmp_path / "t.jsonl", [_vlm_r1("a.png")] * 4)
    rows, bad = read_rows([str(path)])
    rows = prepare_rows(rows, bad, _NoModule(), None)

    opened = []
    import vlm_grpo.data.images as images

    real_open = images.open_image
    monkeypatch.setattr(images, "open_image", lambda p: opened.append(p) or real_open(p))
    train, evaluation = to_datasets(rows, _NoModule(), val_split_ratio=0.25, seed=0)
    assert len(train) == 3 and len(evaluation) == 1
    assert opened == []  # nothing decoded while building the dataset
    sample = train[0]
    assert len(opened) == 1
    assert sample["images"][0].getpixel((0, 0)) == (0, 255, 0)
    assert sample["prompt"][-1]["content"][0] == {"type": "image"}
    assert sample["solution"] == "<answer>2</answer>"
    assert sample["coord_sizes"] == [[1000, 1000]]


class _NoModule:
    """Stand-in adapter for tests that need no model: normalised-coordinate family."""

    def coord_size(self, processor, w, h):
        return (1000, 1000)

    def num_image_tokens(self, processor, w, h):
        return 4

    def question_template(self, task_type):
        return "{question}"
