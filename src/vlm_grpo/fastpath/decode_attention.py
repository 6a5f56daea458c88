"""sdpa for the one-token decode step of ``fast_decode``, without copying the KV cache per query head.

With a mask, transformers' sdpa path expands grouped K/V to every query head (``repeat_kv``) before
calling the kernel: at each decode step every layer copies its whole static cache H/H_kv times (8x for
Qwen2.5-VL-3B). Profiled on an H100 (3B, 16 rows, cache of 1536 slots) that copy took as long as the
attention itself, ~2.8 ms per token, a third of the decode step. With a single new token per row, the
query heads that share a K/V head can instead ride on the query-length axis: ``(B, H, 1, d)`` becomes
``(B, H_kv, H/H_kv, d)`` against the unexpanded ``(B, H_kv, L, d)`` cache, the same dot products.

Attention windows: ``fast_decode`` hands each step a mask over only the first ``w`` slots of the static cache
(the window that holds every slot written so far; see :mod:`vlm_grpo.fastpath.decode`). K and V are cut to the
mask's length, so the kernel reads ``w`` slots instead of the whole cache: the same dot products over the slots
that can be attended, none of the masked-out tail.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_grpo.fastpath.block_attention import as_sdpa, block_sdpa

NAME = "vlm_grpo_decode_sdpa"


def decode_sdpa(
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
    """Grouped heads folded into the query axis for one-token queries; otherwise the package's sdpa.

    A mask shorter than the cache is a window: only its slots of K and V are read."""
    if attention_mask is not None:  # both paths below: a window's K/V
        # Slices, not a branch on the lengths: under torch.compile the window's length is symbolic, and a
        # comparison would guard on it (a recompile at the window that reaches the cache's end).
        attention_mask = attention_mask[..., : key.size(-2)]
        key, value = key[:, :, : attention_mask.size(-1)], value[:, :, : attention_mask.size(-1)]
    batch, heads, q_len, dim = query.shape
    kv_heads = key.size(1)
    if q_len != 1 or heads == kv_heads or dropout or heads % kv_heads:
        return block_sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # repeat_kv maps query head h to K/V head h // (heads / kv_heads): a plain reshape keeps that order.
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(NAME, decode_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


@contextlib.contextmanager
def decode_attention(config: Any):
    """While a decode step runs, route an sdpa text ``config`` through :func:`decode_sdpa`."""
    before = config._attn_implementation
    if as_sdpa(before) == "sdpa":
        config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
