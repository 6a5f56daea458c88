"""Tool rollouts keep their KV cache from one turn to the next: later turns prefill only what is new.

TRL's tool loop hands every turn after a tool result the rollout's whole history (prompt, earlier turns, tool
replies) as a new prompt, and ``generate`` prefills all of it and runs the vision tower on every image in it, turn
after turn. Here each rollout's keys and values are kept after a turn is decoded (:meth:`TurnCache.remember`, from
``fast_decode``'s static cache), and the next turn (:func:`continue_turns`) prefills only the tokens past what is
held: the end of the last turn, the tool reply with its images (the only images the vision tower sees), the next
assistant header. ``fast_decode`` then goes on from there, with the tokens, positions and sampling TRL's path has.

What is held is matched to a row by its tokens (the longest held prefix of the row's history), so a turn that TRL
cut (``max_completion_length``, the per-turn budget) or a row that is not held simply prefills more. Anything this
path does not know (videos, images whose pixels it cannot cut per image, processors that read the whole history)
returns None: the turn then prefills the whole history, as before, and is held from then on.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlm_grpo.fastpath import decode
from vlm_grpo.fastpath.decode_autocast import autocast_seen
from vlm_grpo.utils import generation_model, peft_base, warn_once

logger = logging.getLogger(__name__)

_IMAGE_PADS = ("<|image_pad|>", "<IMG_CONTEXT>")


@dataclass
class Held:
    """One rollout's keys and values after a turn: ``ids`` sit at ``segments`` (slot ranges, in order) of row
    ``row`` of ``layers`` (per layer (keys, values), ``(rows, heads, slots, dim)``, shared by a turn's rows)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    row: int
    segments: list[tuple[int, int]]
    ids: list[int]
    delta: int  # rotary position minus token index, for the text tokens after the last image
    images: int  # images among ids
    image_keys: tuple = ()  # their contents' keys (TurnCache.image_key), in order
    array: np.ndarray = field(init=False, repr=False, compare=False)  # ids, for matching rows without Python loops

    def __post_init__(self) -> None:
        self.array = np.asarray(self.ids, dtype=np.int64)


@dataclass
class TurnStats:
    """What the turns after the first did: tokens prefilled (padding not counted), tokens read from the held
    cache, images encoded by the vision tower, generation calls served."""

    prefill_tokens: int = 0
    reused_tokens: int = 0
    images_encoded: int = 0
    calls: int = 0
    fallbacks: list[str] = field(default_factory=list)
    # Tool calls started as their turn ended (vlm_grpo.tools.early_calls), the turns they came from, and rows of
    # loop rounds left alone because their rollout was in doubt.
    early_calls: int = 0
    early_turns: int = 0
    early_unmatched: int = 0


class TurnCache:
    """The held caches of one generation's rollouts (one ``_generate`` call of the trainer)."""

    def __init__(self, image_pad_id: int | None, pad_id: int) -> None:
        self.image_pad_id = image_pad_id
        self.encoded: Any = None  # the image outputs of the last prefill's new images (see continue_turns)
        self.pad_id = pad_id
        self.held: list[Held] = []
        self.stats = TurnStats()
        self.early: Any = None  # the generation's EarlyCalls (vlm_grpo.tools.early_calls), where they are on
        self._keys: dict[int, tuple[Any, bytes]] = {}  # id(image) -> (image, key); the image is kept: its id stays

    def image_key(self, image: Any) -> bytes:
        """A key of an image's contents: rows whose images have equal tokens but other pixels never share a cache."""
        known = self._keys.get(id(image))
        if known is not None and known[0] is image:
            return known[1]
        if hasattr(image, "tobytes") and hasattr(image, "size"):
            digest = hashlib.blake2b(image.tobytes(), digest_size=16)
            digest.update(repr((getattr(image, "mode", None), image.size)).encode())
            key = digest.digest()
        else:  # not a PIL image: only the same object matches
            key = f"object:{id(image)}".encode()
        self._keys[id(image)] = (image, key)
        return key

    def row_keys(self, images: list | None) -> tuple:
        return tuple(self.image_key(image) for image in images or [])

    def remember(
        self,
        cache: Any,
        rows: list[int],
        layouts: list[tuple[list[int], list[tuple[int, int]]]],
        completions: list[list[int]],
        next_slot: int,
        deltas: list[int],
        image_keys: list[tuple],
    ) -> None:
        """Hold what a decode left in ``cache`` (``fast_decode``'s static cache): row ``rows[k]`` of it answers
        ``layouts[k]`` (the row's context tokens, the slot ranges of all but its last; ``image_keys[k]``: its
        images') and ``completions[k]`` (cut after EOS); from slot ``next_slot`` on the decode wrote the context's
        last token and every completion token but the last. Replaces whatever was held: every generation call
        covers all the rollouts still going."""
        longest = max((len(c) for c in completions), default=0)
        width = next_slot + longest
        layers = [(layer.keys[:, :, :width].clone(), layer.values[:, :, :width].clone()) for layer in cache.layers]
        self.held = []
        for row, (ids, segments), completion, delta, keys in zip(
            rows, layouts, completions, deltas, image_keys, strict=True
        ):
            if not completion:
                continue
            held_ids = list(ids) + list(completion[:-1])
            segments = _merge([*segments, (next_slot, next_slot + len(completion))])
            images = self.count_images(held_ids)
            if images != len(keys):
                continue  # its image tokens do not match its images: not held
            self.held.append(Held(layers, row, segments, held_ids, delta, images, tuple(keys)))

    def forget(self) -> None:
        self.held = []

    def count_images(self, ids: list[int] | np.ndarray) -> int:
        """Images among ``ids``: runs of the image placeholder token."""
        if self.image_pad_id is None:
            return 0
        pads = np.asarray(ids, dtype=np.int64) == self.image_pad_id
        return int(pads[:1].sum() + (pads[1:] & ~pads[:-1]).sum())

    def match(self, ids: list[int], keys: tuple = ()) -> tuple[Held | None, int]:
        """The held rollout sharing the longest prefix with ``ids`` (``keys``: its images' keys) and that prefix's
        length: at most all but the last token (which the decode feeds), never inside an image, and only where
        every held image lies within the prefix and is the row's own image (same pixels)."""
        best, best_len = None, 0
        limit = len(ids) - 1
        row = np.asarray(ids, dtype=np.int64)
        for held in self.held:
            n = min(len(held.ids), limit)
            if n <= best_len:
                continue
            same = self._cut(held.ids, ids, _common_prefix(held.array, row, n))
            if same <= best_len or self.count_images(held.array[:same]) != held.images:
                continue  # an image of the held turn would lie past the cut: its positions would differ
            if held.image_keys != tuple(keys[: held.images]):
                continue  # the same image tokens, other pixels
            best, best_len = held, same
        return best, best_len

    def _cut(self, held: list[int], ids: list[int], n: int) -> int:
        """``n`` moved back to before an image that either side continues past it."""
        pad = self.image_pad_id
        if pad is None:
            return n
        while n and held[n - 1] == pad and pad in (*ids[n : n + 1], *held[n : n + 1]):
            n -= 1
        return n


def _common_prefix(a: np.ndarray, b: np.ndarray, n: int) -> int:
    """Length of the common prefix of the first ``n`` tokens of ``a`` and ``b``."""
    differ = a[:n] != b[:n]
    return int(differ.argmax()) if differ.any() else n


def _merge(segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in segments:
        if end <= start:
            continue
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _slots(segments: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """The first ``count`` slots of ``segments``."""
    out = []
    for start, end in segments:
        if count <= 0:
            break
        take = min(end - start, count)
        out.append((start, start + take))
        count -= take
    return out


def _image_units(fields: dict[str, Any], total_images: int) -> list[int] | None:
    """Rows of ``pixel_values`` each image owns, in order; None when they cannot be told apart."""
    pixels = fields.get("pixel_values")
    if pixels is None:
        return [] if total_images == 0 else None
    if not isinstance(pixels, torch.Tensor):
        return None
    grid = fields.get("image_grid_thw")
    if grid is not None:
        units = grid.prod(dim=-1).tolist()
    elif pixels.size(0) == total_images:  # one tile an image (InternVL without crops)
        units = [1] * total_images
    else:
        return None
    if len(units) != total_images or sum(units) != pixels.size(0):
        return None
    return units


def _unhonoured(generation_config: Any) -> str | None:
    """Processors that read the whole history would see padding between its pieces."""
    if (generation_config.repetition_penalty or 1.0) != 1.0:
        return f"repetition_penalty={generation_config.repetition_penalty}"
    if generation_config.no_repeat_ngram_size:
        return f"no_repeat_ngram_size={generation_config.no_repeat_ngram_size}"
    return None


def _step_aside(turns: TurnCache, reason: str) -> None:
    """Say once why a later turn prefills the whole history, and drop what is held."""
    warn_once(logger, f"turn cache: {reason}: this tool turn prefills the rollouts' whole history", logging.INFO)
    turns.stats.fallbacks.append(reason)
    turns.forget()
    return None


@dataclass
class TurnPlan:
    """What :func:`run_turns` prefills for each row (held rollout, tokens reused, new chunk, first new image) and
    the pixel rows and grid rows of the new images, in the order their tokens come."""

    prompt_ids: list[list[int]]
    images: list | None
    fields: dict[str, Any]
    rows: list[tuple[Held | None, int, list[int], int]]
    pixel_rows: list[tuple[int, int]]
    grid_rows: list[int]
    row_keys: list[tuple]


def continue_turns(
    trainer: Any, turns: TurnCache, prompt_ids: list[list[int]], images: list | None, fields: dict[str, Any]
) -> list[list[int]] | None:
    """The next turn of every rollout (``prompt_ids``: each its whole history), prefilling only what is not held.

    Returns the completions (cut after the first EOS) in the rows' order, or None for inputs this path does not
    know (the caller then prefills the whole history)."""
    plan = plan_turns(trainer, turns, prompt_ids, images, fields)
    return run_turns(trainer, turns, plan) if plan is not None else None


def plan_turns(
    trainer: Any, turns: TurnCache, prompt_ids: list[list[int]], images: list | None, fields: dict[str, Any]
) -> TurnPlan | None:
    """Match every row to what is held and decide what it prefills, without touching the model's parameters (no
    collective: ranks under ZeRO-3 decide, then vote, see :mod:`vlm_grpo.tools.rounds`). None: this path does not
    know these inputs (the reason is logged once and what was held is dropped)."""
    reason = _unhonoured(trainer.generation_config)
    if fields.get("pixel_values_videos") is not None:
        reason = "videos in the conversation"
    row_images = [len(x) if x else 0 for x in images] if images is not None else [0] * len(prompt_ids)
    units = _image_units(fields, sum(row_images))
    if reason is None and units is None:
        reason = "image pixels that cannot be cut per image"
    if reason is None:  # the model as configured (ZeRO-3's partitioned parameters leave its config whole)
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        reason = None if trainer.args.fast_decode else "fast_decode is off"
        reason = reason or decode.unsupported_reason(model)
    if reason is not None:
        return _step_aside(turns, reason)

    rows = []
    row_keys = [turns.row_keys(x) for x in images] if images is not None else [()] * len(prompt_ids)
    for ids, n_images, keys in zip(prompt_ids, row_images, row_keys, strict=True):
        held, reused = turns.match(ids, keys)
        if held is None:
            reused = 0
        chunk = ids[reused:-1]
        new_images = turns.count_images(chunk)
        first_image = n_images - new_images
        if first_image < 0 or (held.images if held is not None else 0) != first_image:
            return _step_aside(turns, "the rollout's image tokens do not match its images")
        rows.append((held, reused, chunk, first_image))
    if not any(chunk for _, _, chunk, _ in rows):  # the decode would not know the prefill's autocast
        return _step_aside(turns, "no rollout has a new token to prefill")
    # Pixel rows of each row's new images, in the order their tokens come in the chunk batch.
    starts = [0]
    for u in units:
        starts.append(starts[-1] + u)
    image_start = 0
    pixel_rows, grid_rows = [], []
    for (_, _, _, first_image), n_images in zip(rows, row_images, strict=True):
        for k in range(image_start + first_image, image_start + n_images):
            pixel_rows.append((starts[k], starts[k + 1]))
            grid_rows.append(k)
        image_start += n_images
    return TurnPlan(prompt_ids, images, fields, rows, pixel_rows, grid_rows, row_keys)


def run_turns(trainer: Any, turns: TurnCache, plan: TurnPlan) -> list[list[int]]:
    """Prefill ``plan``'s new tokens into the held caches and decode, inside one gather of the parameters (TRL's
    ``unwrap_model_for_generation``; under ZeRO-3 the forward passes then run locally)."""
    device = trainer.accelerator.device
    with (
        generation_model(trainer) as unwrapped,
        torch.no_grad(),
    ):
        base = peft_base(unwrapped)
        mrope = hasattr(getattr(base, "model", None), "get_rope_index")
        generated, layouts, deltas, next_slot, cache = _prefill_and_decode(
            trainer, turns, unwrapped, base, mrope, plan.rows, plan.prompt_ids, plan.fields, plan.pixel_rows,
            plan.grid_rows, device,
        )  # fmt: skip
    completions = generated.tolist()
    eos = set(trainer.eos_token_ids)
    result = []
    for tokens in completions:
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        result.append(tokens[:cut])
    turns.remember(cache, list(range(len(result))), layouts, result, next_slot, deltas, plan.row_keys)
    turns.stats.calls += 1
    keep = getattr(trainer, "keep_turn_features", None)
    if keep is not None and plan.grid_rows and turns.encoded is not None:  # for the log-prob passes (vision_reuse)
        flat = [image for row in plan.images or [] for image in row or []]
        keep(turns.encoded, [flat[k] for k in plan.grid_rows], [b - a for a, b in plan.pixel_rows])
    turns.encoded = None
    return result


def _past_block(plans: list, past: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, each row's held keys and values right-aligned in ``past`` slots (the slots before them are masked),
    gathered with one indexing per tensor: everything held comes from one decode (see :meth:`TurnCache.remember`)."""
    held_rows = [(b, held, reused) for b, (held, reused, _, _) in enumerate(plans) if held is not None and reused]
    layers = held_rows[0][1].layers
    device = layers[0][0].device
    rows = torch.zeros(len(plans), past, dtype=torch.long)
    slots = torch.zeros(len(plans), past, dtype=torch.long)
    for b, held, reused in held_rows:
        if held.layers is not layers:
            raise RuntimeError("turn cache: held rollouts from different decodes")
        rows[b, past - reused :] = held.row
        slots[b, past - reused :] = torch.cat([torch.arange(a, e) for a, e in _slots(held.segments, reused)])
    rows, slots = rows.to(device), slots.to(device)
    return [tuple(x[rows, :, slots].transpose(1, 2).contiguous() for x in layer) for layer in layers]


def _prefill_and_decode(
    trainer, turns, unwrapped, base, mrope, plans, prompt_ids, fields, pixel_rows, grid_rows, device
):  # fmt: skip
    """Load the held caches, prefill the rows' new tokens (with their new images) and decode."""
    from transformers import DynamicCache

    pad_id = turns.pad_id
    rows = len(plans)
    past = max(reused for _, reused, _, _ in plans)
    width = max(len(chunk) for _, _, chunk, _ in plans)
    cache = DynamicCache(config=unwrapped.config)
    ids = torch.full((rows, past + width + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, past + width + 1), dtype=torch.long)
    layouts, deltas = [], []
    next_positions = []
    chunk_positions = torch.zeros((3, rows, width) if mrope else (rows, width), dtype=torch.long)
    grids = fields.get("image_grid_thw")
    grid_at = 0
    for b, ((held, reused, chunk, _), row_ids) in enumerate(zip(plans, prompt_ids, strict=True)):
        ids[b, past - reused : past] = torch.tensor(row_ids[:reused], dtype=torch.long)
        mask[b, past - reused : past] = 1
        start = past + width - len(chunk)
        ids[b, start : past + width + 1] = torch.tensor(row_ids[reused:], dtype=torch.long)
        mask[b, start:] = 1
        layouts.append((row_ids, _merge([(past - reused, past), (start, past + width)])))
        offset = reused + (held.delta if held is not None else 0)
        n = len(chunk)
        if mrope and n:
            count = turns.count_images(chunk)
            if count:
                chunk_t = torch.tensor(chunk, dtype=torch.long, device=device)[None]
                types = (chunk_t == turns.image_pad_id).int()
                grid = grids[grid_rows[grid_at : grid_at + count]].to(device)
                grid_at += count
                pos, _ = base.model.get_rope_index(
                    chunk_t, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=torch.ones_like(chunk_t)
                )
                pos = pos[:, 0].cpu() + offset
            else:
                pos = (torch.arange(n) + offset).expand(3, -1)
            chunk_positions[:, b, width - n :] = pos
            following = int(pos.max()) + 1
        elif n:
            chunk_positions[b, width - n :] = torch.arange(n) + offset
            following = offset + n
        else:
            following = offset
        next_positions.append(following)
        deltas.append(following - (len(row_ids) - 1))
        turns.stats.reused_tokens += reused
        turns.stats.prefill_tokens += n

    if past:
        for layer_idx, (keys, values) in enumerate(_past_block(plans, past)):
            cache.update(keys, values, layer_idx)
    ids, mask = ids.to(device), mask.to(device)
    turns.held = []  # read: the decode's cache holds these rows from now on

    inputs: dict[str, Any] = {}
    if pixel_rows:
        pixels = fields["pixel_values"]
        inputs["pixel_values"] = torch.cat([pixels[a:b] for a, b in pixel_rows]).to(device)
        if grids is not None:
            inputs["image_grid_thw"] = grids[grid_rows].to(device)
        turns.stats.images_encoded += len(grid_rows)
    accepted = trainer._forward_parameters()
    chunk_ids = ids[:, past : past + width]
    if "mm_token_type_ids" in accepted and turns.image_pad_id is not None:
        inputs["mm_token_type_ids"] = (chunk_ids == turns.image_pad_id).long()
    if "logits_to_keep" in accepted:
        inputs["logits_to_keep"] = 1
    with autocast_seen(base.get_decoder()) as amp:
        if width:
            out = unwrapped(
                input_ids=chunk_ids,
                attention_mask=mask[:, : past + width],
                position_ids=chunk_positions.to(device),
                use_cache=True,
                **decode.cache_kwarg(unwrapped, cache),
                **inputs,
            )
            turns.encoded = getattr(out, "image_outputs", None) if pixel_rows else None  # the new images' features
            del out
    autocast = amp[0] if amp else None
    positions = torch.tensor(next_positions, dtype=torch.long, device=device)
    if mrope:
        positions = positions.expand(3, -1)
    index = torch.arange(rows, device=device)
    compile_decode = trainer.args.compile_decode
    exported: list = []
    generated = decode.fast_decode(
        unwrapped, cache, index, ids, mask, positions, trainer.generation_config,
        use_graph=device.type == "cuda", compile=device.type == "cuda" if compile_decode is None else compile_decode,
        fuse=trainer.args.fuse_decode_projections, autocast=autocast, keep=trainer.keep_decode_graphs,
        export=exported,
    )  # fmt: skip
    return generated, layouts, deltas, past + width, exported[0]


def remember_shared(
    turns: TurnCache | None,
    exported: list,
    order: list[int],
    index: torch.Tensor,
    prompt_ids: list[list[int]],
    images: list | None,
    completions: list[list[int]],
    prefix: int,
    positions: torch.Tensor | None,
) -> None:
    """Hold what the shared-prefill decode left (row k of its cache answers batch row ``order[k]``, a copy of
    unique prompt ``index[k]``; ``images``: each batch row's; ``positions``: each unique prompt's last rotary
    position), or drop what was held when the decode did not go through ``fast_decode``."""
    if turns is None:
        return
    if not exported or positions is None:
        turns.forget()
        return
    last = (positions[0] if positions.ndim == 2 else positions)[index].tolist()
    layouts, deltas = [], []
    for k, row in enumerate(order):
        prompt = prompt_ids[row]
        layouts.append((prompt, _merge([(prefix + 1 - len(prompt), prefix)])))
        deltas.append(int(last[k]) - (len(prompt) - 1))
    keys = [turns.row_keys(images[r]) if images is not None else () for r in order]
    completions = [completions[r] for r in order]
    turns.remember(exported[0], list(range(len(order))), layouts, completions, prefix, deltas, keys)


def image_pad_id(tokenizer: Any) -> int | None:
    """The token that stands for one vision feature of an image (Qwen's ``<|image_pad|>``, InternVL's
    ``<IMG_CONTEXT>``), or None."""
    vocab = tokenizer.get_vocab()
    return next((vocab[t] for t in _IMAGE_PADS if t in vocab), None)


def paired_turn(
    trainer: Any,
    turns: TurnCache | None,
    vote: Any,
    share: bool,
    prompt_ids: list[list[int]],
    images: list | None,
    fields: dict[str, Any],
) -> list[list[int]] | None:
    """A tool round whose generation the ranks make together (ZeRO-3; see :mod:`vlm_grpo.tools.rounds`): this rank
    plans the held path (``share``: the route allows it), votes (``vote(generating, held)``, an all-reduce) and
    runs it where every rank can. None: some rank cannot, so every rank generates through TRL's path."""
    plan = plan_turns(trainer, turns, prompt_ids, images, fields) if share and turns is not None else None
    _, held = vote(True, plan is not None)
    return run_turns(trainer, turns, plan) if held else None


def join_held_round(trainer: Any) -> None:
    """A rank's part in another rank's held-path round: the same gather of the parameters and, inside it, one forward
    of the whole model (one pad token, output dropped). The held path's prefill is the round's only forward of the
    whole model (its decode steps call the decoder and head), and DeepSpeed's start-of-forward hook, which TRL's
    gather leaves in place, checks the ranks' module traces with broadcasts there: both sides must make it."""
    device = trainer.accelerator.device
    ids = torch.full((1, 1), trainer._tokenizer.pad_token_id, dtype=torch.long, device=device)
    with generation_model(trainer) as unwrapped, torch.no_grad():
        unwrapped(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
