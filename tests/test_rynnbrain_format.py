"""RynnBrain's data gaps: ``vlm-grpo-data format --layout chatml`` (the seed's formatted rows, video ``duration``)
and ``--mm_max_length`` (rows over the image-token budget are bad rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.data import DataValidationError, prepare_rows, read_rows
from vlm_grpo.data.cli import main as data_main
from vlm_grpo.modules import get_vlm_module

ITEM_FIELDS = {"type", "text", "image", "video", "width", "height", "duration"}


def _video(path: Path, frames: int = 10, fps: int = 5) -> Path:
    """A real mpeg4 clip of frames / fps seconds."""
    import av
    import numpy as np

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 20, np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


@pytest.fixture
def media(tmp_path):
    Image.new("RGB", (64, 48), "red").save(tmp_path / "f1.png")
    Image.new("RGB", (80, 40), "blue").save(tmp_path / "f2.png")
    Image.new("RGB", (56, 56), "green").save(tmp_path / "scene.png")
    _video(tmp_path / "clip.mp4")
    return tmp_path


def _format(tmp_path, rows, model, layout="chatml"):
    src = tmp_path / "trajectory_cot_train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"out_{layout}.jsonl"
    argv = ["format", "--ann_path", str(src), "--save_path", str(out), "--data_root", str(tmp_path)]
    assert data_main([*argv, "--tokenizer_path", model, "--layout", layout, "--nproc", "1"]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_chatml_layout_writes_the_seeds_formatted_rows(media, tiny_models):
    model = str(tiny_models["qwen2_5_vl"])
    rynnbrain = {
        "conversation": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": "f1.png", "video": "clip.mp4"},
                    {"type": "image", "image": "f2.png", "video": "clip.mp4"},
                    {"type": "text", "text": "Track the arm."},
                ],
            },
            {"role": "Thinking", "content": [{"type": "text", "text": "It moves right."}]},
            {"role": "assistant", "content": [{"frame2": [[10, 20], [30, 40]]}]},
        ]
    }
    vlm_r1 = {
        "id": "q7",
        "data_source": "mine",
        "image": "scene.png",
        "conversations": [{"from": "human", "value": "Where is <image> the apple?"}, {"from": "gpt", "value": "left"}],
    }
    first, second = _format(media, [rynnbrain, vlm_r1], model)
    assert set(first) == {"data_source", "id", "text_sequence_length", "conversation"}
    assert first["data_source"] == "trajectory_cot_train" and first["id"] == "0"
    assert [t["role"] for t in first["conversation"]] == ["user", "Thinking", "assistant"]
    user = first["conversation"][0]["content"]
    assert all(set(item) == ITEM_FIELDS for item in user)
    assert [(i["image"], i["width"], i["height"]) for i in user[:2]] == [
        (str(media / "f1.png"), 64, 48),
        (str(media / "f2.png"), 80, 40),
    ]
    assert [i["video"] for i in user[:2]] == [str(media / "clip.mp4")] * 2
    assert [i["duration"] for i in user[:2]] == pytest.approx([2.0, 2.0])  # 10 frames at 5 fps
    assert user[2] == {"type": "text", "text": "Track the arm.", "image": "", "video": "", "width": 0, "height": 0,
                       "duration": 0.0}  # fmt: skip
    assert first["conversation"][2]["content"] == [{"frame2": [[10, 20], [30, 40]]}]

    assert (second["id"], second["data_source"]) == ("q7", "mine")
    items = second["conversation"][0]["content"]
    assert [(i["type"], i["text"], i["duration"]) for i in items] == [
        ("text", "Where is ", 0.0),
        ("image", "", 0.0),
        ("text", " the apple?", 0.0),
    ]
    assert (items[1]["width"], items[1]["height"]) == (56, 56)
    assert second["conversation"][1]["content"][0]["text"] == "left"

    # the same text_sequence_length as the VLM-R1 layout of the same rows
    canonical = _format(media, [rynnbrain, vlm_r1], model, layout="vlm_r1")
    lengths = [first["text_sequence_length"], second["text_sequence_length"]]
    assert [r["text_sequence_length"] for r in canonical] == lengths
    assert all(r["text_sequence_length"] > 5 for r in canonical)


def test_a_frame_of_an_unreadable_video_is_a_clear_error(media, tiny_models, capsys):
    (media / "broken.mp4").write_text("not a video")
    row = {"conversation": [{"role": "user", "content": [{"type": "image", "image": "f1.png", "video": "broken.mp4"},
                                                         {"type": "text", "text": "q"}]},
                            {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}  # fmt: skip
    src = media / "rows.jsonl"
    src.write_text(json.dumps(row) + "\n")
    argv = ["format", "--ann_path", str(src), "--save_path", str(media / "o.jsonl"), "--data_root", str(media)]
    assert data_main([*argv, "--tokenizer_path", str(tiny_models["qwen2_5_vl"]), "--layout", "chatml"]) != 0
    err = capsys.readouterr().err
    assert "error:" in err and "cannot read the duration of video" in err and "Traceback" not in err


def test_mm_max_length_makes_rows_over_the_image_token_budget_bad_rows(media, tiny_models):
    model = str(tiny_models["qwen2_5_vl"])
    module = get_vlm_module(model)
    processor = module.load_processor(model)
    rows_file = media / "mm.jsonl"
    answer = {"from": "gpt", "value": "b"}
    one = {"image": "scene.png", "conversations": [{"from": "human", "value": "<image>a"}, answer]}
    two = {"image": ["f1.png", "f2.png"], "conversations": [{"from": "human", "value": "<image><image>c"}, answer]}
    rows_file.write_text(json.dumps(one) + "\n" + json.dumps(two) + "\n")
    rows, bad = read_rows([str(rows_file)], [str(media)])
    tokens = [sum(module.num_image_tokens(processor, w, h) for w, h in r["image_sizes"]) for r in rows]
    assert bad == [] and tokens[1] > tokens[0]

    assert len(prepare_rows([dict(r) for r in rows], [], module, processor, mm_max_length=tokens[1])) == 2
    with pytest.raises(DataValidationError) as err:
        prepare_rows([dict(r) for r in rows], [], module, processor, mm_max_length=tokens[1] - 1)
    assert f"{rows_file}:2" in str(err.value) and f"--mm_max_length {tokens[1] - 1}" in str(err.value)
    kept = prepare_rows([dict(r) for r in rows], [], module, processor, mm_max_length=tokens[0], skip_bad_rows=True)
    assert [r["image_path"] for r in kept] == [rows[0]["image_path"]]


def test_sft_takes_mm_max_length(tmp_path):
    from vlm_grpo.sft_jsonl import parse_args

    argv = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--mm_max_length", "64"]
    script_args, _, _ = parse_args(argv)
    assert script_args.mm_max_length == 64
