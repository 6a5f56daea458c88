"""``vlm-grpo-sft --tools``: supervised fine-tuning on whole tool rollouts, rendered as the GRPO run renders them.

Each row carries ``assistant_turns``: the model's turns, in order (every turn but the last calls a tool in the
run's ``--tool_protocol``; the last one answers). The row is replayed through the tool loop
(:meth:`vlm_grpo.eval_tools.ToolLoop.replay`): the prompt with the protocol's tool system prompt, each turn as the
model would write it (cut at the protocol's stop string), the tools' real replies (images included) rendered as
the GRPO run renders them. The loss is on the model's turns only; the tool replies and the prompt are masked.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import torch

from vlm_grpo.cli_errors import UserError
from vlm_grpo.data.jsonl import LazyImageTransform

#: The row column holding a rollout's assistant turns.
TURNS_COLUMN = "assistant_turns"
_PER_TOKEN = ("mm_token_type_ids", "token_type_ids")


def encode_rollout(processor: Any, segments: Sequence[tuple[str, list[Any], bool]]) -> dict[str, Any]:
    """One replayed rollout as token ids, labels (-100 outside the model's turns), per-token type ids and each
    image segment's processor fields (pixel values, grids, ...)."""
    tokenizer = getattr(processor, "tokenizer", processor)
    ids: list[int] = []
    labels: list[int] = []
    types: list[int] = []
    fields: list[dict[str, torch.Tensor]] = []
    for text, images, written in segments:
        if images:
            encoded = processor(text=[text], images=images, return_tensors="pt")
            piece = encoded["input_ids"][0].tolist()
            kinds = next((encoded[k] for k in _PER_TOKEN if k in encoded), None)
            types += kinds[0].tolist() if kinds is not None else [0] * len(piece)
            skip = {"input_ids", "attention_mask", *_PER_TOKEN}
            fields.append({k: v for k, v in encoded.items() if k not in skip and isinstance(v, torch.Tensor)})
        else:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            types += [0] * len(piece)
        ids += piece
        labels += piece if written else [-100] * len(piece)
    return {"input_ids": ids, "labels": labels, "types": types, "fields": fields}


@functools.lru_cache(maxsize=8)
def _lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return handle.read().splitlines()


def turns_at(source: str) -> Any:
    """The ``assistant_turns`` of the JSONL record at ``source`` (``file:line``, the row's own record: the plain
    JSONL reader keeps the canonical columns only)."""
    path, _, line = source.rpartition(":")
    try:
        record = json.loads(_lines(path)[int(line) - 1])
    except (OSError, ValueError, IndexError):
        return None
    return record.get(TURNS_COLUMN) if isinstance(record, dict) else None


class ToolRolloutTransform(LazyImageTransform):
    """``datasets`` transform: each row (its images decoded on access, as in the other recipes) replayed as a tool
    rollout and encoded (:func:`encode_rollout`)."""

    def __init__(self, module: Any, loop: Any, processor: Any) -> None:
        super().__init__(module)
        self.loop, self.processor = loop, processor

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out = super().__call__(batch)
        encoded = [self.encode({k: v[i] for k, v in out.items()}) for i in range(len(out["prompt"]))]
        return {key: [e[key] for e in encoded] for key in ("input_ids", "labels", "types", "fields", "images")}

    def encode(self, row: dict[str, Any]) -> dict[str, Any]:
        where = row.get("source") or "a row"
        turns = row.get(TURNS_COLUMN) if TURNS_COLUMN in row else turns_at(where)
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise UserError(
                f"{where}: vlm-grpo-sft --tools needs '{TURNS_COLUMN}', the model's turns as a list of strings (each "
                f"but the last calls a tool in the --tool_protocol format), got {turns!r}"
            )
        try:
            segments = self.loop.replay(row, turns)
        except ValueError as exc:
            raise UserError(f"{where}: {TURNS_COLUMN}: {exc}") from None
        # "images": TRL's SFTTrainer sees a vision dataset (the collator below does the processing).
        return {**encode_rollout(self.processor, segments), "images": row["images"]}


class ToolRolloutCollator:
    """Right-padded batch of encoded rollouts: ids, attention mask, labels, per-token type ids (as the family's
    forward names them) and the images' fields concatenated in order."""

    def __init__(self, pad_token_id: int, type_key: str | None) -> None:
        self.pad_token_id, self.type_key = pad_token_id, type_key

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        width = max(len(e["input_ids"]) for e in examples)
        batch = {
            "input_ids": torch.full((len(examples), width), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros((len(examples), width), dtype=torch.long),
            "labels": torch.full((len(examples), width), -100, dtype=torch.long),
        }
        types = torch.zeros((len(examples), width), dtype=torch.long)
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            batch["input_ids"][i, :n] = torch.tensor(e["input_ids"])
            batch["labels"][i, :n] = torch.tensor(e["labels"])
            batch["attention_mask"][i, :n] = 1
            types[i, :n] = torch.tensor(e["types"])
        if self.type_key is not None:
            batch[self.type_key] = types
        fields = [f for e in examples for f in e["fields"]]
        for key in dict.fromkeys(k for f in fields for k in f):
            batch[key] = torch.cat([f[key] for f in fields if key in f])
        return batch


def tool_rollout_dataset(dataset: Any, script_args: Any, module: Any, processor: Any) -> Any:
    """``dataset`` (the recipe's rows) replayed with the run's tools, tool options and protocol, on access."""
    from vlm_grpo.eval_tools import ToolLoop

    loop = ToolLoop(
        None, processor, module, script_args.tools, script_args.tool_kwargs, protocol=script_args.tool_protocol
    )
    return dataset.with_transform(ToolRolloutTransform(module, loop, processor))


def type_key(model: Any) -> str | None:
    """The per-token type-id argument the model's forward takes (Qwen2.5-VL / Qwen3-VL: ``mm_token_type_ids``)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return next((k for k in _PER_TOKEN if k in params), None)
