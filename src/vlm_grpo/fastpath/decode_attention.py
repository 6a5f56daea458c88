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

Not sdpa's kernel: with a mask, sdpa runs its memory-efficient kernel, which splits the work over (rows x K/V heads)
only: 32 blocks for 16 rows on an H100's 132 SMs, each reading its row's whole cache alone. On a GPU with Triton the
step runs :mod:`vlm_grpo.fastpath.decode_kernel` (flash-decoding: the slots split too, the scores kept on chip, two
launches); elsewhere two batched matmuls and a softmax, which split the slots as well. Measured on an H100 (3B
shapes, 16 rows, per decode token over 36 layers, ``benchmarks/micro/decode_attention_micro.py``): at 1280 slots sdpa
2.01 ms, the matmuls 0.57, the kernel 0.41. Both keep the scores in fp32 as sdpa's kernels do, and the weights go
to the value dtype for the second product, as they do there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_grpo.fastpath import decode_kernel
from vlm_grpo.fastpath.block_attention import as_sdpa, block_sdpa
from vlm_grpo.fastpath.varlen import autocast_inputs

NAME = "vlm_grpo_decode_sdpa"
KERNEL = True  # on a GPU with Triton: flash-decoding (decode_kernel) instead of the two matmuls; False: the matmuls
# The G rows of one prompt read its K/V slots from one row (decode_kernel's ``shared``); False: each its own copy.
SHARED_PROMPT = True
# The decoder keyword that carries (source row per row, prompt slots) to decode_sdpa: transformers hands a decoder
# forward's extra keywords down to the attention function.
SHARED_KWARG = "vlm_grpo_shared_prompt"


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

    A mask shorter than the cache is a window: only its slots of K and V are read. ``kwargs[SHARED_KWARG]``: rows
    whose prompt slots are copies of another row's read that row's (the kernel only; the output is the same)."""
    shared = kwargs.pop(SHARED_KWARG, None)
    if attention_mask is not None:  # both paths below: a window's K/V
        # Slices, not a branch on the lengths: under torch.compile the window's length is symbolic, and a
        # comparison would guard on it (a recompile at the window that reaches the cache's end).
        attention_mask = attention_mask[..., : key.size(-2)]
        key, value = key[:, :, : attention_mask.size(-1)], value[:, :, : attention_mask.size(-1)]
    _, heads, q_len, dim = query.shape
    kv_heads = key.size(1)
    per_head_mask = attention_mask is not None and attention_mask.size(1) != 1
    if q_len != 1 or dropout or heads % kv_heads or per_head_mask:
        return block_sdpa(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    # Under autocast (fp32 weights, --bf16 without DeepSpeed) sdpa takes q, k, v cast to its dtype and keeps its
    # scores in fp32; autocast would instead round the scores GEMM's output to bf16. So: cast as sdpa's inputs
    # are, then run as for bf16 weights, with autocast off.
    autocast = torch.is_autocast_enabled(query.device.type)
    query, key, value = autocast_inputs(query, key, value)
    scale = dim**-0.5 if scaling is None else scaling
    with torch.autocast(query.device.type, enabled=False) if autocast else contextlib.nullcontext():
        if KERNEL and decode_kernel.supported(query, key, value, attention_mask):
            out = decode_kernel.decode_attention_kernel(query, key, value, attention_mask, scale, shared)
        else:
            out = one_token_attention(query, key, value, attention_mask, scale)
    return out.transpose(1, 2), None


def one_token_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(q·Kᵀ·scale + mask)·V for one query token per row: ``query`` (B, H, 1, d) against ``key`` and ``value``
    (B, H_kv, L, d); ``mask`` (B, 1, 1, L) boolean (True: attend) or additive. Returns (B, H, 1, d).

    The H / H_kv query heads that share a K/V head ride on the query axis (repeat_kv maps query head h to K/V head
    h // (H / H_kv): a plain reshape keeps that order), so the cache is read as it is, once per K/V head."""
    batch, heads, _, dim = query.shape
    kv_heads = key.size(1)
    q = query.reshape(batch * kv_heads, heads // kv_heads, dim)
    k = key.reshape(batch * kv_heads, key.size(2), dim)
    scores = _fp32_scores(q, k).view(batch, kv_heads, heads // kv_heads, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, heads, 1, dim)


# bmm writing fp32 from half-precision inputs (``out_dtype``) came with torch 2.8; the package supports 2.6.
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def _fp32_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q·kᵀ in fp32: from half-precision inputs on a GPU, one GEMM that writes fp32 (``bmm``'s ``out_dtype``), as
    sdpa's kernels accumulate; elsewhere (or on a torch without it) the inputs in fp32."""
    if q.dtype == torch.float32:
        return torch.bmm(q, k.transpose(1, 2))
    if q.is_cuda and _BMM_OUT_DTYPE:
        return torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    return torch.bmm(q.float(), k.float().transpose(1, 2))


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
