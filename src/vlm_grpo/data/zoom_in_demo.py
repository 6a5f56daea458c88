"""Synthetic "find the small marked object" set for the zoom-in (DeepEyes) demo, in VLM-R1 JSONL form.

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo.data.zoom_in_demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (train.jsonl + images/)")
    parser.add_argument("--n", type=int, default=64, help="rows (default 64)")
    parser.add_argument("--width", type=int, default=1024, help="canvas width in pixels (default 1024)")
    parser.add_argument("--height", type=int, default=768, help="canvas height in pixels (default 768)")
    parser.add_argument("--font_size", type=int, default=10, help="digit height in pixels (default 10)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = generate(Path(args.out), args.n, (args.width, args.height), args.font_size, args.seed)
    print(f"{path}: {args.n} rows")


if __name__ == "__main__":
    main()
