"""Where the packed log-prob pass puts each token (:mod:`vlm_grpo.fastpath.sharing`), on the host.

A group's block for row r holds the prompt's last token and r's completion through its last token the loss sees or
that is an image placeholder: its own length, not the batch's longest (:func:`block_lengths`). :func:`plan_pack` lays
a forward's groups out (one packed row each, or end to end in one row where the varlen kernel runs), and
:func:`chunk_groups` cuts a pass into forwards: by rows as TRL's ``batch_size`` means, or by packed tokens
(``packed_chunk_tokens``). :func:`build_mask` is the dense mask of one packed row (eager, ``packed_attention=dense``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlm_grpo.fastpath.block_attention import PackedGroup, PackedLayout


def build_mask(row: tuple[PackedGroup, ...], total: int, dtype: torch.dtype | None, device) -> torch.Tensor:
    """(1, 1, total, total) mask of one packed row: each group's prefix causal; each block sees its group's prefix
    and itself causally; padding sees itself.

    Boolean (True = attend) for sdpa; additive (0 / min) when ``dtype`` is given (eager attention).
    """
    group_id, block_id = np.full(total, -1), np.full(total, -2)  # block -1: a prefix token; -2: padding
    end = 0
    for i, group in enumerate(row):
        group_id[end : end + group.length] = i
        block_id[end : end + group.prefix] = -1
        block_id[end + group.prefix : end + group.length] = np.repeat(np.arange(len(group.blocks)), group.blocks)
        end += group.length
    group_of, block_of = (torch.from_numpy(x).to(device) for x in (group_id, block_id))
    idx = torch.arange(total, device=device)
    q, k = idx[:, None], idx[None, :]
    same_block = block_of[:, None] == block_of[None, :]
    sees_prefix = block_of[None, :] == -1
    mask = (k <= q) & (group_of[:, None] == group_of[None, :]) & (same_block | sees_prefix) & (block_of[None, :] > -2)
    mask |= torch.eye(total, dtype=torch.bool, device=device)  # a fully masked row would give NaN
    mask = mask[None, None]
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)


def block_lengths(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, image_token: int | None, multiple: int = 1
) -> list[int]:
    """Per row, its block's length: the prompt's last token and the completion through its last token that the
    loss sees (``completion_mask``) or that is an image placeholder (a tool image's features need all of its
    placeholders), rounded up to ``multiple`` and at most ``C + 1``. A row with no such token keeps one token."""
    needed = completion_mask.bool()
    if image_token is not None:
        needed = needed | (completion_ids == image_token)
    width = needed.size(1)
    through = torch.where(needed.any(1), width - needed.flip(1).int().argmax(1), 0)
    lengths = (through + multiple) // multiple * multiple  # through + 1, rounded up
    return lengths.clamp(max=width + 1).tolist()


#: Blocks are rounded up to a multiple of this many tokens. 1 (none): the packed row's length changes from pass to
#: pass anyway (prompts and rollouts differ), and compiled layers take it as a dynamic dimension after its first
#: change, so rounding would buy no repeated shapes; at 16 it would cost ~7.5 tokens per rollout.
BLOCK_MULTIPLE = 1


@dataclass
class PackedPass:
    """What one packed log-prob pass ran: ``tokens`` (every prefix and block), ``slots`` (packed rows x their
    length: tokens + right padding), ``forwards``; ``rows`` and ``width`` of TRL's ``(rows, C)`` layout."""

    tokens: int = 0
    slots: int = 0
    forwards: int = 0
    rows: int = 0
    width: int = 0


@dataclass
class Pack:
    """Where a forward's groups go in the flattened ``(rows * total)`` pack (host arrays)."""

    layout: PackedLayout
    total: int
    members: list[list[int]]  # per packed row, the indices of the groups it holds, end to end
    order: np.ndarray  # the batch rows, in pack order
    starts: np.ndarray  # per row of ``order``: where its block starts
    blocks: np.ndarray  # per row of ``order``: its block's length
    prefix_at: np.ndarray  # where the groups' prefix tokens go, group after group


def plan_pack(groups: list[Any], lengths: list[int], shared_rows: bool) -> Pack:
    """Groups (:class:`~vlm_grpo.fastpath.sharing.Group`) end to end in one packed row (``shared_rows``), else one
    row each, right-padded to the longest; ``lengths``: each batch row's block length."""
    layout_groups = [PackedGroup(g.prompt.numel() - 1, tuple(lengths[r] for r in g.rows)) for g in groups]
    members = [list(range(len(groups)))] if shared_rows else [[i] for i in range(len(groups))]
    layout = PackedLayout(tuple(tuple(layout_groups[i] for i in m) for m in members))
    total = max(sum(g.length for g in row) for row in layout.rows)
    starts, prefix_at = [], []
    for row, m in enumerate(members):
        end = row * total
        for i in m:
            prefix_at.append(np.arange(end, end + layout_groups[i].prefix))
            end += layout_groups[i].prefix
            for block in layout_groups[i].blocks:
                starts.append(end)
                end += block
    order = np.array([r for m in members for i in m for r in groups[i].rows])
    return Pack(layout, total, members, order, np.array(starts), np.array(lengths)[order], np.concatenate(prefix_at))


def chunk_groups(
    groups: list[Any], lengths: list[int], batch_size: int | None, max_tokens: int | None
) -> list[list[Any]]:
    """Whole groups per forward, in order: up to ``batch_size`` rows (TRL's meaning), or, with ``max_tokens``, up to
    that many packed tokens (a group's prefix and blocks) instead. A group over the bound gets a forward of its own;
    no bound (the training pass): one forward."""
    chunks: list[list[Any]] = [[]]
    used = 0
    for group in groups:
        cost = group.prompt.numel() - 1 + sum(lengths[r] for r in group.rows) if max_tokens else len(group.rows)
        bound = max_tokens or batch_size
        if chunks[-1] and bound and used + cost > bound:
            chunks.append([])
            used = 0
        chunks[-1].append(group)
        used += cost
    return chunks
