"""Variable-length attention: one kernel call over many sequences packed end to end.

Two attention paths pack their sequences: the shared-prompt text pass (:mod:`vlm_grpo.fastpath.block_attention`: each
row's prefix and blocks) and the Qwen vision towers (:mod:`vlm_grpo.fastpath.vision_attention`: images and windows).
On a GPU with flash attention both are one call of flash's varlen kernel, whose inputs are device tensors and whose
longest sequences are (symbolic) ints, so a compiled layer traces it whole and its backward is flash's own. Where no
varlen kernel runs (CPU, fp32 without autocast, dropout, head dims flash does not take) each path keeps its own
per-segment sdpa calls.

CPUs have no varlen kernel; tests set :data:`CPU_STAND_IN` to :func:`varlen_reference` (the same attention through a
dense mask) so that CPU runs take the varlen path too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

CPU_STAND_IN: Callable | None = None  # tests: a stand-in for flash's varlen kernel on CPU
_HALF = (torch.float16, torch.bfloat16)


def flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, causal: bool = True):
    """Flash attention over variable-length sequences (causal: aligned to the end of each key sequence); its autograd
    formula is flash's backward. q: (tokens, heads, dim); k, v: (keys, kv_heads, dim); cu_q / cu_k: int32."""
    flash = torch.ops.aten._flash_attention_forward
    return flash(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)[0]


def varlen_reference(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, causal: bool = True):
    """:func:`flash_varlen`'s attention through sdpa with a dense mask (any device; memory grows with tokens²)."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    at_q, at_k = (torch.arange(x.size(0), device=x.device) for x in (q, k))
    seq_q, seq_k = torch.searchsorted(cu_q[1:], at_q, right=True), torch.searchsorted(cu_k[1:], at_k, right=True)
    mask = seq_q[:, None] == seq_k[None, :]
    if causal:
        pos_q, pos_k = at_q - cu_q[seq_q], at_k - cu_k[seq_k]
        shift = (cu_k.diff() - cu_q.diff())[seq_q]  # keys before the first query's diagonal
        mask = mask & (pos_k[None, :] <= (pos_q + shift)[:, None])
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.size(1) != k.size(1))
    return out[0].transpose(0, 1)


def varlen_kernel(device: torch.device) -> Callable | None:
    """The varlen kernel for ``device``: flash on CUDA (sm80+, flash sdp enabled), the stand-in on CPU, else None."""
    if device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled():
        return flash_varlen if torch.cuda.get_device_capability(device) >= (8, 0) else None
    return CPU_STAND_IN if device.type == "cpu" else None


def kernel_fits(kernel: Callable, query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``kernel`` takes these inputs (flash: fp16 / bf16 after autocast, head dims of 8k up to 256)."""
    if kernel is not flash_varlen:
        return True
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    dims = {query.size(-1), value.size(-1)}
    return dtype in _HALF and all(d % 8 == 0 and d <= 256 for d in dims)


def autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Tensors in autocast's dtype, as autocast gives them to a plain sdpa call (unchanged without autocast).

    Flash's varlen op is not on autocast's cast list, so its inputs are cast here. In the per-row text path, the
    lower-right causal bias is a tensor subclass whose ``__torch_function__`` checks the dtypes before autocast casts
    anything: under mixed precision without DeepSpeed (fp32 weights: fp32 rotary q/k, bf16 v) that call would fail
    where sdpa succeeds."""
    device = xs[0].device.type
    if not torch.is_autocast_enabled(device):
        return xs
    dtype = torch.get_autocast_dtype(device)
    return tuple(x.to(dtype) for x in xs)
