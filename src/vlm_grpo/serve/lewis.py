"""Lewis reference game data: the speaker sees one target image and must describe it so that a listener picks it
out among ``k`` candidates (the target and ``k - 1`` distractors from the same folder).

    python -m vlm_grpo.serve.lewis --images data/demo/images --out runs/lewis/train.jsonl --rows 16 --k 3

Each row is VLM-R1 JSONL; the ``solution`` is the JSON the ``listener`` reward reads::

    {"id": "lewis-0000", "image": "train_0003.png", "task_type": "raw",
     "conversations": [{"from": "human", "value": "<image>You are the speaker ..."},
                       {"from": "gpt", "value": "{\\"candidates\\": [\\"train_0011.png\\", \\"train_0003.png\\", ...],
                                                  \\"target\\": 1}"}]}

Candidate names are relative to the image folder (pass the same folder as ``--image_folders`` to training and
as ``--image_root`` to the listener service). ``task_type: raw`` keeps the prompt as written (no think/answer
suffix).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path

SPEAKER_PROMPT = (
    "<image>You are the speaker in a reference game. A listener will see this image among similar ones and must "
    "pick it from your words alone. First reason in <thinking></thinking>, then write a short description in "
    "<coarse></coarse>, then one sentence with the details that set this image apart in <detailed></detailed>."
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def make_lewis_rows(image_names: Sequence[str], rows: int = 16, k: int = 3, seed: int = 0) -> list[dict]:
    """``rows`` games over ``image_names`` (sorted first, so the result depends only on the names and the seed)."""
    names = sorted(image_names)
    if len(names) < k:
        raise ValueError(f"need at least k={k} images, got {len(names)}")
    if k < 2:
        raise ValueError("k must be at least 2 (a target and a distractor)")
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        target = names[i % len(names)]
        distractors = rng.sample([n for n in names if n != target], k - 1)
        candidates = [*distractors]
        position = rng.randrange(k)
        candidates.insert(position, target)
        out.append(
            {
                "id": f"lewis-{i:04d}",
                "image": target,
                "task_type": "raw",
                "conversations": [
                    {"from": "human", "value": SPEAKER_PROMPT},
                    {"from": "gpt", "value": json.dumps({"candidates": candidates, "target": position})},
                ],
            }
        )
    return out


def write_lewis_dataset(images: str | Path, out: str | Path, rows: int = 16, k: int = 3, seed: int = 0) -> Path:
    """Write ``out`` (JSONL) with games over the images directly inside ``images``."""
    folder = Path(images)
    names = [p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps(r) + "\n" for r in make_lewis_rows(names, rows, k, seed)), encoding="utf-8")
    return target


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo.serve.lewis", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="folder of candidate images")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--k", type=int, default=3, help="candidates per game (target included)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_lewis_dataset(args.images, args.out, args.rows, args.k, args.seed)
    print(path)


if __name__ == "__main__":
    main()
