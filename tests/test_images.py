"""Image decoding: odd modes become the RGB a user would expect (scaled, not clipped), limits are read from the
header, and an image that breaks after the data check is a counted skip naming its row, not a crash."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from PIL import Image

from vlm_grpo.data import prepare_rows, read_rows, to_datasets
from vlm_grpo.data.formats import DataError
from vlm_grpo.data.images import ImageError, ImageTooLarge, decode_rgb, image_size, pixel_limit, to_rgb


def _grey(image: Image.Image) -> np.ndarray:
    rgb = np.asarray(to_rgb(image))
    assert rgb.shape[-1] == 3 and rgb.dtype == np.uint8
    return rgb[..., 0].astype(int)


def test_16_bit_grey_is_scaled_not_clipped(tmp_path):
    values = (np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)  # 0 .. 65520
    Image.fromarray(values).save(tmp_path / "g16.png")
    with Image.open(tmp_path / "g16.png") as image:
        assert image.mode.startswith("I")
        clipped = np.asarray(image.convert("RGB"))[..., 0]
    decoded = np.asarray(decode_rgb(str(tmp_path / "g16.png")))[..., 0].astype(int)
    expected = np.rint(values / 257.0).astype(int)
    assert np.abs(decoded - expected).max() <= 1
    assert (clipped == 255).mean() > 0.9  # control: PIL's plain convert turns almost everything white


def test_other_modes_keep_what_is_seen(tmp_path):
    i32 = Image.fromarray(np.full((8, 8), 30000, dtype=np.int32), "I")
    assert _grey(i32).max() == round(30000 / 257)
    floats = Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32), "F")
    assert _grey(floats).max() == 128  # [0, 1] floats times 255
    transparent = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    assert np.asarray(to_rgb(transparent))[0, 0].tolist() == [255, 255, 255]  # onto white, not the hidden red
    half = Image.new("RGBA", (8, 8), (0, 0, 0, 128))
    assert np.asarray(to_rgb(half))[0, 0].tolist() == [127, 127, 127]
    palette = Image.new("P", (8, 8), 1)
    palette.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    palette.info["transparency"] = 0
    assert np.asarray(to_rgb(palette))[0, 0].tolist() == [10, 200, 30]  # opaque palette entry kept
    cmyk = Image.new("CMYK", (8, 8), (0, 255, 255, 0))
    assert np.asarray(to_rgb(cmyk))[0, 0].tolist() == [255, 0, 0]
    frames = [Image.new("P", (8, 8), i) for i in range(3)]
    for frame in frames:
        frame.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0] + [0] * 759)
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:])
    assert np.asarray(decode_rgb(str(tmp_path / "a.gif")))[0, 0].tolist() == [0, 0, 0]  # the first frame


def test_pixel_limit_is_read_from_the_header(tmp_path):
    Image.new("1", (9000, 8000), 1).save(tmp_path / "big.png")  # 72 MP, a few KB
    assert pixel_limit(None) == 64 * 2**20 and pixel_limit(20_000_000) == 80_000_000
    with pytest.raises(ImageTooLarge, match="9000x8000"):
        image_size(str(tmp_path / "big.png"), pixel_limit(None))
    assert image_size(str(tmp_path / "big.png"), pixel_limit(20_000_000)) == (9000, 8000)  # --max_pixels raises it


def _rows(tmp_path, n=4):
    for i in range(n):
        Image.new("RGB", (32, 32), (10 * i, 0, 0)).save(tmp_path / f"{i}.png")
    rows = [
        {
            "id": f"r{i}",
            "image": f"{i}.png",
            "conversations": [
                {"from": "human", "value": "<image>?"},
                {"from": "gpt", "value": f"<answer>{i}</answer>"},
            ],
        }
        for i in range(n)
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class _Module:
    def coord_size(self, processor, w, h):
        return (1000, 1000)

    def num_image_tokens(self, processor, w, h):
        return 4

    def question_template(self, task_type):
        return "{question}"


def test_image_broken_after_the_check_is_a_counted_skip_naming_its_row(tmp_path, caplog):
    path = _rows(tmp_path)
    rows, bad = read_rows([str(path)])
    train, _ = to_datasets(prepare_rows(rows, bad, _Module(), None), _Module())
    (tmp_path / "1.png").write_bytes((tmp_path / "1.png").read_bytes()[:40])  # changed on disk mid-run
    with caplog.at_level(logging.WARNING):
        first = train[1]
        again = train[1]  # every copy of a GRPO group gets the same replacement
    assert first["id"] == again["id"] == "r2" and first["solution"] == "<answer>2</answer>"
    assert first["images"][0].getpixel((0, 0)) == (20, 0, 0)
    assert f"Skipped {path}:2: " in caplog.text and f"{tmp_path / '1.png'}" in caplog.text
    assert f"{path}:3 takes its place; 1 row(s) skipped so far" in caplog.text
    assert caplog.text.count("Skipped") == 1
    assert train[0]["id"] == "r0"  # the others are untouched
    batch = train[[0, 1, 3]]
    assert batch["id"] == ["r0", "r2", "r3"] and len(batch["images"]) == 3
    # SFT puts its own transform on the dataset (no pool given): the replacement is found all the same
    from vlm_grpo.sft_trainer import SFTTransform

    sft = train.with_transform(SFTTransform(_Module()))[1]
    assert sft["id"] == "r2" and sft["messages"][-1]["content"][0]["text"] == "<answer>2</answer>"


def test_when_no_row_decodes_any_more_training_stops_naming_the_row(tmp_path):
    path = _rows(tmp_path, n=2)
    rows, bad = read_rows([str(path)])
    train, _ = to_datasets(prepare_rows(rows, bad, _Module(), None), _Module())
    for i in range(2):
        (tmp_path / f"{i}.png").write_bytes(b"")
    with pytest.raises(DataError, match=rf"{path}:1: no row of this dataset has images that still decode"):
        train[0]


def test_json_files_name_their_encoding_errors_and_emptiness(tmp_path):
    from vlm_grpo.data.records import read_any_rows

    (tmp_path / "latin1.json").write_bytes(b'[\n{"problem": "caf\xe9", "answer": "1"}\n]\n')
    (tmp_path / "empty.json").write_text("")
    _, bad = read_any_rows([str(tmp_path / "latin1.json"), str(tmp_path / "empty.json")])
    assert [(b.source, b.field) for b in bad] == [
        (f"{tmp_path / 'latin1.json'}:2", "<json>"),
        (f"{tmp_path / 'empty.json'}", "<file>"),
    ]
    assert "not valid UTF-8" in bad[0].reason
    with pytest.raises(ImageError, match="bad base64"):
        decode_rgb("data:image/png;base64,!!")
