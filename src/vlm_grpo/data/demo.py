"""Deterministic synthetic demo data: coloured shapes on a plain background, in VLM-R1 JSONL form.

Run ``python -m vlm_grpo.data.demo --out data/demo`` to (re)generate the committed demo set. The same
arguments always give byte-identical files on a given Pillow/zlib build (no timestamps, no PNG metadata).

Each image is at most 128 px a side and holds 1-5 non-overlapping shapes (square / circle / triangle in
red / green / blue / yellow), drawn without anti-aliasing, so every shape pixel has exactly its colour.
Three kinds of row are written:

* ``counting`` -- "How many {color} {shape}s are in the image?" (or by colour only, by shape only, or
  all shapes); solution ``<answer>N</answer>``, ``accu_reward_method`` ``"default"``.
* ``rec`` -- "Locate the {color} {shape} in the image." where exactly one shape matches; solution
  ``<answer>[x1, y1, x2, y2]</answer>`` in original image pixels (``x2``/``y2`` exclusive, i.e. the
  shape covers columns ``x1 .. x2-1``), ``accu_reward_method`` ``None``.
* multi-image ``counting`` -- two images, ``image`` is a list and the ``<image>`` placeholders sit inside
  the text; the answer is a total over both images.

A second set, ``colour/`` (:func:`generate_colour`), is the task ``make demo`` learns on: "What colour is the
large shape?" with one large shape and one small distractor of another colour on a <= 64 px image. The question
never changes, so the answer (a bare colour word, ``accu_reward_method`` ``"exact"``) depends only on the image.
Besides ``train.jsonl`` / ``val.jsonl`` (true answers) it writes ``sft.jsonl``: the train images answered by a
weak labeller with two blind spots -- it calls 3 in 5 red shapes yellow and 3 in 5 blue shapes green (yellow and
green it always gets right). ``make demo`` fine-tunes on ``train.jsonl`` and then on ``sft.jsonl``: the model
takes on the labeller's bias, so its greedy answer for red and blue shapes is the wrong one (held-out accuracy
near 0.5, chance 0.25) while the right one is still sampled often enough for GRPO with the task reward to find it.

Public API: :data:`COLORS`, :data:`SHAPES`, :data:`IMAGE_SIZES`, :class:`Shape`, :class:`Scene`,
:class:`Sample`, :func:`random_scene`, :func:`render_scene`, :func:`generate_split`, :func:`generate`,
:data:`COLOUR_MIXUPS`, :func:`colour_split`, :func:`generate_colour`, :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 190, 20),
}
SHAPES: tuple[str, ...] = ("square", "circle", "triangle")
# (width, height); non-square sizes included, none above 128 px.
IMAGE_SIZES: tuple[tuple[int, int], ...] = ((112, 84), (128, 96), (96, 96), (84, 112), (128, 128), (96, 128))
BACKGROUNDS: tuple[tuple[int, int, int], ...] = ((255, 255, 255), (245, 245, 240), (236, 240, 246), (250, 244, 232))

IMAGE_DIR = "images"
SPLITS = ("train", "val")
MIN_SIDE = 12
MAX_SIDE = 28
GAP = 3  # minimum free pixels between two shapes' boxes
MARGIN = 2  # minimum free pixels between a shape and the image border


@dataclass(frozen=True)
class Shape:
    """One drawn shape. ``box`` is ``(x1, y1, x2, y2)`` in image pixels with ``x2``/``y2`` exclusive."""

    color: str
    kind: str
    box: tuple[int, int, int, int]

    @property
    def center(self) -> tuple[int, int]:
        x1, y1, x2, y2 = self.box
        return (x1 + x2) // 2, (y1 + y2) // 2


@dataclass(frozen=True)
class Scene:
    """Everything needed to render one image (and to recompute any answer about it)."""

    width: int
    height: int
    background: tuple[int, int, int]
    shapes: tuple[Shape, ...]

    def count(self, color: str | None = None, kind: str | None = None) -> int:
        """Number of shapes matching ``color`` and ``kind`` (``None`` matches anything)."""
        return sum(1 for s in self.shapes if (color is None or s.color == color) and (kind is None or s.kind == kind))


@dataclass
class Sample:
    """One JSONL row plus its ground truth: the scenes behind ``row["image"]`` (same order), the counting
    query (``color``/``kind``, ``None`` = any) or the rec target shape."""

    row: dict[str, Any]
    scenes: tuple[Scene, ...]
    image_files: tuple[str, ...]
    query: dict[str, str | None] = field(default_factory=dict)
    target: Shape | None = None


def _overlaps(a: tuple[int, int, int, int], b: tuple[int, int, int, int], gap: int) -> bool:
    return not (a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1])


def _place(rng: random.Random, width: int, height: int, taken: list[tuple[int, int, int, int]]):
    max_side = min(MAX_SIDE, min(width, height) // 4)
    for _ in range(200):
        side = rng.randint(MIN_SIDE, max_side)
        x1 = rng.randint(MARGIN, width - MARGIN - side)
        y1 = rng.randint(MARGIN, height - MARGIN - side)
        box = (x1, y1, x1 + side, y1 + side)
        if not any(_overlaps(box, t, GAP) for t in taken):
            return box
    return None


def random_scene(
    rng: random.Random,
    n_shapes: int | None = None,
    required: Sequence[tuple[str, str]] = (),
    size: tuple[int, int] | None = None,
) -> Scene:
    """A random scene with ``n_shapes`` (default 1-5) non-overlapping shapes; the first shapes are the
    ``(color, kind)`` pairs in ``required``, the rest are random."""
    while True:
        width, height = size or rng.choice(IMAGE_SIZES)
        n = n_shapes if n_shapes is not None else rng.randint(1, 5)
        n = max(n, len(required))
        specs = list(required) + [(rng.choice(list(COLORS)), rng.choice(SHAPES)) for _ in range(n - len(required))]
        boxes: list[tuple[int, int, int, int]] = []
        for _ in specs:
            box = _place(rng, width, height, boxes)
            if box is None:
                break
            boxes.append(box)
        if len(boxes) == len(specs):
            shapes = tuple(Shape(c, k, b) for (c, k), b in zip(specs, boxes, strict=True))
            return Scene(width, height, rng.choice(BACKGROUNDS), shapes)


def render_scene(scene: Scene) -> Image.Image:
    """Draw ``scene`` as an RGB image (no anti-aliasing: every shape pixel has exactly its colour)."""
    img = Image.new("RGB", (scene.width, scene.height), scene.background)
    draw = ImageDraw.Draw(img)
    for s in scene.shapes:
        rgb = COLORS[s.color]
        x1, y1, x2, y2 = s.box
        x2, y2 = x2 - 1, y2 - 1  # PIL coordinates are inclusive
        if s.kind == "square":
            draw.rectangle((x1, y1, x2, y2), fill=rgb, outline=rgb)
        elif s.kind == "circle":
            draw.ellipse((x1, y1, x2, y2), fill=rgb, outline=rgb)
        elif s.kind == "triangle":
            pts = [(x1, y2), (x2, y2), ((x1 + x2) // 2, y1)]
            draw.polygon(pts, fill=rgb, outline=rgb)
        else:
            raise ValueError(f"unknown shape kind {s.kind!r}")
    return img


def _task_for(idx: int) -> str:
    if (idx + 1) % 8 == 0:
        return "multi"
    return "counting" if idx % 2 == 0 else "rec"


def _counting_question(color: str | None, kind: str | None) -> str:
    noun = f"{kind}s" if kind else "shapes"
    return f"How many {color + ' ' if color else ''}{noun} are in the image?"


def _make_row(rid: str, images: list[str], question: str, answer: str, method: str | None, task: str) -> dict:
    return {
        "id": rid,
        "image": images[0] if len(images) == 1 else images,
        "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}],
        "accu_reward_method": method,
        "task_type": task,
    }


def _counting_sample(rng: random.Random, rid: str, name: str) -> Sample:
    variant = rng.choice(("color_kind", "color_kind", "kind", "color", "all"))
    color = rng.choice(list(COLORS)) if variant in ("color_kind", "color") else None
    kind = rng.choice(SHAPES) if variant in ("color_kind", "kind") else None
    n = rng.randint(1, 5)
    k = rng.randint(1, n) if variant != "all" else 0
    required = [(color or rng.choice(list(COLORS)), kind or rng.choice(SHAPES)) for _ in range(k)]
    scene = random_scene(rng, n_shapes=n, required=required)
    scene = Scene(scene.width, scene.height, scene.background, tuple(rng.sample(scene.shapes, len(scene.shapes))))
    answer = f"<answer>{scene.count(color, kind)}</answer>"
    row = _make_row(rid, [name], "<image>" + _counting_question(color, kind), answer, "default", "counting")
    return Sample(row, (scene,), (name,), query={"color": color, "kind": kind})


def _rec_sample(rng: random.Random, rid: str, name: str) -> Sample:
    while True:
        scene = random_scene(rng)
        unique = [s for s in scene.shapes if scene.count(s.color, s.kind) == 1]
        if unique:
            break
    target = rng.choice(unique)
    box = ", ".join(str(v) for v in target.box)
    question = f"<image>Locate the {target.color} {target.kind} in the image."
    row = _make_row(rid, [name], question, f"<answer>[{box}]</answer>", None, "rec")
    return Sample(row, (scene,), (name,), target=target)


def _multi_sample(rng: random.Random, rid: str, names: list[str]) -> Sample:
    scenes = (random_scene(rng, n_shapes=rng.randint(1, 4)), random_scene(rng, n_shapes=rng.randint(1, 4)))
    if rng.random() < 0.5:
        color = None
        question = (
            "<image>In the first image there are some shapes. <image>In the second image there are some more. "
            "How many shapes are there in total in the two images?"
        )
    else:
        color = rng.choice([s.color for sc in scenes for s in sc.shapes])
        question = (
            f"Compare the two pictures: <image> and <image>. "
            f"How many {color} shapes are there in total across both images?"
        )
    total = sum(sc.count(color) for sc in scenes)
    row = _make_row(rid, names, question, f"<answer>{total}</answer>", "default", "counting")
    return Sample(row, scenes, tuple(names), query={"color": color, "kind": None})


def generate_split(split: str, n: int, seed: int = 0) -> list[Sample]:
    """The ``n`` samples of ``split`` for ``seed`` -- pure, nothing written. Row ``i`` depends only on
    ``(seed, split, i)``. Roughly half counting, half rec; every 8th row is a two-image counting row."""
    samples = []
    for idx in range(n):
        rng = random.Random(f"vlm_grpo.demo/{seed}/{split}/{idx}")
        rid = f"demo-{split}-{idx:04d}"
        stem = f"{split}_{idx:04d}"
        task = _task_for(idx)
        if task == "counting":
            samples.append(_counting_sample(rng, rid, f"{stem}.png"))
        elif task == "rec":
            samples.append(_rec_sample(rng, rid, f"{stem}.png"))
        else:
            samples.append(_multi_sample(rng, rid, [f"{stem}_0.png", f"{stem}_1.png"]))
    return samples


_README = """\
# Demo data (synthetic)

Tiny, deterministic VLM-R1-style data set for smoke tests and demos: {n_train} train / {n_val} val rows of
coloured shapes (red/green/blue/yellow squares, circles, triangles) on a plain light background,
images <= 128 px. Tasks: `counting` (answer `<answer>N</answer>`, `accu_reward_method` "default"),
`rec` grounding (answer `<answer>[x1, y1, x2, y2]</answer>` in original image pixels, x2/y2 exclusive,
`accu_reward_method` null) and a few two-image `counting` rows (`image` is a list, `<image>` placeholders
inside the text). `colour/` holds the image-only colour task that `make demo` learns (see its README).

Regenerate (byte-identical for the same arguments; do not edit by hand, tests/test_demo_data.py checks it):

    python -m vlm_grpo.data.demo --out data/demo --n_train {n_train} --n_val {n_val} --seed {seed}

Row format (one JSON object per line; image paths are relative to `images/`):

    {{"id": "demo-train-0000", "image": "train_0000.png" | ["a.png", "b.png"],
     "conversations": [{{"from": "human", "value": "<image>How many ...?"}},
                       {{"from": "gpt", "value": "<answer>2</answer>"}}],
     "accu_reward_method": "default" | null, "task_type": "counting" | "rec"}}
"""


def generate(out_dir: str | Path, n_train: int = 48, n_val: int = 8, seed: int = 0) -> dict[str, list[Sample]]:
    """Write ``{out_dir}/images/*.png``, ``train.jsonl``, ``val.jsonl`` and ``README.md``; return the samples
    per split. Stale ``train_*.png`` / ``val_*.png`` in ``images/`` are removed so the folder matches."""
    out = Path(out_dir)
    img_dir = out / IMAGE_DIR
    img_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, list[Sample]] = {}
    written: set[str] = set()
    for split, n in zip(SPLITS, (n_train, n_val), strict=True):
        samples = generate_split(split, n, seed)
        result[split] = samples
        lines = []
        for sample in samples:
            for scene, name in zip(sample.scenes, sample.image_files, strict=True):
                render_scene(scene).save(img_dir / name, format="PNG", optimize=True)
                written.add(name)
            lines.append(json.dumps(sample.row, ensure_ascii=False) + "\n")
        with open(out / f"{split}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(lines)
    for split in SPLITS:
        for stale in img_dir.glob(f"{split}_*.png"):
            if stale.name not in written:
                stale.unlink()
    with open(out / "README.md", "w", encoding="utf-8", newline="\n") as f:
        f.write(_README.format(n_train=n_train, n_val=n_val, seed=seed))
    return result


# ----------------------------------------------------------------------------- the colour task (make demo)
COLOUR_DIR = "colour"
COLOUR_QUESTION = "<image>What colour is the large shape?"
COLOUR_SIZES: tuple[int, ...] = (48, 56, 64)
# The weak SFT labeller's blind spots: it answers the value for 3 in 5 rows of the key's colour.
COLOUR_MIXUPS: dict[str, str] = {"red": "yellow", "blue": "green"}


def colour_scene(rng: random.Random, color: str) -> Scene:
    """One large square or circle of ``color`` and one small square of another colour (the distractor)."""
    side = rng.choice(COLOUR_SIZES)
    big = rng.randint(side // 2, side - 2 * MARGIN - 12)
    x1, y1 = rng.randint(MARGIN, side - MARGIN - big), rng.randint(MARGIN, side - MARGIN - big)
    large = Shape(color, rng.choice(("square", "circle")), (x1, y1, x1 + big, y1 + big))
    other = rng.choice([c for c in COLORS if c != color])
    while True:
        small = rng.randint(6, 9)
        sx, sy = rng.randint(MARGIN, side - MARGIN - small), rng.randint(MARGIN, side - MARGIN - small)
        box = (sx, sy, sx + small, sy + small)
        if not _overlaps(box, large.box, 1):
            return Scene(side, side, rng.choice(BACKGROUNDS), (large, Shape(other, "square", box)))


def colour_split(split: str, n: int, seed: int = 0) -> list[Sample]:
    """``n`` rows of the colour task; row ``i`` shows colour ``i % 4`` (balanced) and depends only on
    ``(seed, split, i)``. ``Sample.query["weak"]`` is the weak labeller's answer (see the module docstring)."""
    names = list(COLORS)
    samples = []
    for idx in range(n):
        rng = random.Random(f"vlm_grpo.demo.colour/{seed}/{split}/{idx}")
        color = names[idx % len(names)]
        scene = colour_scene(rng, color)
        name = f"{split}_{idx:04d}.png"
        row = _make_row(f"colour-{split}-{idx:04d}", [name], COLOUR_QUESTION, color, "exact", "raw")
        mixed_up = color in COLOUR_MIXUPS and (idx // len(names)) % 5 < 3
        weak = COLOUR_MIXUPS[color] if mixed_up else color
        samples.append(Sample(row, (scene,), (name,), query={"color": color, "weak": weak}))
    return samples


_COLOUR_README = """\
# Colour task (synthetic): what `make demo` learns

"What colour is the large shape?" -- one large square or circle (red/green/blue/yellow) and one small square of
another colour on a light background, {sizes} px images. The question is the same in every row, so the answer
depends only on the image. Answers are bare colour words (`accu_reward_method` "exact", `task_type` "raw": no
think/answer tags). Colours are balanced (row i shows colour i % 4).

- `train.jsonl` ({n_train} rows) and `val.jsonl` ({n_val} held-out rows): true answers.
- `sft.jsonl`: the train images answered by a weak labeller that calls 3 in 5 red shapes yellow and 3 in 5 blue
  shapes green (yellow and green always right). `make demo` fine-tunes on `train.jsonl`, then on `sft.jsonl`:
  the model takes on the labeller's bias and answers red and blue shapes wrongly when greedy (held-out accuracy
  near 0.5, chance 0.25). GRPO with the exact-match reward on `train.jsonl` then has to undo it from the pixels.

Regenerated with the shapes set by `python -m vlm_grpo.data.demo --out data/demo` (do not edit by hand).
"""


def generate_colour(out_dir: str | Path, n_train: int = 256, n_val: int = 64, seed: int = 0) -> dict[str, list[Sample]]:
    """Write the colour task to ``out_dir`` (``images/``, ``train.jsonl``, ``sft.jsonl``, ``val.jsonl``,
    ``README.md``); stale images are removed."""
    out = Path(out_dir)
    img_dir = out / IMAGE_DIR
    img_dir.mkdir(parents=True, exist_ok=True)
    result = {"train": colour_split("train", n_train, seed), "val": colour_split("val", n_val, seed)}
    written: set[str] = set()
    files: dict[str, list[str]] = {"train": [], "sft": [], "val": []}
    for split, samples in result.items():
        for sample in samples:
            render_scene(sample.scenes[0]).save(img_dir / sample.image_files[0], format="PNG", optimize=True)
            written.add(sample.image_files[0])
            files[split].append(json.dumps(sample.row, ensure_ascii=False) + "\n")
            if split == "train":
                weak = json.loads(json.dumps(sample.row))
                weak["conversations"][1]["value"] = sample.query["weak"]
                files["sft"].append(json.dumps(weak, ensure_ascii=False) + "\n")
    for name, lines in files.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(lines)
    for stale in img_dir.glob("*.png"):
        if stale.name not in written:
            stale.unlink()
    sizes = "/".join(str(s) for s in COLOUR_SIZES)
    with open(out / "README.md", "w", encoding="utf-8", newline="\n") as f:
        f.write(_COLOUR_README.format(sizes=sizes, n_train=n_train, n_val=n_val))
    return result


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo.data.demo",
        description="Generate the deterministic synthetic shapes demo set and the colour task under colour/ "
        "(VLM-R1 JSONL + PNG images).",
    )
    parser.add_argument("--out", default="data/demo", help="output folder (default: %(default)s)")
    parser.add_argument("--n_train", type=int, default=48, help="train rows (default: %(default)s)")
    parser.add_argument("--n_val", type=int, default=8, help="val rows (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    parser.add_argument("--colour_train", type=int, default=256, help="colour-task train rows (default: %(default)s)")
    parser.add_argument("--colour_val", type=int, default=64, help="colour-task held-out rows (default: %(default)s)")
    args = parser.parse_args(argv)
    result = generate(args.out, args.n_train, args.n_val, args.seed)
    colour = generate_colour(Path(args.out) / COLOUR_DIR, args.colour_train, args.colour_val, args.seed)
    result.update({f"{COLOUR_DIR}/{split}": samples for split, samples in colour.items()})
    for split, samples in result.items():
        n_img = sum(len(s.image_files) for s in samples)
        print(f"{split}: {len(samples)} rows, {n_img} images -> {Path(args.out) / f'{split}.jsonl'}")


if __name__ == "__main__":
    main()
