"""Vision-tower attention batched by segment length instead of one sdpa call per window or image.

Under ``sdpa`` the Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision towers split q/k/v at ``cu_seqlens`` and
call attention once per segment: per image, and in Qwen2.5-VL's windowed layers per window (64 per
896² image in 28 of 32 layers), i.e. thousands of tiny kernel launches and a host sync per layer.
:func:`varlen_sdpa` takes the whole packed sequence at once, groups the segments by length, and runs
one ``F.scaled_dot_product_attention`` per distinct length on ``(n_L, heads, L, dim)`` gathered with
index ops; an inverse permutation (``index_select``, differentiable) restores token order. The plan
(indices per length) is computed once per ``cu_seqlens`` tensor: every layer gets the same object.

The name contains "flash" because that is the only switch the towers read
(``is_flash_attention_requested``: ``"flash" in config._attn_implementation``) to hand the attention
function ``cu_seq_lens_q/k`` in one call instead of splitting the sequence themselves. The kernel is
torch's sdpa; flash-attn is neither needed nor imported. The name is set on the vision config only,
directly (``set_attn_implementation`` would try to load a flash-attn kernel for it), and is not saved
with checkpoints (transformers drops ``_attn_implementation_internal`` from ``config.json``).

On a GPU with flash attention (fp16 / bf16) the whole packed sequence is instead **one** call of flash's varlen
kernel (:mod:`vlm_grpo.fastpath.varlen`) on ``cu_seqlens`` and the longest segment, which transformers computes once
per tower forward and hands every block (``max_seqlen``): no host read, no gather, no per-length loop, so a compiled
vision block (``compile_layers``) traces it whole and its backward is flash's own. The per-length sdpa calls stay for
everything else (CPU, fp32, dropout, a transformers that passes no ``max_seqlen``), as a compiler-disabled island.

No ``AttentionMaskInterface`` entry is registered on purpose: the towers build no mask, and
transformers' mask builders return ``None`` (no mask) for names that have none.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlm_grpo.fastpath.varlen import autocast_inputs, kernel_fits, varlen_kernel
from vlm_grpo.utils import model_base

NAME = "vlm_grpo_sdpa_flash_varlen"
VARLEN = True  # benchmarks flip it (variant switch ``varlen_vision=false``): the per-length calls even on GPUs


@dataclass(frozen=True)
class SegmentPlan:
    """The segments grouped by length (token indices per group) and the permutation back to token order."""

    groups: tuple[tuple[int, int, torch.Tensor | None], ...]  # (length, count, token indices or None: all, in order)
    inverse: torch.Tensor | None  # token order of the grouped output -> original order; None: identity


# A few slots, keyed by tensor identity: Qwen2.5-VL alternates window and full-attention cu_seqlens.
_PLAN_SLOTS = 4
_plans: list[tuple[weakref.ref[torch.Tensor], torch.device, SegmentPlan]] = []


def segment_plan(cu_seqlens: torch.Tensor, device: torch.device) -> SegmentPlan:
    """The grouping of ``cu_seqlens``'s segments by length; one host sync per distinct tensor object."""
    for ref, dev, plan in _plans:
        if ref() is cu_seqlens and dev == device:
            return plan
    plan = _build_plan(cu_seqlens.tolist(), device)
    _plans[:] = [(weakref.ref(cu_seqlens), device, plan), *(e for e in _plans if e[0]() is not None)][:_PLAN_SLOTS]
    return plan


def _build_plan(bounds: list[int], device: torch.device) -> SegmentPlan:
    starts_by_length: dict[int, list[int]] = {}
    for start, end in itertools.pairwise(bounds):
        if end > start:
            starts_by_length.setdefault(end - start, []).append(start)
    if len(starts_by_length) == 1:  # one length: the segments tile the sequence, no gather needed
        ((length, starts),) = starts_by_length.items()
        return SegmentPlan(((length, len(starts), None),), None)
    groups, order = [], []
    for length, starts in starts_by_length.items():
        index = (torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)).flatten()
        groups.append((length, len(starts), index))
        order.append(index)
    perm = torch.cat(order)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=device)
    return SegmentPlan(tuple(groups), inverse)


def varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention within each ``cu_seq_lens_q`` segment of a packed ``(1, heads, N, dim)`` sequence.

    Returns ``(1, N, heads, dim)`` like transformers' flash varlen path. Without ``cu_seq_lens_q`` it is
    plain ``sdpa``.
    """
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q:
        raise NotImplementedError(f"{NAME} computes self-attention only (cu_seq_lens_k must be cu_seq_lens_q)")
    if attention_mask is not None or query.size(0) != 1:
        raise NotImplementedError(f"{NAME} takes one packed sequence without a mask")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    longest = kwargs.get("max_length_q")  # an int where transformers computes it once per tower forward
    traced = isinstance(longest, (int, torch.SymInt))
    kernel = varlen_kernel(query.device) if VARLEN and traced and dropout == 0.0 else None
    if kernel is not None and kernel_fits(kernel, query, value):
        # (1, heads, N, dim) -> (N, heads, dim): tokens first, as varlen kernels take them
        q, k, v = (x[0].transpose(0, 1) for x in autocast_inputs(query, key, value))
        cu = cu_seq_lens_q.to(torch.int32)
        return kernel(q, k, v, cu, cu, longest, longest, scaling, causal=causal).unsqueeze(0), None
    return _segmented_sdpa(query, key, value, cu_seq_lens_q, causal, dropout, scaling), None


@torch.compiler.disable
def _segmented_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """One sdpa per distinct segment length. Outside compilation, an island in a compiled vision block
    (``compile_layers``): the plan reads ``cu_seqlens`` on the host, looked up by the tensor's identity, and
    traced, its ints would recompile the block for every new set of images."""
    plan = segment_plan(cu_seqlens, query.device)
    # (1, heads, N, dim) -> (N, heads, dim): tokens first, so gathers and the inverse act on dim 0
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    gqa = q.size(1) != k.size(1)
    outputs = []
    for length, count, index in plan.groups:
        qs, ks, vs = (_segments(x, index, count, length) for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        outputs.append(out.transpose(1, 2).flatten(0, 1))  # (n_L * L, heads, dim)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if plan.inverse is not None:
        out = out.index_select(0, plan.inverse)
    return out.unsqueeze(0)


def _segments(x: torch.Tensor, index: torch.Tensor | None, count: int, length: int) -> torch.Tensor:
    """(N, heads, dim) -> the ``count`` segments of ``length`` tokens as (count, heads, length, dim)."""
    x = x if index is None else x.index_select(0, index)
    return x.view(count, length, x.size(1), x.size(2)).transpose(1, 2)


AttentionInterface.register(NAME, varlen_sdpa)


def vision_towers(model: Any, vlm_module: Any) -> list[torch.nn.Module]:
    """The submodules of ``model`` (a transformers model) at the family's ``vision_prefixes`` that it has."""
    towers = []
    for prefix in vlm_module.vision_prefixes:
        try:
            towers.append(model.get_submodule(prefix))
        except AttributeError:
            continue
    return towers


def use_batched_vision_attention(model: Any, enabled: bool, vlm_module: Any = None) -> bool:
    """Switch the vision tower of ``model`` between ``sdpa`` and :data:`NAME`; True when it runs :data:`NAME`.

    Only families whose adapter sets ``varlen_vision`` switch (``vlm_module``, or the one registered for
    the model's ``model_type``), and only from sdpa: eager stays the reference, flash keeps its kernel.
    The text decoder keeps its own setting (the vision config is a separate object).
    """
    from vlm_grpo.modules import VLM_MODULES

    base = model_base(model)
    config = getattr(base.config, "vision_config", None)
    if vlm_module is None and base.config.model_type in VLM_MODULES.names():
        vlm_module = VLM_MODULES.get(base.config.model_type)
    if config is None or not getattr(vlm_module, "varlen_vision", False):
        return False
    configs = {id(config): config}
    for tower in vision_towers(base, vlm_module):  # where the attention modules read it (normally the same object)
        for sub in tower.modules():
            sub_config = getattr(sub, "config", None)
            if sub_config is not None and hasattr(sub_config, "_attn_implementation"):
                configs[id(sub_config)] = sub_config
    source, target = ("sdpa", NAME) if enabled else (NAME, "sdpa")
    for c in configs.values():
        if c._attn_implementation == source:
            c._attn_implementation = target
    return config._attn_implementation == NAME
