"""Lewis reference game data: the speaker sees one target image and must describe it so that a listener picks it
out among ``k`` candidates (the target and ``k - 1`` distractors).

    python -m vlm_grpo.data.lewis --images data/demo/images --out runs/lewis/train.jsonl --rows 16 --k 3
    python -m vlm_grpo.data.lewis --concepts data/perva --out runs/lewis/train.jsonl      # same-concept distractors
    python -m vlm_grpo.data.lewis --concepts concepts.jsonl --image_root data/perva --out ...

``--concepts`` reads a PerVA / YoLLaVA-style folder (``ROOT/<concept>/<image>``) or a dataset file (JSONL, or a
JSON list, of ``{"image": path, "concept": name}``; paths relative to ``--image_root``). With ``--distractors
same_concept`` (the default there) a game's distractors are other images of the target's concept, so the speaker
must describe what sets this photo apart, not the object; ``other_concepts`` draws them from other concepts.

Each row is VLM-R1 JSONL; the ``solution`` is the JSON the ``listener`` reward reads::

    {"id": "lewis-0000", "image": "train_0003.png", "task_type": "raw",
     "conversations": [{"from": "human", "value": "<image>You are the speaker ..."},
                       {"from": "gpt", "value": "{\\"candidates\\": [\\"train_0011.png\\", \\"train_0003.png\\", ...],
                                                  \\"target\\": 1}"}]}

Candidate names are relative to the image folder (pass the same folder as ``--image_folders`` to training and
as ``--image_root`` to the listener service). ``task_type: raw`` keeps the prompt as written (no think/answer
suffix).

Training's ``--dataset_name DIR`` (the Lewis seed's ``share_data/PerVA_all_test_subset_seed_23_K_3_subset_30``)
builds PerVA games from a concept folder ``DIR/<concept>/<image>`` (:func:`dataset_name_source`): every image is
the target of one game whose ``K`` candidates (``_K_<k>`` in the folder's name, else 3) are it and images of other
concepts, drawn with the name's ``_seed_<s>`` (else ``--seed``); ``_subset_<n>`` in the name keeps ``n`` of those
games, drawn with the same seed (all, with a log line, when the folder has fewer images); paths are absolute. A
saved dataset or a data file given as ``--dataset_name`` is read as ``--data_file_paths`` would read it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

SPEAKER_PROMPT = (
    "<image>You are the speaker in a reference game. A listener will see this image among similar ones and must "
    "pick it from your words alone. First reason in <thinking></thinking>, then write a short description in "
    "<coarse></coarse>, then one sentence with the details that set this image apart in <detailed></detailed>."
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _game_row(i: int, target: str, answer: dict) -> dict:
    """One game as a speaker row: the target image, and the candidates / target index as the solution."""
    return {
        "id": f"lewis-{i:04d}",
        "image": target,
        "task_type": "raw",
        "conversations": [
            {"from": "human", "value": SPEAKER_PROMPT},
            {"from": "gpt", "value": json.dumps(answer)},
        ],
    }


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
        out.append(_game_row(i, target, {"candidates": candidates, "target": position}))
    return out


def write_lewis_dataset(images: str | Path, out: str | Path, rows: int = 16, k: int = 3, seed: int = 0) -> Path:
    """Write ``out`` (JSONL) with games over the images directly inside ``images``."""
    folder = Path(images)
    names = [p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
    target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps(r) + "\n" for r in make_lewis_rows(names, rows, k, seed)), encoding="utf-8")
    return target


DISTRACTORS = ("same_concept", "other_concepts")


def read_concepts(source: str | Path, image_root: str | Path | None = None) -> list[tuple[str, str]]:
    """``(image path relative to the image root, concept)`` pairs from a concept folder tree or a dataset file."""
    source = Path(source)
    if source.is_dir():
        return sorted(
            (f"{concept.name}/{p.name}", concept.name)
            for concept in source.iterdir()
            if concept.is_dir()
            for p in concept.iterdir()
            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
    if not source.is_file():
        raise ValueError(f"{source}: no such concept folder or dataset file")
    text = source.read_text(encoding="utf-8")
    if source.suffix == ".json":
        try:
            entries = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON ({exc})") from None
    else:
        entries = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    entries.append((number, json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
    root = Path(image_root) if image_root else source.parent
    pairs = []
    for number, row in entries:
        for field in ("image", "concept"):
            if not isinstance(row, dict) or not isinstance(row.get(field), str) or not row[field].strip():
                raise ValueError(f"{source}:{number}: field '{field}' must be a non-empty string")
        if not (root / row["image"]).is_file():
            raise ValueError(f"{source}:{number}: field 'image': {root / row['image']} does not exist")
        pairs.append((row["image"], row["concept"]))
    return pairs


def make_concept_games(
    items: Sequence[tuple[str, str]], rows: int = 16, k: int = 3, seed: int = 0, distractors: str = "same_concept"
) -> list[dict]:
    """``rows`` games whose distractors come from the target's concept (``same_concept``) or from the others."""
    if distractors not in DISTRACTORS:
        raise ValueError(f"distractors must be one of {DISTRACTORS}, got {distractors!r}")
    if k < 2:
        raise ValueError("k must be at least 2 (a target and a distractor)")
    by_concept: dict[str, list[str]] = {}
    for image, concept in sorted(items):
        by_concept.setdefault(concept, []).append(image)

    def pool(target: str, concept: str) -> list[str]:
        if distractors == "same_concept":
            return [i for i in by_concept[concept] if i != target]
        return [i for c, images in by_concept.items() if c != concept for i in images]

    targets = [(image, concept) for concept, images in sorted(by_concept.items()) for image in images]
    playable = [(t, c) for t, c in targets if len(pool(t, c)) >= k - 1]
    if not playable:
        raise ValueError(
            f"no concept has enough images for k={k} with {distractors} distractors "
            f"(largest concept: {max((len(v) for v in by_concept.values()), default=0)} images)"
        )
    rng = random.Random(seed)
    out = []
    for i in range(rows):
        target, concept = playable[i % len(playable)]
        candidates = rng.sample(pool(target, concept), k - 1)
        position = rng.randrange(k)
        candidates.insert(position, target)
        answer = {"candidates": candidates, "target": position, "concept": concept}
        out.append(_game_row(i, target, answer))
    return out


def is_concept_tree(folder: str | Path) -> bool:
    """A folder of concept sub-folders holding images (PerVA / YoLLaVA layout), not a saved dataset."""
    folder = Path(folder)
    if not folder.is_dir() or any((folder / f).exists() for f in ("dataset_info.json", "dataset_dict.json")):
        return False
    return any(
        sub.is_dir() and any(p.suffix.lower() in IMAGE_SUFFIXES for p in sub.iterdir()) for sub in folder.iterdir()
    )


def perva_games(folder: str | Path, seed: int = 0) -> list[dict]:
    """One game per image of a concept folder: the image among ``K - 1`` images of other concepts; ``K`` and the
    seed from the folder's name (``..._seed_23_K_3...``) when it says, else 3 and ``seed``; with ``_subset_<N>``
    in the name, N of those games drawn with that seed (all of them, said in a log line, when there are fewer).
    Paths are absolute."""
    folder = Path(folder).resolve()
    k_match, seed_match = re.search(r"_K_(\d+)", folder.name), re.search(r"_seed_(\d+)", folder.name)
    subset = re.search(r"_subset_(\d+)(?=_|$)", folder.name)
    k = int(k_match.group(1)) if k_match else 3
    seed = int(seed_match.group(1)) if seed_match else seed
    items = read_concepts(folder)
    games = make_concept_games(items, rows=len(items), k=k, seed=seed, distractors="other_concepts")
    if subset:
        games = _subset(games, int(subset.group(1)), seed, folder)
    for game in games:
        answer = json.loads(game["conversations"][1]["value"])
        answer["candidates"] = [str(folder / c) for c in answer["candidates"]]
        game["conversations"][1]["value"] = json.dumps(answer)
        game["image"] = str(folder / game["image"])
    return games


def _subset(games: list[dict], n: int, seed: int, folder: Path) -> list[dict]:
    """``n`` of ``games`` (their order kept), drawn with ``seed``: what a ``_subset_<n>`` folder name asks for."""
    if n < 1:
        raise ValueError(f"{folder}: the name's _subset_{n} asks for no games; name a positive number of games")
    if n >= len(games):
        logger.info("%s: _subset_%d in the name, the folder holds %d images: all %d are games", folder.name, n,
                    len(games), len(games))  # fmt: skip
        return games
    keep = sorted(random.Random(seed).sample(range(len(games)), n))
    logger.info("%s: _subset_%d in the name: %d of its %d games (seed %d)", folder.name, n, n, len(games), seed)
    return [games[i] for i in keep]


def dataset_name_source(name: str, output_dir: str | Path, seed: int = 0) -> str:
    """What training reads for ``--dataset_name NAME``: a concept folder's PerVA games, written to
    ``output_dir/data/<folder name>_games.jsonl`` (the path is returned); any other NAME as it is."""
    if not is_concept_tree(name):
        return name
    games = perva_games(name, seed)
    target = Path(output_dir) / "data" / f"{Path(name).resolve().name}_games.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    # every rank writes the same rows; the rename makes each write whole
    with tempfile.NamedTemporaryFile("w", dir=target.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
        f.write("".join(json.dumps(g) + "\n" for g in games))
    os.replace(f.name, target)
    return str(target)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo.data.lewis", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", help="folder of candidate images (distractors: any other image)")
    source.add_argument("--concepts", help="concept folder tree ROOT/<concept>/<image>, or a JSONL/JSON dataset file")
    parser.add_argument("--image_root", help="root of a --concepts file's image paths (default: the file's folder)")
    parser.add_argument("--distractors", choices=DISTRACTORS, default="same_concept", help="with --concepts")
    parser.add_argument("--out", required=True, help="JSONL file to write")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--k", type=int, default=3, help="candidates per game (target included)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.images:
        path = write_lewis_dataset(args.images, args.out, args.rows, args.k, args.seed)
    else:
        try:
            items = read_concepts(args.concepts, args.image_root)
            games = make_concept_games(items, args.rows, args.k, args.seed, args.distractors)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in games), encoding="utf-8")
    print(path)


if __name__ == "__main__":
    main()
