"""Compute a GRPO group once: one forward over ``[prompt | c1 | ... | cG]`` per group.

GRPO repeats each prompt (and its images) G times. The naive log-prob pass runs the vision tower
and the whole prompt G times; here every group of rows that share a prompt and its pixels becomes
one packed sequence, so images are encoded once and the prompt is attended once.

Layout of one packed group (P = valid prompt length, L_g = completion g's length)::

    prompt[:-1] | prompt[-1] c_1[0..L_1-1] | prompt[-1] c_2[0..L_2-1] | ... | prompt[-1] c_G[0..L_G-1]

The last prompt token is repeated at the head of each block: it sits at the same position with the
same context, so its hidden state is the one the naive pass has, and it can carry the label
``c_g[0]`` of its block (one position has one label). A block attends to the shared prefix and
causally to itself, never to another block. Each block is as long as its own completion (through its last
token that the loss sees, or that holds an image), not the batch's longest: with real rollouts (lengths a
few hundred tokens, a tail to the maximum) most of TRL's ``(rows, C)`` layout is padding, which the packed
pass never runs. Where the varlen attention kernel runs, the groups of a pass go end to end in one packed
row; elsewhere each group is one row, right-padded to the longest. Positions are explicit (mrope for Qwen
families), as the model cannot infer them from a packed layout. Log-probs come from TRL's fused LM head via
``shift_labels`` and are scattered back to the ``(rows, C)`` layout TRL expects, zero past a row's block
(as TRL's pass has them where the mask is 0), so old, reference and policy log-probs all go through the
same path.

Multi-turn tool rollouts fit the same layout: a completion ``c_g`` is the rollout's whole tail (its turns, the
tool observations between them, their images), so each block holds one rollout's history after the shared
prompt. The vision tower sees the group's prompt images once and each rollout's tool images once, in the order
their placeholder tokens appear in the pack; a block's positions continue the prompt's as the rollout's own
sequence has them (mrope for tool images included).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlm_grpo.fastpath import decode
from vlm_grpo.fastpath.block_attention import LAYOUT_KWARG, packing, shares_rows, use_block_attention, varlen_layout
from vlm_grpo.fastpath.compiled_layers import compiled_layers
from vlm_grpo.fastpath.decode_autocast import autocast_seen
from vlm_grpo.fastpath.pack_plan import BLOCK_MULTIPLE, PackedPass, block_lengths, build_mask, chunk_groups, plan_pack
from vlm_grpo.fastpath.turn_cache import remember_shared
from vlm_grpo.utils import generation_model, is_zero3, peft_base, warn_once

logger = logging.getLogger(__name__)


@dataclass
class Group:
    rows: list[int]  # batch rows of the group, in order
    prompt: torch.Tensor  # valid prompt ids (P,)
    pad_offset: int  # left padding of the leader's prompt in the batch layout
    image_rows: tuple[int, int] | None  # leader's slice of pixel_values (rows or tiles)
    image_range: tuple[int, int] | None  # leader's slice of per-image tensors (image_grid_thw)
    # Per row of ``rows``: its slices of the images in its completion (tool images), or None.
    tool_rows: list[tuple[int, int] | None] = field(default_factory=list)
    tool_ranges: list[tuple[int, int] | None] = field(default_factory=list)


Span = tuple[int, int] | None


def _image_slices(
    num_images: list[int] | None,
    units_per_sample: list[int] | None,
    n_rows: int,
    prompt_images: list[int] | None = None,
    units_per_image: list[int] | None = None,
) -> tuple[list[Span], list[Span], list[Span], list[Span]]:
    """Per row: (start, end) of its prompt images' pixel units and of those images, then the same for the images
    after its prompt (``prompt_images``: how many of a row's images its prompt holds; None: all of them)."""
    none: list[Span] = [None] * n_rows
    if not num_images or units_per_sample is None:
        return none, none, none, none
    if prompt_images is None or prompt_images == list(num_images):
        prompt_images, units_per_image = list(num_images), None
    units, images, tool_units, tool_images = [], [], [], []
    unit_start, image_start = 0, 0
    for row, (count, n_units) in enumerate(zip(num_images, units_per_sample, strict=True)):
        first = prompt_images[row]
        head = n_units if units_per_image is None else sum(units_per_image[image_start : image_start + first])
        units.append((unit_start, unit_start + head) if first else None)
        images.append((image_start, image_start + first) if first else None)
        tool_units.append((unit_start + head, unit_start + n_units) if count > first else None)
        tool_images.append((image_start + first, image_start + count) if count > first else None)
        unit_start += n_units
        image_start += count
    return units, images, tool_units, tool_images


def plan_groups(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    pixel_values: torch.Tensor | None,
    num_images: list[int] | None,
    units_per_sample: list[int] | None,
    prompt_images: list[int] | None = None,
    units_per_image: list[int] | None = None,
) -> list[Group]:
    """Rows that share prompt tokens and pixels form one group (whatever their order in the batch).

    ``prompt_images`` (with ``units_per_image``): how many of each row's images are its prompt's; the others are
    its completion's (tool images), which each row keeps for itself (None: every image is the prompt's).
    """
    unit_slices, image_slices, tool_units, tool_images = _image_slices(
        num_images, units_per_sample, prompt_ids.size(0), prompt_images, units_per_image
    )
    groups: list[Group] = []
    by_key: dict[tuple, list[Group]] = {}
    for row in range(prompt_ids.size(0)):
        valid = prompt_mask[row].bool()
        ids = prompt_ids[row][valid]
        key = tuple(ids.tolist())
        pixels = None
        if unit_slices[row] is not None and pixel_values is not None:
            pixels = pixel_values[unit_slices[row][0] : unit_slices[row][1]]
        match = None
        for group in by_key.get(key, []):
            lead = group.image_rows
            lead_pixels = None if lead is None or pixel_values is None else pixel_values[lead[0] : lead[1]]
            if (pixels is None) == (lead_pixels is None) and (pixels is None or torch.equal(pixels, lead_pixels)):
                match = group
                break
        if match is None:
            match = Group([], ids, int((~valid).sum()), unit_slices[row], image_slices[row])
            by_key.setdefault(key, []).append(match)
            groups.append(match)
        match.rows.append(row)
        match.tool_rows.append(tool_units[row])
        match.tool_ranges.append(tool_images[row])
    return groups


def packed_pass_reason(model: Any, extra: set[str], compute_aux_loss: bool) -> str | None:
    """Why this log-prob pass goes through TRL's per-row pass instead of the packed one (None: packed).

    Logged once per reason (at info). ``extra``: multimodal inputs the packed layout does not build (Gemma 3's
    ``token_type_ids``, Pixtral's ``image_sizes``, ...). ``compute_aux_loss``: a MoE model's router loss, which TRL
    averages over its per-row pass (packed, a prompt's tokens would count once instead of G times).
    """
    if compute_aux_loss:
        reason = "the MoE router's auxiliary loss (router_aux_loss_coef) is computed on TRL's per-row pass"
    elif extra:
        reason = f"model inputs the packed pass does not build ({', '.join(sorted(extra))})"
    elif decode.has_local_layers(model):
        reason = "sliding-window or hybrid attention layers (the packed blocks' mask is global)"
    else:
        return None
    warn_once(logger, f"share_prompt steps aside: {reason}; log-probs through TRL's per-row pass", logging.INFO)
    return reason


def packed_logps(
    trainer: Any,
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    compute_entropy: bool,
    mm: dict[str, Any],
    batch_size: int | None = None,
    usable: bool = True,
    replay: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per-token log-probs (and entropies) of the completions, one packed forward per chunk of groups.

    ``batch_size`` bounds the rows a forward covers (whole groups; None: one forward, as the training pass
    needs), or with ``packed_chunk_tokens`` set, the packed tokens it holds. Returns None when no two rows share a
    prompt and the varlen kernel does not run (nothing to gain: with it, no row is padded to the longest), or when
    ``usable`` is False (inputs the packed pass does not know), on any rank: all ranks take the same path (see
    ``all_ranks_agree``), and the caller falls back to TRL. ``replay``: the rows' image features kept from
    generation (:class:`~vlm_grpo.fastpath.vision_reuse.FeatureReplay`; None: the pass encodes its images).
    """
    C = logits_to_keep
    prompt_ids, prompt_mask = input_ids[:, :-C], attention_mask[:, :-C]
    module = trainer.vlm_module
    groups = None
    inner = peft_base(trainer.accelerator.unwrap_model(model))
    if usable:
        split = completion_images(module, inner, input_ids, C, mm)
        if isinstance(split, str):
            warn_once(logger, f"share_prompt: batches where {split} go through TRL's per-row pass", logging.INFO)
        else:
            units = module.units_per_sample(mm)
            pixels, num_images = mm.get("pixel_values"), mm.get("num_images")
            groups = plan_groups(prompt_ids, prompt_mask, pixels, num_images, units, *split)
    # Rows that share nothing still gain where groups share packed rows: no row is padded to the longest.
    padding_free = use_block_attention(inner, trainer.args.packed_attention) and shares_rows(input_ids.device)
    if not all_ranks_agree(trainer, groups is not None and (padding_free or len(groups) < input_ids.size(0))):
        return None
    trainer.last_packed_pass = PackedPass(rows=input_ids.size(0), width=C)
    image_token = getattr(inner.config, "image_token_id", None)
    lengths = block_lengths(input_ids[:, -C:], attention_mask[:, -C:], image_token, BLOCK_MULTIPLE)
    max_tokens = trainer.args.packed_chunk_tokens if batch_size else None
    chunks = chunk_groups(groups, lengths, batch_size, max_tokens)
    parts = [
        _packed_forward(trainer, model, input_ids, attention_mask, C, chunk, mm, lengths, replay) for chunk in chunks
    ]
    rows = torch.tensor([r for chunk in chunks for g in chunk for r in g.rows], device=input_ids.device)
    order = torch.argsort(rows)
    logps = torch.cat([p[0] for p in parts])[order]
    entropies = torch.cat([p[1] for p in parts])[order] if compute_entropy else None
    return logps, entropies


def completion_images(
    module: Any, model: Any, input_ids: torch.Tensor, C: int, mm: dict[str, Any]
) -> tuple[list[int] | None, list[int] | None] | str:
    """(images each row's prompt holds, pixel units per image) when completions hold images (tool images), else
    ``(None, None)``; a reason when the rows' images cannot be told apart.

    Every image is one run of placeholder tokens (the chat template wraps each one), in the order of the row's
    images (TRL appends a rollout's tool images to its prompt images): the runs before the completion are the
    prompt's. The adapter turns a run's length into the image's pixel units (:meth:`image_units`); each row's
    units must add up to what it owns in ``pixel_values``.
    """
    num_images = mm.get("num_images")
    token = getattr(model.config, "image_token_id", None)
    if mm.get("pixel_values") is None or not num_images or token is None:
        return None, None
    placeholders = (input_ids == token).cpu()  # one copy to the host, rather than a sync per row below
    if not placeholders[:, -C:].any():
        return None, None
    per_sample = module.units_per_sample(mm)
    counts, units = [], []
    for row, n in enumerate(num_images):
        where = placeholders[row].nonzero()[:, 0]
        cuts = (where.diff() != 1).nonzero()[:, 0] + 1
        runs = [(int(r[0]), r.numel()) for r in where.tensor_split(cuts.tolist())] if where.numel() else []
        own = [module.image_units(model, length) for _, length in runs]
        if len(runs) != n or None in own or per_sample is None or sum(own) != per_sample[row]:
            return f"a row's image placeholders do not match its images ({type(module).__name__})"
        counts.append(sum(1 for first, _ in runs if first < input_ids.size(1) - C))
        units += own
    return counts, units


def _packed_forward(
    trainer: Any,
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    C: int,
    groups: list[Group],
    mm: dict[str, Any],
    lengths: list[int],
    replay: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over the packed groups (``lengths``: each batch row's block length); returns (log-probs,
    entropies) of their rows, in group order."""
    module = trainer.vlm_module
    inner = peft_base(trainer.accelerator.unwrap_model(model))
    completion_ids, completion_mask = input_ids[:, -C:], attention_mask[:, -C:]
    device = input_ids.device
    blocked = use_block_attention(inner, trainer.args.packed_attention)
    pack = plan_pack(groups, lengths, blocked and shares_rows(device))
    n, total = len(pack.members), pack.total
    record = trainer.last_packed_pass
    record.tokens += pack.layout.tokens
    record.slots += n * total
    record.forwards += 1

    # A row's block: the prompt's last token at its start, then its first ``block - 1`` completion tokens, each
    # the label of the position before it.
    def long(x: Any) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.long, device=device)

    counts = pack.blocks - 1
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    dest, column = long(np.repeat(pack.starts, counts) + within), long(within)
    src_row = long(np.repeat(pack.order, counts))
    tokens = completion_ids[src_row, column]
    flat = torch.full((n * total,), trainer._tokenizer.pad_token_id, dtype=input_ids.dtype, device=device)
    flat[long(pack.prefix_at)] = torch.cat([groups[i].prompt[:-1] for m in pack.members for i in m])
    flat[long(pack.starts)] = input_ids[long(pack.order), -C - 1]
    flat[dest + 1] = tokens
    labels = torch.full((n * total,), -100, dtype=input_ids.dtype, device=device)
    labels[dest] = tokens.masked_fill(completion_mask[src_row, column] == 0, -100)

    def block_tokens(group: Group) -> list[torch.Tensor]:
        return [completion_ids[r, : lengths[r] - 1] for r in group.rows]

    positions = []
    for m in pack.members:
        used = torch.cat([module.packed_position_ids(inner, groups[i], mm, block_tokens(groups[i])) for i in m], -1)
        positions.append(torch.nn.functional.pad(used, (0, total - used.size(-1))))
    inputs: dict[str, Any] = {
        "input_ids": flat.view(n, total),
        "position_ids": torch.cat(positions, dim=-2),
        **module.group_vision_inputs(groups, mm),
    }
    if replay is not None:
        inputs = replay.packed(groups, inputs)
    if blocked:
        inputs[LAYOUT_KWARG] = varlen_layout(pack.layout, total, device)
        mask_scope = packing()
    else:
        attn = inner.config.get_text_config(decoder=True)._attn_implementation
        dtype = None if attn == "sdpa" else torch.float32  # eager adds the mask to the scores
        inputs["attention_mask"] = torch.cat([build_mask(row, total, dtype, device) for row in pack.layout.rows])
        mask_scope = contextlib.nullcontext()
    with (
        trainer.accelerator.autocast(),
        mask_scope,
        compiled_layers(inner, trainer.compile_layers, module),
    ):
        outputs = model(**inputs, shift_labels=labels.view(n, total), fused_lm_head=True)
    # TRL's (rows, C) layout: column j of a row is its block's position j; past its block's labels, a zero (the
    # extra last slot), as TRL's pass has it where the mask is 0.
    columns = torch.arange(C, device=device)
    index = long(pack.starts)[:, None] + columns
    index = torch.where(columns < long(counts)[:, None], index, n * total)

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return torch.cat([values.reshape(-1), values.new_zeros(1)])[index]

    return scatter(outputs.log_probs), (None if outputs.entropy is None else scatter(outputs.entropy))


# --------------------------------------------------------------------------- generation


def _left_pad(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.as_tensor(r, device=device)
            mask[i, width - len(r) :] = 1
    return ids, mask


def _plan_shared_prefill(
    module: Any, ids: torch.Tensor, mask: torch.Tensor, fields: dict, per_token: dict, images: list | None
) -> tuple[list[Group], dict[str, Any]] | None:
    """The groups to prefill once each and their multimodal inputs, or None for inputs this path does not know."""
    known = {"pixel_values", "image_grid_thw", *module.grouped_vision_inputs}
    unknown = (set(fields) - known) | (set(per_token) - {"mm_token_type_ids"})
    if unknown:
        message = f"share_prefill/fast_decode step aside for inputs they do not build ({', '.join(sorted(unknown))})"
        warn_once(logger, message + ": generation goes through TRL's generate", logging.INFO)
        return None
    mm: dict[str, Any] = dict(fields)
    if images is not None:
        mm["num_images"] = [len(x) if x else 0 for x in images]
    units = module.units_per_sample(mm) if "pixel_values" in mm else None
    if "pixel_values" in mm and (units is None or sum(units) != mm["pixel_values"].size(0)):
        # e.g. InternVL tiles whose per-sample count is not known here, Idefics3's tool images laid out as one sample
        message = "share_prefill steps aside for pixel rows it cannot assign to the prompts"
        warn_once(logger, message + ": generation goes through TRL's generate", logging.INFO)
        return None
    return plan_groups(ids, mask, mm.get("pixel_values"), mm.get("num_images"), units), mm


def all_ranks_agree(trainer: Any, use_shared: bool) -> bool:
    """Whether every rank takes the shared path (multi-process runs decide together).

    Under ZeRO-3 (and FSDP) every top-level forward is a collective point (DeepSpeed's start-of-forward
    hook, ``generate``'s ``synced_gpus`` steps) and every module's parameters are gathered as it runs.
    The shared prefill runs one forward more than TRL's generation, and the packed log-prob pass calls
    the LM head differently and chunks rows differently. A rank whose batch cannot share (e.g. InternVL
    multi-tile images) while another's can (e.g. text only) would leave the ranks' collectives apart:
    all share or none does.
    """
    accelerator = trainer.accelerator
    if accelerator.num_processes <= 1:
        return use_shared
    flag = torch.tensor([1 if use_shared else 0], device=accelerator.device)
    return bool(accelerator.gather(flag).min().item())


def shared_prefill_generate(
    trainer: Any,
    prompt_ids: list[list[int]],
    images: list | None,
    multimodal_fields: dict[str, Any],
    own_history: bool = False,
) -> list[list[int]] | None:
    """Generate G completions per prompt with its prefill (and images) computed once.

    Each unique prompt (tokens and pixels) is prefilled once, up to its last token; the KV cache
    (and Qwen's mrope deltas) are then repeated for its G rows, and ``generate`` continues from the
    last prompt token. Greedy outputs equal the plain per-row path (tested). Returns the
    completion ids (cut after the first EOS) in the rows' order, or None to let TRL generate
    (nothing shared, or inputs this path does not know).

    ``own_history``: the rows are tool-loop turns, each continuing its own conversation. Nothing is
    shared, but ``fast_decode`` still beats ``generate``: these rows take this path when it is on. The
    decision is this rank's alone (ranks may be in different turns; see :mod:`vlm_grpo.fastpath.route`).
    """

    module = trainer.vlm_module
    device = trainer.accelerator.device
    pad_id = trainer._tokenizer.pad_token_id
    # Groups are found where the fields are (the host, from TRL's processor): only the leaders' pixels then go
    # to the device, not a group's G equal copies (896 px, 16 rows: 45 ms of copies against 5 ms).
    ids, mask = _left_pad(prompt_ids, pad_id, "cpu")
    fields = {k: v for k, v in multimodal_fields.items() if isinstance(v, torch.Tensor)}
    per_token = {k: v for k, v in multimodal_fields.items() if isinstance(v, list)}
    for key in (
        "pixel_values",
        *module.grouped_vision_inputs,
    ):  # e.g. InternVL's pixels: TRL stacks such lists for generate
        if isinstance(multimodal_fields.get(key), list):
            fields[key] = torch.tensor(np.array(per_token.pop(key)))
    plan = _plan_shared_prefill(module, ids, mask, fields, per_token, images)
    if own_history:
        if plan is None or not trainer.args.fast_decode:
            return None
    elif not all_ranks_agree(trainer, plan is not None and len(plan[0]) < len(prompt_ids)):
        return None
    groups, mm = plan

    leaders = [g.rows[0] for g in groups]
    lead_ids, lead_mask = _left_pad([prompt_ids[r] for r in leaders], pad_id, device)
    inputs: dict[str, Any] = {k: v.to(device) for k, v in module.group_vision_inputs(groups, mm).items()}
    if "mm_token_type_ids" in per_token:
        inputs["mm_token_type_ids"] = _left_pad([per_token["mm_token_type_ids"][r] for r in leaders], 0, device)[0]
    # Row k of the expanded batch is a copy of group index[k]; order[k] is the batch row it answers.
    index = torch.tensor([i for i, g in enumerate(groups) for _ in g.rows], device=device)
    order = [r for g in groups for r in g.rows]

    with (
        generation_model(trainer) as unwrapped,
        torch.no_grad(),
    ):
        from transformers import DynamicCache

        cache = DynamicCache(config=unwrapped.config)
        base = peft_base(unwrapped)
        backbone = getattr(base, "model", base)
        prefill = {k: (v[:, :-1] if k == "mm_token_type_ids" else v) for k, v in inputs.items()}
        prefill["attention_mask"] = lead_mask[:, :-1]
        # The positions generate itself would use (mask-aware; mrope for Qwen, which also sets rope_deltas).
        positions = _generation_positions(base, lead_ids[:, :-1], prefill)
        if positions is not None:
            prefill["position_ids"] = positions
        with autocast_seen(base.get_decoder()) as amp:
            out = unwrapped(
                input_ids=lead_ids[:, :-1], **decode.cache_kwarg(unwrapped, cache), use_cache=True, **prefill
            )
        encoded = getattr(out, "image_outputs", None)  # the log-prob passes reuse them (fastpath.vision_reuse)
        if own_history and images is not None and hasattr(trainer, "keep_history_features"):
            trainer.keep_history_features(encoded, groups, mm, images)
        elif not own_history and hasattr(trainer, "keep_prefill_features"):
            trainer.keep_prefill_features(encoded, groups, mm, len(prompt_ids))
        del out, encoded
        decode_positions = _next_positions(positions, getattr(backbone, "rope_deltas", None))
        reason = _fast_decode_blocker(trainer, unwrapped, decode_positions)
        exported: list = []  # the decode's cache, held for the rollouts' next turns (turn_cache)
        if reason is None:
            compile_decode = trainer.args.compile_decode
            generated = decode.fast_decode(
                unwrapped, cache, index, lead_ids[index], lead_mask[index], decode_positions,
                trainer.generation_config, use_graph=device.type == "cuda",
                compile=device.type == "cuda" if compile_decode is None else compile_decode,
                fuse=trainer.args.fuse_decode_projections, autocast=amp[0],
                keep=trainer.keep_decode_graphs,
                export=exported if trainer._turn_cache is not None else None,  # (a narrowed cache is put back in order)
            )  # fmt: skip
        else:
            if trainer.args.fast_decode:
                warn_once(logger, f"fast_decode is off for this run: {reason}; decoding with generate")
            cache.batch_select_indices(index)
            if getattr(backbone, "rope_deltas", None) is not None:
                backbone.rope_deltas = backbone.rope_deltas[index]
            extra = {"mm_token_type_ids": inputs["mm_token_type_ids"][index]} if "mm_token_type_ids" in inputs else {}
            out = unwrapped.generate(
                input_ids=lead_ids[index],
                attention_mask=lead_mask[index],
                generation_config=trainer.generation_config,
                **decode.cache_kwarg(unwrapped, cache),
                **extra,
            )
            generated = out[:, lead_ids.size(1) :]
    completions = generated.tolist()
    eos = set(trainer.eos_token_ids)
    result: list[list[int]] = [[] for _ in prompt_ids]
    for row, tokens in zip(order, completions, strict=True):
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        result[row] = tokens[:cut]
    prefix = lead_ids.size(1) - 1
    remember_shared(trainer._turn_cache, exported, order, index, prompt_ids, images, result, prefix, decode_positions)
    return result


def _generation_positions(base: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """Prefill positions exactly as ``generate`` computes them (mask-aware; Qwen: text + 3-D mrope rows)."""
    prepare = getattr(base, "_prepare_position_ids_for_generation", None)
    if prepare is None:
        return None
    return prepare(input_ids, {**kwargs, "input_ids": input_ids})


def _next_positions(positions: torch.Tensor | None, rope_deltas: torch.Tensor | None) -> torch.Tensor | None:
    """Rotary position of each prompt's last token: ``(U,)``, or ``(3, U)`` for mrope (text position + delta)."""
    if positions is None:
        return None
    if positions.ndim == 2:
        return positions[:, -1] + 1
    if positions.size(0) != 4 or rope_deltas is None:
        return None
    return (positions[0, :, -1] + 1 + rope_deltas.reshape(-1)).expand(3, -1)


def _fast_decode_blocker(trainer: Any, model: Any, positions: torch.Tensor | None) -> str | None:
    if not trainer.args.fast_decode:
        return "turned off"
    if positions is None:
        return "this model's generation positions are not known"
    if is_zero3(trainer.accelerator) and not trainer.args.ds3_gather_for_generation:
        return "ZeRO-3 without ds3_gather_for_generation (parameters stay partitioned during generation)"
    return decode.unsupported_reason(model)
