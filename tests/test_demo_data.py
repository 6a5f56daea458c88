"""The committed data/demo set: in sync with its generator, well-formed, and its answers are right."""

from __future__ import annotations

import json
import re
from collections import deque
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_grpo.data import demo

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"
SPLITS = {"train": 48, "val": 8}
SEED = 0

QUESTION_RE = re.compile(r"How many (?:(red|green|blue|yellow) )?(square|circle|triangle|shape)s are")
BOX_RE = re.compile(r"^<answer>\[(\d+), (\d+), (\d+), (\d+)\]</answer>$")
COUNT_RE = re.compile(r"^<answer>(\d+)</answer>$")


def _rows(folder: Path, split: str) -> list[dict]:
    with open(folder / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _images(row: dict) -> list[str]:
    return row["image"] if isinstance(row["image"], list) else [row["image"]]


TOOL_DEMO = "zoom_in"  # make demo-tools' set: its own generator, checked in test_demo_tools.py


def _files(folder: Path) -> dict[str, Path]:
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    return {name: p for name, p in files.items() if not name.startswith(TOOL_DEMO + "/")}


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def samples() -> dict[str, list[demo.Sample]]:
    return {split: demo.generate_split(split, n, SEED) for split, n in SPLITS.items()}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    demo.main(["--out", str(out), "--n_train", str(SPLITS["train"]), "--n_val", str(SPLITS["val"])])
    return out


def test_committed_data_matches_generator(regenerated):
    committed, fresh = _files(DEMO), _files(regenerated)
    assert sorted(committed) == sorted(fresh), "data/demo is out of date: rerun python -m vlm_grpo.data.demo"
    for name, path in committed.items():
        if name.endswith(".png"):
            # Compare pixels, not bytes: PNG bytes depend on the zlib build, the pixels must not.
            a, b = _pixels(path), _pixels(fresh[name])
            assert a.shape == b.shape and np.array_equal(a, b), name
        else:
            assert path.read_bytes() == fresh[name].read_bytes(), name


def test_generation_is_byte_deterministic(regenerated, tmp_path):
    demo.generate(tmp_path, SPLITS["train"], SPLITS["val"], SEED)
    demo.generate_colour(tmp_path / demo.COLOUR_DIR, seed=SEED)
    first, second = _files(regenerated), _files(tmp_path)
    assert sorted(first) == sorted(second)
    for name in first:
        assert first[name].read_bytes() == second[name].read_bytes(), name


def test_different_seed_differs():
    a = [s.row for s in demo.generate_split("train", 8, seed=0)]
    b = [s.row for s in demo.generate_split("train", 8, seed=1)]
    assert a != b


def test_size_budget():
    assert sum(p.stat().st_size for p in _files(DEMO).values()) < 300_000
    assert sum(p.stat().st_size for p in (DEMO / TOOL_DEMO).rglob("*") if p.is_file()) < 600_000


@pytest.mark.parametrize("split", SPLITS)
def test_rows_well_formed(split):
    rows = _rows(DEMO, split)
    assert len(rows) == SPLITS[split]
    assert len({r["id"] for r in rows}) == len(rows)
    tasks = {r["task_type"] for r in rows}
    assert tasks == {"counting", "rec"}
    assert any(isinstance(r["image"], list) for r in rows), "expected some multi-image rows"
    for row in rows:
        assert list(row) == ["id", "image", "conversations", "accu_reward_method", "task_type"]
        human, gpt = row["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        images = _images(row)
        assert human["value"].count("<image>") == len(images)
        for name in images:
            path = DEMO / "images" / name
            assert path.is_file(), name
            with Image.open(path) as im:
                assert max(im.size) <= 128
        if isinstance(row["image"], list):
            assert len(images) == 2 and row["task_type"] == "counting"
            assert human["value"].index("<image>", 1) > 0  # a placeholder sits inside the text
        else:
            assert human["value"].startswith("<image>")
        if row["task_type"] == "rec":
            assert row["accu_reward_method"] is None
            assert BOX_RE.match(gpt["value"])
        else:
            assert row["accu_reward_method"] == "default"
            assert COUNT_RE.match(gpt["value"])


def test_image_sizes_vary():
    sizes = set()
    for split in SPLITS:
        for row in _rows(DEMO, split):
            for name in _images(row):
                with Image.open(DEMO / "images" / name) as im:
                    sizes.add(im.size)
    assert len(sizes) >= 3 and any(w != h for w, h in sizes)


def _components(mask: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """8-connected components of ``mask`` as (x1, y1, x2, y2 exclusive, area)."""
    seen = np.zeros_like(mask, dtype=bool)
    out = []
    h, w = mask.shape
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        queue, ys, xs = deque([(y0, x0)]), [], []
        while queue:
            y, x = queue.popleft()
            ys.append(y)
            xs.append(x)
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
        out.append((min(xs), min(ys), max(xs) + 1, max(ys) + 1, len(xs)))
    return out


def _detect(pixels: np.ndarray) -> list[tuple[str, str, tuple[int, int, int, int]]]:
    """Recover (color, kind, box) of every shape from pixels alone; kind from the fill ratio of its box."""
    found = []
    for color, rgb in demo.COLORS.items():
        for x1, y1, x2, y2, area in _components(np.all(pixels == rgb, axis=-1)):
            fill = area / ((x2 - x1) * (y2 - y1))
            kind = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
            found.append((color, kind, (x1, y1, x2, y2)))
    return found


@pytest.mark.parametrize("split", SPLITS)
def test_scenes_match_pixels(split, samples):
    """The committed images show exactly the shapes of the generator's scene description."""
    for sample in samples[split]:
        assert _images(sample.row) == list(sample.image_files)
        for scene, name in zip(sample.scenes, sample.image_files, strict=True):
            pixels = _pixels(DEMO / "images" / name)
            assert pixels.shape == (scene.height, scene.width, 3)
            expected = sorted((s.color, s.kind, s.box) for s in scene.shapes)
            assert sorted(_detect(pixels)) == expected, name
            assert 1 <= len(scene.shapes) <= 5


@pytest.mark.parametrize("split", SPLITS)
def test_counting_answers(split, samples):
    for row, sample in zip(_rows(DEMO, split), samples[split], strict=True):
        assert row == sample.row
        if row["task_type"] != "counting":
            continue
        question = row["conversations"][0]["value"]
        color, noun = QUESTION_RE.search(question).groups()
        kind = None if noun == "shape" else noun
        assert sample.query == {"color": color, "kind": kind}
        answer = int(COUNT_RE.match(row["conversations"][1]["value"]).group(1))
        assert answer == sum(sc.count(color, kind) for sc in sample.scenes)
        # ... and independently from the pixels of the committed images.
        from_pixels = 0
        for name in _images(row):
            shapes = _detect(_pixels(DEMO / "images" / name))
            from_pixels += sum(1 for c, k, _ in shapes if color in (None, c) and kind in (None, k))
        assert answer == from_pixels, row["id"]


@pytest.mark.parametrize("split", SPLITS)
def test_rec_boxes(split, samples):
    for row, sample in zip(_rows(DEMO, split), samples[split], strict=True):
        if row["task_type"] != "rec":
            continue
        color, kind = re.search(r"Locate the (\w+) (\w+) in the image\.", row["conversations"][0]["value"]).groups()
        x1, y1, x2, y2 = map(int, BOX_RE.match(row["conversations"][1]["value"]).groups())
        pixels = _pixels(DEMO / "images" / row["image"])
        h, w = pixels.shape[:2]
        assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h
        rgb = demo.COLORS[color]
        assert tuple(pixels[(y1 + y2) // 2, (x1 + x2) // 2]) == rgb
        # Tight: the target colour touches all four box edges.
        inside = np.all(pixels[y1:y2, x1:x2] == rgb, axis=-1)
        assert inside[0].any() and inside[-1].any() and inside[:, 0].any() and inside[:, -1].any()
        # Exactly one shape matches the expression, and it is the boxed one.
        matches = [b for c, k, b in _detect(pixels) if (c, k) == (color, kind)]
        assert matches == [(x1, y1, x2, y2)], row["id"]
        assert sample.target == demo.Shape(color, kind, (x1, y1, x2, y2))


# ----------------------------------------------------------------------------- the colour task (make demo)
COLOUR = DEMO / demo.COLOUR_DIR


def test_colour_task_rows_and_pixels():
    """Same question everywhere, colours balanced, and the answer is the colour with the most pixels."""
    for split, n in (("train", 256), ("val", 64)):
        rows = _rows(COLOUR, split)
        assert len(rows) == n and len({r["id"] for r in rows}) == n
        answers = [r["conversations"][1]["value"] for r in rows]
        assert {a: answers.count(a) for a in set(answers)} == {c: n // 4 for c in demo.COLORS}
        for row, answer in zip(rows, answers, strict=True):
            assert row["conversations"][0]["value"] == "<image>What colour is the large shape?"
            assert (row["accu_reward_method"], row["task_type"]) == ("exact", "raw")
            pixels = _pixels(COLOUR / "images" / row["image"])
            assert max(pixels.shape[:2]) <= 64
            counts = {c: int(np.all(pixels == rgb, axis=-1).sum()) for c, rgb in demo.COLORS.items()}
            assert max(counts, key=counts.get) == answer, row["id"]
            assert sum(1 for v in counts.values() if v) == 2  # one large shape, one distractor
    assert not {r["image"] for r in _rows(COLOUR, "train")} & {r["image"] for r in _rows(COLOUR, "val")}


def test_colour_sft_rows_are_the_weak_labeller():
    """sft.jsonl: the train rows, with 3 in 5 red answers 'yellow' and 3 in 5 blue answers 'green', nothing else."""
    train, sft = _rows(COLOUR, "train"), _rows(COLOUR, "sft")
    assert [r["id"] for r in sft] == [r["id"] for r in train]
    answers: dict[tuple[str, str], int] = {}
    for true_row, weak_row in zip(train, sft, strict=True):
        truth, weak = true_row["conversations"][1]["value"], weak_row["conversations"][1]["value"]
        answers[truth, weak] = answers.get((truth, weak), 0) + 1
        assert {**weak_row, "conversations": true_row["conversations"]} == true_row
    # 64 rows a colour: rows k = 0..63 of red (blue) with k % 5 < 3 are mixed up, 39 of them
    assert answers == {
        ("red", "yellow"): 39, ("red", "red"): 25, ("blue", "green"): 39, ("blue", "blue"): 25,
        ("yellow", "yellow"): 64, ("green", "green"): 64,
    }  # fmt: skip
