"""Attention over packed GRPO groups without a dense (tokens x tokens) mask.

The packed layout of :mod:`vlm_grpo.fastpath.sharing` is, per packed row, one or more groups end to end, each
``prefix | block_1 | ... | block_G``, then right padding. Every block is its own rollout's length (+1: the prompt's
last token), so blocks differ in length. A dense boolean mask over a row costs (row length)² and keeps sdpa off its
flash kernels; most of its entries are "block g does not see block h". Here the same attention is two kernel calls
per group:

* the prefix attends to itself causally (``is_causal``: flash on GPU);
* the G blocks, batched, each attend to ``[prefix K/V, own K/V]`` causally, aligned to the end of the keys: with a
  lower-right causal bias where the blocks are equally long (``torch.nn.attention.bias.causal_lower_right``: flash /
  memory-efficient on GPU, no mask tensor), else padded to the longest block with a (G, longest, prefix + longest)
  boolean mask (memory-efficient on GPU).

On a GPU with flash attention (fp16 / bf16, dropout off) the whole packed batch is instead **one** variable-length
flash call (:class:`VarlenLayout`): every group's prefix, each of its blocks and each row's right padding is one
sequence of queries, and each block's keys are ``[prefix K/V, own K/V]`` gathered by index, with flash's causal mask
aligned to the end of the keys (the same lower-right alignment). Its inputs are device tensors, and the longest
sequences are the lengths of two empty tensors, so a compiled decoder layer (``compile_layers``) traces the call
whole: no graph break, no recompilation for a new layout, and its backward is flash's own. Several groups then share
one packed row (:func:`shares_rows`): no padding at all. The per-group calls above stay for everything else (CPU,
fp32, dropout), as a compiler-disabled island.

It is registered with transformers' ``AttentionInterface`` as :data:`NAME` and behaves exactly like
``sdpa`` unless the forward carries a :class:`PackedLayout` or :class:`VarlenLayout` in the ``vlm_grpo_layout``
keyword, which transformers hands through to every attention call (and which gradient checkpointing captures, so
the recomputed layers see it too). The sdpa path with the dense mask stays the reference
(``packed_attention="dense"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_grpo.fastpath.varlen import autocast_inputs, kernel_fits, varlen_kernel
from vlm_grpo.utils import model_base, warn_once

logger = logging.getLogger(__name__)

NAME = "vlm_grpo_sdpa"
LAYOUT_KWARG = "vlm_grpo_layout"

VARLEN = True  # benchmarks flip it (variant switch ``varlen_blocks=false``): the per-row calls even on GPUs

_packing: contextvars.ContextVar[bool] = contextvars.ContextVar("vlm_grpo_packing", default=False)


@dataclass(frozen=True)
class PackedGroup:
    """One group in a packed row: the shared prefix's length, then each block's length (blocks differ)."""

    prefix: int
    blocks: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.prefix + sum(self.blocks)


@dataclass(frozen=True)
class PackedLayout:
    """Per packed row, its groups end to end (then right padding up to the batch's row length)."""

    rows: tuple[tuple[PackedGroup, ...], ...]

    @classmethod
    def uniform(cls, prefixes: tuple[int, ...], blocks: tuple[int, ...], block_len: int) -> PackedLayout:
        """One group per row, ``blocks[i]`` blocks of ``block_len`` tokens each after a prefix of ``prefixes[i]``."""
        return cls(tuple((PackedGroup(p, (block_len,) * n),) for p, n in zip(prefixes, blocks, strict=True)))

    @property
    def tokens(self) -> int:
        """Tokens the layout holds (every prefix and block; no padding)."""
        return sum(g.length for row in self.rows for g in row)


def block_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``sdpa`` unless a :class:`PackedLayout` comes with the call; then prefix and blocks as described above."""
    layout: PackedLayout | VarlenLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if isinstance(layout, VarlenLayout):
        if dropout == 0.0 and layout.fits(query, value):
            return _varlen_sdpa(query, key, value, layout, scaling), None
        layout = layout.packed
    return _packed_sdpa(query, key, value, layout, dropout, scaling), None


@torch.compiler.disable
def _packed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: PackedLayout,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """The packed groups, one by one. Outside compilation (``compile_layers``): the loop over the layout's
    Python ints would otherwise recompile a compiled decoder layer for every new layout."""
    query, key, value = autocast_inputs(query, key, value)
    gqa = query.size(1) != key.size(1)
    total = query.size(2)
    rows = []
    for q, k, v, groups in zip(query, key, value, layout.rows, strict=True):
        # q, k, v: (heads, total, dim) of one packed row. Every sdpa call gets 4-D inputs: on GPU the flash,
        # memory-efficient and cuDNN kernels take nothing else, and 3-D inputs fall back to the math kernel.
        parts, end = [], 0
        for group in groups:
            span = slice(end, end + group.length)
            parts += _group_sdpa(q[:, span], k[:, span], v[:, span], group, dropout, scaling, gqa)
            end += group.length
        if end < total:  # right padding of shorter rows: nothing reads it
            parts.append(query.new_zeros(total - end, query.size(1), value.size(-1)))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _group_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PackedGroup, dropout: float, scaling: float | None,
    gqa: bool,
) -> list[torch.Tensor]:  # fmt: skip
    """One group's attention, (tokens, heads, dim) pieces in token order: the prefix's, then the blocks'."""
    prefix, lengths = group.prefix, group.blocks
    parts = []
    if prefix:
        out = F.scaled_dot_product_attention(
            q[None, :, :prefix], k[None, :, :prefix], v[None, :, :prefix], dropout_p=dropout, is_causal=True,
            scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        parts.append(out[0].transpose(0, 1))  # (prefix, heads, dim)
    n, longest = len(lengths), max(lengths)
    if all(length == longest for length in lengths):
        index, mask = None, causal_lower_right(longest, prefix + longest)
        qb, kb, vb = (x[:, prefix:].unflatten(1, (n, longest)).transpose(0, 1) for x in (q, k, v))
    else:  # padded to the longest block; a padded key is seen by nobody, a padded query's output read by nobody
        starts = np.cumsum([prefix, *lengths[:-1]])
        at = np.arange(longest)
        own = np.minimum(at[None, :], np.array(lengths)[:, None] - 1)  # a padded slot repeats the block's last token
        index = torch.from_numpy(starts[:, None] + own).to(q.device)
        qb, kb, vb = (x[:, index].transpose(0, 1) for x in (q, k, v))  # (n, heads, longest, dim)
        keys = torch.from_numpy((at[None, None, :] <= at[None, :, None]) & (at < np.array(lengths)[:, None, None]))
        mask = torch.cat([torch.ones(n, longest, prefix, dtype=torch.bool), keys], dim=-1)[:, None].to(q.device)
    if prefix:
        kb = torch.cat([k[:, :prefix].expand(n, -1, -1, -1), kb], dim=2)
        vb = torch.cat([v[:, :prefix].expand(n, -1, -1, -1), vb], dim=2)
    out = F.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    ).transpose(1, 2)  # (n, longest, heads, dim)
    if index is None:
        parts.append(out.flatten(0, 1))
    else:
        valid = torch.from_numpy(np.arange(longest)[None, :] < np.array(lengths)[:, None]).to(q.device)
        parts.append(out[valid])  # block by block, each its own length
    return parts


class VarlenLayout:
    """A :class:`PackedLayout` as one variable-length attention call over the ``(rows * total)`` packed tokens.

    Sequences, in token order: per row each group's prefix and blocks, then the row's right padding (which attends
    to itself; nothing reads it). ``cu_q`` / ``cu_k`` are their cumulative query / key lengths, ``kv_index`` gathers
    each sequence's keys (a block's: its group's prefix, then the block). ``max_q`` / ``max_k`` are empty tensors
    whose lengths are the longest sequences: as shapes, they are symbolic in a compiled layer, where ints would be
    specialized.
    """

    def __init__(self, packed: PackedLayout, total: int, kernel: Callable, device: torch.device) -> None:
        q_lens, spans = [], []
        for row, groups in enumerate(packed.rows):
            end = row * total
            for group in groups:
                prefix = (end, end + group.prefix)
                if group.prefix:
                    q_lens.append(group.prefix)
                    spans.append([prefix])
                end += group.prefix
                for block in group.blocks:
                    q_lens.append(block)
                    spans.append([prefix, (end, end + block)])
                    end += block
            if end < (row + 1) * total:
                q_lens.append((row + 1) * total - end)
                spans.append([(end, (row + 1) * total)])
        k_lens = [sum(b - a for a, b in s) for s in spans]
        index = np.concatenate([np.arange(a, b) for s in spans for a, b in s])
        self.packed, self.kernel = packed, kernel
        self.cu_q, self.cu_k = (
            torch.from_numpy(np.cumsum([0, *n], dtype=np.int32)).to(device) for n in (q_lens, k_lens)
        )
        self.kv_index = torch.from_numpy(index).to(device)
        self.max_q = torch.empty(max(q_lens), 0, device=device)
        self.max_k = torch.empty(max(k_lens), 0, device=device)
        for t in (self.kv_index, self.max_q, self.max_k):
            torch._dynamo.maybe_mark_dynamic(t, 0)

    def fits(self, query: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether the kernel takes these inputs (:func:`~vlm_grpo.fastpath.varlen.kernel_fits`)."""
        return kernel_fits(self.kernel, query, value)


def varlen_layout(packed: PackedLayout, total: int, device: torch.device) -> VarlenLayout | PackedLayout:
    """The layout a packed forward passes: :class:`VarlenLayout` where a varlen kernel runs on ``device``."""
    kernel = varlen_kernel(device) if VARLEN else None
    return packed if kernel is None else VarlenLayout(packed, total, kernel, device)


def shares_rows(device: torch.device) -> bool:
    """Whether packed groups go end to end in one row: where the varlen kernel runs, a row's length costs nothing
    but its tokens (the per-group calls, where it does not fit at the call, take any layout)."""
    return VARLEN and varlen_kernel(device) is not None


def _varlen_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: VarlenLayout, scaling: float | None
) -> torch.Tensor:
    """All packed rows in one kernel call; (rows, total, heads, dim) like :func:`_packed_sdpa`."""
    query, key, value = autocast_inputs(query, key, value)
    rows, heads, total = query.shape[:3]

    def tokens(x: torch.Tensor) -> torch.Tensor:  # (rows, heads, total, dim) -> (rows * total, heads, dim)
        return x.transpose(1, 2).reshape(rows * total, x.size(1), x.size(-1))

    k, v = (tokens(x).index_select(0, layout.kv_index) for x in (key, value))
    out = layout.kernel(
        tokens(query), k, v, layout.cu_q, layout.cu_k, layout.max_q.size(0), layout.max_k.size(0), scaling
    )
    return out.view(rows, total, heads, value.size(-1))


def block_sdpa_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """sdpa's mask, except inside a packed forward, where the layout replaces it."""
    return None if _packing.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, block_sdpa)
AttentionMaskInterface.register(NAME, block_sdpa_mask)


@contextlib.contextmanager
def packing():
    """Mark a forward as packed, so the model builds no mask for it (the layout keyword carries the structure)."""
    token = _packing.set(True)
    try:
        yield
    finally:
        _packing.reset(token)


def use_block_attention(model: Any, mode: str) -> bool:
    """Switch the text decoder of ``model`` (wrappers allowed) between sdpa and :data:`NAME`; True when packed
    forwards can pass a layout instead of a dense mask.

    Only sdpa decoders with full attention in every layer switch: eager stays the dense reference, and
    sliding-window layers keep the dense mask. A decoder on any other kernel (flash_attention_2, flex, ...)
    would be handed a dense 4-D mask it ignores, so it is moved to sdpa first (flash / memory-efficient
    kernels on GPU), with one info line: for good, not just around packed passes, so the recomputation of
    gradient checkpointing runs the kernel the forward ran. The decoder layers and the mask builder read the
    text config, so that is what changes (it is not saved with checkpoints).
    """
    config = model_base(model).config.get_text_config(decoder=True)
    if mode not in ("blocks", "dense"):
        raise ValueError(f"packed_attention must be 'blocks' or 'dense', got {mode!r}")
    if config._attn_implementation not in ("sdpa", "eager", NAME):
        warn_once(
            logger,
            f"share_prompt: the text decoder's {config._attn_implementation!r} attention cannot take the packed "
            "layout (it would ignore the block mask); the text decoder runs on sdpa's kernels instead (flash / "
            "memory-efficient on GPU). The vision tower keeps its kernel.",
            level=logging.INFO,
        )
        config._attn_implementation = "sdpa"
    if mode == "dense":
        if config._attn_implementation == NAME:
            config._attn_implementation = "sdpa"
        return False
    full = all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
    if config._attn_implementation == "sdpa" and full:
        config._attn_implementation = NAME
    return config._attn_implementation == NAME


def as_sdpa(attn: str | None) -> str | None:
    """The kernel family an attention name stands for outside packed forwards."""
    return "sdpa" if attn == NAME else attn
