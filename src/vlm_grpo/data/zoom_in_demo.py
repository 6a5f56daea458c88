"""Synthetic "read the small marked object" sets for zoom-in (DeepEyes-style) runs, in VLM-R1 JSONL form.

``python -m vlm_grpo.data.zoom_in_demo --out runs/data/zoom_in`` writes ``train.jsonl`` and ``images/``.
Each image is a large cluttered canvas (grey shapes) holding one small red-framed box with a two-digit
number written in a tiny font: at the resolution a VLM sees the whole canvas (a few hundred thousand
pixels) the digits are unreadable, so the policy has to find the frame and zoom in (``--tools zoom_in``).
The same arguments always give the same files. Rows carry the box (``mark_box``, pixels) for analysis.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

QUESTION = (
    "<image>A small object in this picture is marked with a red frame, and a number is written inside it. "
    "What is the number? Zoom in on the frame to read it."
)


def render(rng: random.Random, size: tuple[int, int], font_size: int) -> tuple[Image.Image, str, list[int]]:
    """One canvas: clutter, then the marked box (frame + number); returns the image, the number and the box."""
    width, height = size
    image = Image.new("RGB", size, (236, 236, 230))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(25, 40)):  # grey clutter, never red
        x, y = rng.randrange(width), rng.randrange(height)
        w, h = rng.randint(8, width // 6), rng.randint(8, height // 6)
        shade = rng.randint(90, 200)
        box = [x, y, min(width - 1, x + w), min(height - 1, y + h)]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=(shade, shade, shade - 10))
    number = f"{rng.randint(10, 99)}"
    font = ImageFont.load_default(size=font_size)
    left, top, right, bottom = draw.textbbox((0, 0), number, font=font)
    pad = max(2, font_size // 3)
    box_w, box_h = right - left + 2 * pad, bottom - top + 2 * pad
    x0, y0 = rng.randrange(4, width - box_w - 4), rng.randrange(4, height - box_h - 4)
    mark = [x0, y0, x0 + box_w, y0 + box_h]
    draw.rectangle(mark, fill=(250, 250, 250), outline=(220, 20, 20), width=max(1, font_size // 6))
    draw.text((x0 + pad - left, y0 + pad - top), number, fill=(0, 0, 0), font=font)
    return image, number, mark


def generate(out: Path, n: int = 64, size: tuple[int, int] = (1024, 768), font_size: int = 10, seed: int = 0) -> Path:
    """Write ``n`` rows and their images under ``out``; returns the JSONL path."""
    rng = random.Random(seed)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        image, number, mark = render(rng, size, font_size)
        name = f"zoom_{i:04d}.png"
        image.save(images / name, optimize=False)
        rows.append(
            {
                "id": f"zoom-{i}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": QUESTION},
                    {"from": "gpt", "value": f"<answer>{number}</answer>"},
                ],
                "accu_reward_method": "exact",
                "task_type": "vqa",
                "mark_box": mark,
            }
        )
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------- the tool demo's set (make demo-tools)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 190, 20),
}
#: The weak labeller's blind spots (as in ``make demo``): 3 in 5 red objects called yellow, blue ones green.
MIXUPS: dict[str, str] = {"red": "yellow", "blue": "green"}
CANVAS = 112  # one 112 x 112 view: the tiny model's processor shows it at its own size (frame = pixels)
MARKED = (32, 32, 80, 80)  # the framed region holding the object: the box the trajectories zoom into
ZOOM_SIZE = 56  # zoom_in's "size" option in the demo: the 48-px region comes back at 56 px
TOOL_QUESTION = (
    "<image>What colour is the small object inside the grey frame? Zoom in on the frame, then answer in "
    "<answer></answer> tags."
)


def zoom_call(box: tuple[int, int, int, int] = MARKED) -> str:
    """The turn that calls ``zoom_in`` on ``box``, as a Qwen / Hermes tool call."""
    arguments = json.dumps({"name": "zoom_in", "arguments": {"bbox_2d": list(box)}})
    return f"<tool_call>\n{arguments}\n</tool_call>"


def tool_scene(rng: random.Random, colour: str) -> Image.Image:
    """Clutter of every colour outside the frame; inside it, one small square of ``colour``."""
    image = Image.new("RGB", (CANVAS, CANVAS), (236, 236, 230))
    draw = ImageDraw.Draw(image)
    x1, y1, x2, y2 = MARKED
    for _ in range(rng.randint(8, 12)):  # clutter never touches the frame
        side = rng.randint(6, 12)
        while True:
            cx, cy = rng.randrange(2, CANVAS - side - 2), rng.randrange(2, CANVAS - side - 2)
            if cx + side < x1 - 2 or cx > x2 + 2 or cy + side < y1 - 2 or cy > y2 + 2:
                break
        draw.rectangle([cx, cy, cx + side, cy + side], fill=COLOURS[rng.choice(list(COLOURS))])
    draw.rectangle(MARKED, outline=(90, 90, 90), width=2)
    side = rng.randint(22, 30)  # about half the zoomed view: one or two of its image tokens
    ox, oy = rng.randint(x1 + 4, x2 - 4 - side), rng.randint(y1 + 4, y2 - 4 - side)
    draw.rectangle([ox, oy, ox + side, oy + side], fill=COLOURS[colour])
    return image


def generate_tool_demo(out: Path, n_train: int = 256, n_val: int = 64, seed: int = 0) -> dict[str, Path]:
    """The tool demo's set under ``out``: ``train.jsonl`` / ``val.jsonl`` (questions with true answers) and
    ``sft.jsonl`` / ``sft_true.jsonl``: tool-use trajectories on the train images (the model's turns: the zoom
    call, then the answer; the tool's reply is made by the tool when the trajectory is replayed), answered by
    the weak labeller and truly. Colours are balanced (row i shows colour i % 4); the same arguments always give
    the same files."""
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    names = list(COLOURS)
    files: dict[str, list[str]] = {"train": [], "val": [], "sft": [], "sft_true": []}
    for split, n in (("train", n_train), ("val", n_val)):
        for i in range(n):
            rng = random.Random(f"vlm_grpo.zoom_in_demo.tools/{seed}/{split}/{i}")
            colour = names[i % len(names)]
            name = f"{split}_{i:04d}.png"
            tool_scene(rng, colour).save(images / name, optimize=True)
            row = {
                "id": f"zoom-tools-{split}-{i:04d}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": TOOL_QUESTION},
                    {"from": "gpt", "value": f"<answer>{colour}</answer>"},
                ],
                "accu_reward_method": "exact",
                "task_type": "raw",
            }
            files[split].append(json.dumps(row))
            if split != "train":
                continue
            weak = MIXUPS[colour] if colour in MIXUPS and (i // len(names)) % 5 < 3 else colour
            for kind, said in (("sft", weak), ("sft_true", colour)):
                turns = [zoom_call(), f"<answer>{said}</answer>"]
                files[kind].append(json.dumps({**row, "id": f"{row['id']}-{kind}", "assistant_turns": turns}))
    paths = {}
    for kind, lines in files.items():
        paths[kind] = out / f"{kind}.jsonl"
        paths[kind].write_text("".join(line + "\n" for line in lines))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo.data.zoom_in_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (train.jsonl + images/)")
    parser.add_argument("--n", type=int, default=64, help="rows (default 64)")
    parser.add_argument("--width", type=int, default=1024, help="canvas width in pixels (default 1024)")
    parser.add_argument("--height", type=int, default=768, help="canvas height in pixels (default 768)")
    parser.add_argument("--font_size", type=int, default=10, help="digit height in pixels (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tool_demo",
        action="store_true",
        help="write make demo-tools' set instead (train/val/sft/sft_true.jsonl: the coloured object in the frame)",
    )
    args = parser.parse_args(argv)
    if args.tool_demo:
        paths = generate_tool_demo(Path(args.out), seed=args.seed)
        print(", ".join(str(p) for p in paths.values()))
        return
    path = generate(Path(args.out), args.n, (args.width, args.height), args.font_size, args.seed)
    print(f"{path}: {args.n} rows")


if __name__ == "__main__":
    main()
