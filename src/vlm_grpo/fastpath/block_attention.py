"""Attention over a packed GRPO group without a (P+G·C)² mask.

The packed layout of :mod:`vlm_grpo.fastpath.sharing` is ``prefix | block_1 | ... | block_G`` per row. A dense
boolean mask over it costs (P+G·C)² per row and keeps sdpa off its flash kernels; most of its
entries are "block g does not see block h". Here the same attention is two kernel calls per row:

* the prefix attends to itself causally (``is_causal``: flash on GPU);
* the G blocks, batched, each attend to ``[prefix K/V, own K/V]`` with a lower-right causal bias
  (``torch.nn.attention.bias.causal_lower_right``: flash / memory-efficient on GPU, no mask tensor).

It is registered with transformers' ``AttentionInterface`` as :data:`NAME` and behaves exactly like
``sdpa`` unless the forward carries a :class:`PackedLayout` in the ``vlm_grpo_layout`` keyword, which
transformers hands through to every attention call (and which gradient checkpointing captures, so the
recomputed layers see it too). The sdpa path with the dense mask stays the reference
(``packed_attention="dense"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlm_grpo.utils import model_base, warn_once

logger = logging.getLogger(__name__)

NAME = "vlm_grpo_sdpa"
LAYOUT_KWARG = "vlm_grpo_layout"

_packing: contextvars.ContextVar[bool] = contextvars.ContextVar("vlm_grpo_packing", default=False)


@dataclass(frozen=True)
class PackedLayout:
    """Per packed row: length of the shared prefix and number of blocks; every block is ``block_len`` long."""

    prefixes: tuple[int, ...]
    blocks: tuple[int, ...]
    block_len: int


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
    layout: PackedLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
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
    """The packed rows, one by one. Outside compilation (``compile_layers``): the loop over the layout's
    Python ints would otherwise recompile a compiled decoder layer for every new layout."""
    query, key, value = autocast_inputs(query, key, value)
    gqa = query.size(1) != key.size(1)
    total, block = query.size(2), layout.block_len
    rows = []
    for q, k, v, prefix, blocks in zip(query, key, value, layout.prefixes, layout.blocks, strict=True):
        # q, k, v: (heads, total, dim) of one packed row. Every sdpa call gets 4-D inputs: on GPU the flash,
        # memory-efficient and cuDNN kernels take nothing else, and 3-D inputs fall back to the math kernel.
        parts = []
        if prefix:
            out = F.scaled_dot_product_attention(
                q[None, :, :prefix], k[None, :, :prefix], v[None, :, :prefix], dropout_p=dropout, is_causal=True,
                scale=scaling, enable_gqa=gqa,
            )  # fmt: skip
            parts.append(out[0].transpose(0, 1))  # (prefix, heads, dim)
        end = prefix + blocks * block
        qb, kb, vb = (_blocks(x[:, prefix:end], blocks, block) for x in (q, k, v))
        if prefix:
            kb = torch.cat([k[:, :prefix].expand(blocks, -1, -1, -1), kb], dim=2)
            vb = torch.cat([v[:, :prefix].expand(blocks, -1, -1, -1), vb], dim=2)
        out = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=causal_lower_right(block, prefix + block), dropout_p=dropout, scale=scaling,
            enable_gqa=gqa,
        )  # fmt: skip
        parts.append(out.transpose(1, 2).flatten(0, 1))  # (blocks * block, heads, dim)
        if end < total:  # right padding of shorter rows: nothing reads it
            parts.append(query.new_zeros(total - end, query.size(1), value.size(-1)))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in autocast's dtype, as autocast gives them to a plain sdpa call (unchanged without autocast). The
    lower-right causal bias is a tensor subclass: its ``__torch_function__`` checks the dtypes before autocast casts
    anything, so under mixed precision without DeepSpeed (fp32 weights: fp32 rotary q/k, bf16 v) the call would
    fail where sdpa succeeds."""
    device = xs[0].device.type
    if not torch.is_autocast_enabled(device):
        return xs
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) for x in xs)


def _blocks(x: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """(heads, n * block, dim) -> (n, heads, block, dim)."""
    return x.unflatten(1, (n, block)).transpose(0, 1)


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
