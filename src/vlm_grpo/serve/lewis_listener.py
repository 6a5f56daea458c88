"""The listener's half of the Lewis game: GRPO rows built from a served speaker's descriptions.

    python -m vlm_grpo.data.lewis_listener --games runs/lewis/train.jsonl --speaker_url http://127.0.0.1:9001 \\
        --out runs/lewis/round_1/listener.jsonl

For each speaker game (``python -m vlm_grpo.data.lewis``) the speaker service (``vlm-grpo-serve speaker``)
describes the target; the listener row shows the ``k`` candidates as images A, B, C, ... with that description and
asks which one it is. The solution is the target's letter in ``<answer></answer>``, scored by ``accuracy`` with
``reward_method: mcq`` (``configs/lewis_listener.yaml``). Candidate paths stay relative to the game's image folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_grpo.data.lewis import SPEAKER_PROMPT
from vlm_grpo.rewards.listener import describe_text

logger = logging.getLogger("vlm_grpo")

LISTENER_PROMPT = (
    'A speaker described one of the images above: "{description}". Which image is it? Reason in <think></think>, '
    "then give only its letter in <answer></answer>."
)


def listener_rows(games: Sequence[dict[str, Any]], texts: Sequence[str]) -> list[dict[str, Any]]:
    """One listener row per speaker game, from the speaker's raw output ``texts`` (tags stripped as the
    ``listener`` reward does)."""
    rows = []
    for game, text in zip(games, texts, strict=True):
        answer = json.loads(game["conversations"][1]["value"])
        candidates, target = answer["candidates"], answer["target"]
        if len(candidates) > len(string.ascii_uppercase):
            raise ValueError(f"game {game['id']}: {len(candidates)} candidates, at most 26 can be lettered")
        letters = string.ascii_uppercase[: len(candidates)]
        shown = "".join(f"Image {letter}: <image>\n" for letter in letters)
        description = describe_text(text).replace('"', "'")
        rows.append(
            {
                "id": f"{game['id']}-listener",
                "image": list(candidates),
                "task_type": "raw",
                "conversations": [
                    {"from": "human", "value": shown + LISTENER_PROMPT.format(description=description)},
                    {"from": "gpt", "value": f"<answer>{letters[target]}</answer>"},
                ],
            }
        )
    return rows


def describe_games(
    games: Sequence[dict[str, Any]], speaker_url: str, *, chunk: int = 16, timeout: float = 300.0
) -> list[str]:
    """The served speaker's description of each game's target (``POST /batch_describe``, greedy)."""
    import httpx

    headers = (
        {"Authorization": f"Bearer {os.environ['VLM_GRPO_SERVE_TOKEN']}"}
        if "VLM_GRPO_SERVE_TOKEN" in os.environ
        else {}
    )
    prompt = SPEAKER_PROMPT.replace("<image>", "")
    texts: list[str] = []
    with httpx.Client(timeout=timeout, headers=headers, trust_env=False) as client:
        for start in range(0, len(games), chunk):
            batch = [{"image_path": g["image"], "prompt": prompt} for g in games[start : start + chunk]]
            response = client.post(speaker_url.rstrip("/") + "/batch_describe", json={"batch": batch})
            response.raise_for_status()
            texts.extend(r["text"] for r in response.json()["results"])
    return texts


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo.data.lewis_listener", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--games", required=True, help="speaker games JSONL (python -m vlm_grpo.data.lewis)")
    parser.add_argument("--speaker_url", required=True, help="base URL of vlm-grpo-serve speaker")
    parser.add_argument("--out", required=True, help="listener rows JSONL to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    games = [json.loads(line) for line in Path(args.games).read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = describe_games(games, args.speaker_url)
    rows = listener_rows(games, texts)
    empty = sum(1 for t in texts if not describe_text(t))
    if empty:
        logger.warning(
            "%d of %d speaker descriptions are empty; their listener rows quote an empty text", empty, len(rows)
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(out)


if __name__ == "__main__":
    main()
