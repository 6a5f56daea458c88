"""Time the decode step's attention alone, per layer, for the shapes ``fast_decode`` runs (3B: 16 query heads,
2 K/V heads, head dim 128; U prompts x G rows): the kernel it uses today against alternatives.

    python benchmarks/micro/decode_attention_micro.py --lengths 512 1280 1536 --prompt 330 1100 330

Variants (each in a compiled function, as in the decode step; CUDA-graph replay timing):
``sdpa``: grouped query heads on the query axis against the row's cache, a boolean mask (today's path);
``math``: the same dot products written as two batched matmuls and a softmax;
``shared``: the prompt's K/V read once per group (its G rows' queries stacked, one matmul per prompt), the
completion part per row, the two merged by their log-sum-exp;
``package``: :func:`vlm_grpo.fastpath.decode_attention.one_token_attention` (what the decode step runs: fp32 scores)
on a window's view of a longer cache, as ``fast_decode`` hands it over;
``kernel``: :func:`vlm_grpo.fastpath.decode_kernel.decode_attention_kernel` (flash-decoding in Triton, what the decode
step runs on a GPU) on the same window view.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from vlm_grpo.fastpath.decode_attention import one_token_attention
from vlm_grpo.fastpath.decode_kernel import decode_attention_kernel


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _scores(q, k, mask):
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * q.size(-1) ** -0.5
    return scores.masked_fill(~mask, float("-inf"))


def math(q, k, v, mask):
    return torch.matmul(torch.softmax(_scores(q, k, mask), dim=-1).to(v.dtype), v)


def _part(q, k, v, mask):
    scores = _scores(q, k, mask)
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - top)
    return torch.matmul(weights.to(v.dtype), v).float(), top, weights.sum(-1, keepdim=True)


def shared(q, pk, pv, pmask, ck, cv, cmask, group):
    """q (B, Hkv, R, d); prompt K/V (U, Hkv, P, d); completion K/V (B, Hkv, T, d)."""
    b, hkv, r, d = q.shape
    u = pk.size(0)
    qp = q.reshape(u, group, hkv, r, d).transpose(1, 2).reshape(u, hkv, group * r, d)
    o1, m1, s1 = _part(qp, pk, pv, pmask)
    o1 = o1.reshape(u, hkv, group, r, d).transpose(1, 2).reshape(b, hkv, r, d)
    m1 = m1.reshape(u, hkv, group, r, 1).transpose(1, 2).reshape(b, hkv, r, 1)
    s1 = s1.reshape(u, hkv, group, r, 1).transpose(1, 2).reshape(b, hkv, r, 1)
    o2, m2, s2 = _part(q, ck, cv, cmask)
    top = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - top), torch.exp(m2 - top)
    return ((o1 * a1 + o2 * a2) / (s1 * a1 + s2 * a2)).to(q.dtype)


def timed(fn, args, iters: int = 200) -> float:
    """ms per call, replayed from a CUDA graph (the decode step is one)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters // 10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1280, 1536], help="attended cache slots")
    p.add_argument("--prompt", type=int, nargs="+", default=[330, 1100, 330], help="prompt slots, per length")
    p.add_argument("--unique", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--out", default="decode_attention_micro.json")
    args = p.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    dev, dt = torch.device("cuda"), torch.bfloat16
    b, hkv, r, d = args.unique * args.group, 2, 8, 128
    rows = []
    for length, prompt in zip(args.lengths, args.prompt, strict=True):
        q = torch.randn(b, hkv, r, d, device=dev, dtype=dt)
        k = torch.randn(b, hkv, length, d, device=dev, dtype=dt)
        v = torch.randn_like(k)
        written = min(length, prompt + 64)
        mask = torch.zeros(b, 1, 1, length, dtype=torch.bool, device=dev)
        mask[..., :written] = True
        pk, pv = k[:: args.group, :, :prompt].contiguous(), v[:: args.group, :, :prompt].contiguous()
        ck, cv = k[:, :, prompt:].contiguous(), v[:, :, prompt:].contiguous()
        pmask = torch.ones(args.unique, 1, 1, prompt, dtype=torch.bool, device=dev)
        cmask = mask[..., prompt:].contiguous()
        # the shared layout holds the same K/V as the per-row cache when every group's rows share its prompt
        k[:, :, :prompt] = pk.repeat_interleave(args.group, 0)
        v[:, :, :prompt] = pv.repeat_interleave(args.group, 0)
        ref = sdpa(q, k, v, mask)
        row = {"length": length, "prompt": prompt, "written": written}
        # the package's function on a window of a cache 256 slots longer (non-contiguous K/V views)
        big_k = torch.randn(b, hkv, length + 256, d, device=dev, dtype=dt)
        big_v = torch.randn_like(big_k)
        big_k[:, :, :length], big_v[:, :, :length] = k, v
        query = q.reshape(b, hkv * r, 1, d)  # the decoder's layout: query heads on axis 1

        def package(query, big_k, big_v, mask):
            window_k, window_v = big_k[:, :, : mask.size(-1)], big_v[:, :, : mask.size(-1)]
            out = one_token_attention(query, window_k, window_v, mask, d**-0.5)
            return out.reshape(b, hkv, r, d)

        def kernel(query, big_k, big_v, mask):
            window_k, window_v = big_k[:, :, : mask.size(-1)], big_v[:, :, : mask.size(-1)]
            return decode_attention_kernel(query, window_k, window_v, mask, d**-0.5).reshape(b, hkv, r, d)

        for name, fn, fargs in (
            ("sdpa", sdpa, (q, k, v, mask)),
            ("sdpa_compiled", torch.compile(sdpa), (q, k, v, mask)),
            ("math_compiled", torch.compile(math), (q, k, v, mask)),
            ("shared_compiled", torch.compile(shared), (q, pk, pv, pmask, ck, cv, cmask, args.group)),
            ("package_compiled", torch.compile(package), (query, big_k, big_v, mask)),
            ("kernel_compiled", torch.compile(kernel), (query, big_k, big_v, mask)),
        ):
            out = fn(*fargs)
            row[name + "_maxerr"] = float((out.float() - ref.float()).abs().max())
            row[name + "_ms_per_token"] = timed(fn, fargs) * args.layers
        torch.backends.cuda.enable_cudnn_sdp(True)
        row["sdpa_cudnn_ms_per_token"] = timed(sdpa, (q, k, v, mask)) * args.layers
        torch.backends.cuda.enable_cudnn_sdp(False)
        kv_bytes = 2 * k.numel() * k.element_size() * args.layers
        row["kv_read_floor_ms"] = 1e3 * kv_bytes / 3.35e12
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
