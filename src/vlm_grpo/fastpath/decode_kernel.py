"""Flash-decoding for the one-token decode step: a Triton drop-in for
:func:`vlm_grpo.fastpath.decode_attention.one_token_attention`.

That path is two cuBLAS batched matmuls around a softmax: three launches or more, with the fp32 scores written to
memory and read back. Here each program takes one (row, K/V head) and one split of the slots: the G query heads that
share the K/V head ride together as the rows of one ``tl.dot``, the scores stay on chip (online softmax), and each
K/V slot is read once. Rows that share a prompt (the G samples of one prompt, whose cache rows hold copies of the
same prompt K/V) may read the prompt's slots from one row: ``shared`` names, per row, the row whose prompt slots it
reads and how many slots the prompt has. The G rows' programs then read the same addresses at about the same time,
and L2 serves all but the first (the copies are equal, so the output is the same). A second, small kernel merges the
splits' partial results by log-sum-exp in a fixed order (deterministic). Two launches; the workspace is
``torch.empty`` (no memset). Registered as a ``triton_op`` so torch.compile traces it and CUDA graphs capture it.
"""

from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; supported() says False
    triton = None
if not hasattr(torch.library, "triton_op"):  # torch < 2.6: no traceable Triton ops
    triton = None

BLOCK_S = 64  # slots per inner step
_TARGET_PROGRAMS = 3 * 132  # ~3 programs per SM of an H100
_SHARED_BYTES = 160 * 1024  # pipelined K/V tiles must fit an SM's shared memory (fp32 at d=256: one stage)
_MAX_STAGES = 3  # pipeline depth of the split kernel's K/V loads, at most
_NUM_WARPS = 4  # of the split kernel


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def choose_splits(length: int, rows: int) -> tuple[int, int]:
    """(splits, blocks per split) for ``length`` slots over ``rows`` = B * H_kv programs: about
    ``_TARGET_PROGRAMS`` programs in all, each split at least one block and none empty. Integer arithmetic only
    (no comparisons), so symbolic sizes under torch.compile add no guards."""
    blocks = _cdiv(length, BLOCK_S)
    per_split = _cdiv(blocks, _cdiv(_TARGET_PROGRAMS, rows))
    return _cdiv(blocks, per_split), per_split


if triton is not None:

    @triton.jit(do_not_specialize=["length", "splits", "per_split"])
    def _split_kernel(
        Q, K, V, Mask, Src, Prefix, Acc, Stats,
        scale, length, kv_heads, splits, per_split,
        sq_b, sq_h, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d, sm_b, sm_s,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
        MASK_KIND: tl.constexpr, PRECISION: tl.constexpr, SHARED: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)  # row * kv_heads + kv head
        split = tl.program_id(1)
        b = pid // kv_heads
        hk = pid % kv_heads
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, D)
        heads = hk * GROUP + g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + d[None, :] * sq_d, mask=g[:, None] < GROUP, other=0.0)
        k_base = K + b * sk_b + hk * sk_h
        v_base = V + b * sv_b + hk * sv_h
        if SHARED:  # slots below the prompt's length: the source row's copy of the prompt
            src = tl.load(Src + b)
            prefix = tl.load(Prefix)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        scale = tl.cast(scale, tl.float32)  # inductor passes Python floats as fp64
        start = split * per_split * BLOCK
        end = tl.minimum(start + per_split * BLOCK, length)
        for s0 in range(start, end, BLOCK):
            s = s0 + tl.arange(0, BLOCK)
            valid = s < end
            if SHARED:
                row = tl.where(s < prefix, src, b)
                k_ptrs = K + row[None, :] * sk_b + hk * sk_h + s[None, :] * sk_s + d[:, None] * sk_d
                v_ptrs = V + row[:, None] * sv_b + hk * sv_h + s[:, None] * sv_s + d[None, :] * sv_d
            else:
                k_ptrs = k_base + s[None, :] * sk_s + d[:, None] * sk_d
                v_ptrs = v_base + s[:, None] * sv_s + d[None, :] * sv_d
            k = tl.load(k_ptrs, mask=valid[None, :], other=0.0)
            scores = tl.dot(q, k, input_precision=PRECISION) * scale
            if MASK_KIND == 1:
                allowed = tl.load(Mask + b * sm_b + s * sm_s, mask=valid, other=0) != 0
                valid = valid & allowed
            if MASK_KIND == 2:
                scores += tl.load(Mask + b * sm_b + s * sm_s, mask=valid, other=0.0).to(tl.float32)[None, :]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block so far: no NaN
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            den = den * alpha + tl.sum(p, 1)
            v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        # workspace rows: (row * H + head) * splits + split
        out_row = (b * kv_heads * GROUP + heads) * splits + split
        keep = g < GROUP
        tl.store(Acc + out_row[:, None] * D + d[None, :], acc, mask=keep[:, None])
        tl.store(Stats + out_row * 2, m, mask=keep)
        tl.store(Stats + out_row * 2 + 1, den, mask=keep)

    @triton.jit(do_not_specialize=["splits"])
    def _combine_kernel(Acc, Stats, Out, splits, D: tl.constexpr):
        pid = tl.program_id(0)  # row * H + head
        d = tl.arange(0, D)
        base = pid * splits
        m = tl.load(Stats + base * 2)
        for i in range(1, splits):
            m = tl.maximum(m, tl.load(Stats + (base + i) * 2))
        den = tl.zeros([1], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for i in range(0, splits):  # fixed order: deterministic
            w = tl.exp(tl.load(Stats + (base + i) * 2) - m)  # a fully masked split: exp(-inf) = 0
            den += tl.load(Stats + (base + i) * 2 + 1) * w
            acc += tl.load(Acc + (base + i) * D + d) * w
        tl.store(Out + pid * D + d, (acc / den).to(Out.dtype.element_ty))


def _launch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    wrap: Callable | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Both kernel launches; ``wrap`` is ``torch.library.wrap_triton`` inside the op (identity in tests).
    ``shared``: (source row per row, int32 (B,); prompt slots, int32 0-dim), see :func:`decode_attention_kernel`."""
    wrap = wrap or (lambda kernel: kernel)
    batch, heads, _, dim = query.shape
    kv_heads, length = key.size(1), key.size(2)
    group = heads // kv_heads
    rows = batch * kv_heads
    splits, per_split = choose_splits(length, rows)
    acc = torch.empty((batch * heads * splits, dim), device=query.device, dtype=torch.float32)
    stats = torch.empty((batch * heads * splits, 2), device=query.device, dtype=torch.float32)
    out = torch.empty((batch, heads, 1, dim), device=query.device, dtype=value.dtype)
    kind = 0 if mask is None else 1 if mask.dtype == torch.bool else 2
    if mask is None:
        mask, sm_b, sm_s = query, 0, 0  # never read
    else:
        mask = mask.expand(batch, 1, 1, length)  # a mask of one row for all: batch stride 0
        sm_b, sm_s = mask.stride(0), mask.stride(3)
    src, prefix = shared if shared is not None else (query, query)  # never read unless shared
    wrap(_split_kernel)[(rows, splits)](
        query, key, value, mask, src, prefix, acc, stats,
        scale, length, kv_heads, splits, per_split,
        query.stride(0), query.stride(1), query.stride(3),
        key.stride(0), key.stride(1), key.stride(2), key.stride(3),
        value.stride(0), value.stride(1), value.stride(2), value.stride(3),
        sm_b, sm_s,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, BLOCK=BLOCK_S,
        MASK_KIND=kind, PRECISION="ieee" if query.dtype == torch.float32 else "tf32", SHARED=shared is not None,
        num_stages=max(1, min(_MAX_STAGES, _SHARED_BYTES // (2 * BLOCK_S * dim * value.element_size()))),
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    wrap(_combine_kernel)[(batch * heads,)](acc, stats, out, splits, D=dim)
    return out


if triton is not None:

    @torch.library.triton_op("vlm_grpo::decode_attention", mutates_args=())
    def _decode_attention_op(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float, has_mask: bool,
        src: torch.Tensor, prefix: torch.Tensor, has_shared: bool,
    ) -> torch.Tensor:  # fmt: skip
        return _launch(
            query, key, value, mask if has_mask else None, scale, torch.library.wrap_triton,
            (src, prefix) if has_shared else None,
        )  # fmt: skip


def _on_gpu(*tensors: torch.Tensor) -> bool:
    """Where the kernels run (tests on CPU replace this while Triton's interpreter runs them)."""
    return all(t.is_cuda for t in tensors)


def shared_ok(shared: tuple[torch.Tensor, torch.Tensor] | None, key: torch.Tensor) -> bool:
    """Whether ``shared`` is a (source rows, prompt slots) pair the kernel takes for ``key``'s rows."""
    if shared is None:
        return False
    src, prefix = shared
    return (
        src.dtype == prefix.dtype == torch.int32
        and tuple(src.shape) == (key.size(0),)
        and prefix.dim() == 0
        and src.device == prefix.device == key.device
    )


def supported(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether :func:`decode_attention_kernel` takes these inputs (else use ``one_token_attention``)."""
    if triton is None or not _on_gpu(query, key, value, *([] if mask is None else [mask])):
        return False
    if query.dim() != 4 or key.dim() != 4 or query.size(2) != 1 or key.shape != value.shape:
        return False
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not query.dtype == key.dtype == value.dtype:
        return False
    heads, kv_heads, dim = query.size(1), key.size(1), query.size(3)
    if dim != key.size(3) or dim < 16 or dim > 256 or dim & (dim - 1) or heads % kv_heads or heads // kv_heads > 16:
        return False
    if key.size(2) == 0 or key.size(0) != query.size(0):
        return False
    if mask is None:
        return True
    if mask.dim() != 4 or mask.size(0) not in (1, query.size(0)) or mask.shape[1:3] != (1, 1):
        return False
    return mask.size(3) == key.size(2) and (mask.dtype == torch.bool or mask.is_floating_point())


def decode_attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q·Kᵀ·scale + mask)·V as ``one_token_attention``: ``query`` (B, H, 1, d), ``key`` / ``value``
    (B, H_kv, L, d) (strided views are read in place), ``mask`` None or (B, 1, 1, L) boolean (True: attend) or
    additive. Returns (B, H, 1, d) in ``value``'s dtype. Check :func:`supported` first.

    ``shared`` (source, prefix), int32 tensors on the device, (B,) and 0-dim: row b reads slots below ``prefix``
    from row ``source[b]``. Only where those slots of the two rows are equal (copies of one prompt's K/V), so the
    output is the same as without; fewer distinct bytes are read. Ignored unless :func:`shared_ok`."""
    use = shared_ok(shared, key)
    src, prefix = shared if use else (query, query)
    return torch.ops.vlm_grpo.decode_attention(
        query, key, value, query if mask is None else mask, float(scale), mask is not None, src, prefix, use
    )
