"""The packed-group attention alone: dense block mask (sdpa) vs the prefix + blocks kernel.

One attention layer of the Qwen2.5-VL-3B text decoder (16 query heads, 2 KV heads, head dim 128)
over one packed group ``prefix | G blocks of C+1``: forward + backward time, peak memory, and the
largest difference of outputs and input gradients between the two (bf16 on GPU; fp32 on CPU).

    python3 benchmarks/micro/attention_micro.py --prefixes 299 1075 --completion_lengths 128 512
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import torch

from vlm_grpo.fastpath.block_attention import LAYOUT_KWARG, PackedLayout, block_sdpa
from vlm_grpo.fastpath.sharing import build_mask


def flex_block_mask(layout: PackedLayout, total: int, device: torch.device):
    """The packed row's structure as a flex_attention BlockMask (built once per forward in a real pass)."""
    from torch.nn.attention.flex_attention import create_block_mask

    (group,) = layout.rows[0]
    prefix, block = group.prefix, group.blocks[0]
    idx = torch.arange(total, device=device)
    block_id = torch.where(idx < prefix, -1, (idx - prefix) // block)

    def mask_mod(b, h, q, kv):
        return (kv <= q) & ((block_id[kv] == -1) | (block_id[kv] == block_id[q]))

    return create_block_mask(mask_mod, 1, None, total, total, device=device)


_flex = None


def run(
    kernel: str, q, k, v, layout: PackedLayout, module, grad_out, flex_mask=None
) -> tuple[float, float, list[torch.Tensor]]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    device = q.device
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    if kernel == "dense":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        mask = build_mask(layout.rows[0], q.size(2), None, device)
        out, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)
    elif kernel == "flex":
        global _flex
        if _flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            _flex = torch.compile(flex_attention)
        out = _flex(q, k, v, block_mask=flex_mask, scale=module.scaling, enable_gqa=True).transpose(1, 2)
    else:
        out, _ = block_sdpa(module, q, k, v, None, scaling=module.scaling, **{LAYOUT_KWARG: layout})
    out.backward(grad_out)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else float("nan")
    return elapsed, peak, [out.detach(), q.grad, k.grad, v.grad]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", type=int, nargs="+", default=[299, 1075])
    p.add_argument("--completion_lengths", type=int, nargs="+", default=[128, 512])
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--flex", action="store_true", help="also time compiled flex_attention with a block mask (GPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim = 16, 2, 128
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, scaling=dim**-0.5, is_causal=True, training=True)
    rows = []
    for prefix in args.prefixes:
        for c in args.completion_lengths:
            g, block = args.num_generations, c + 1
            layout = PackedLayout.uniform((prefix,), (g,), block)
            total = prefix + g * block
            gen = torch.Generator(device).manual_seed(0)
            q = torch.randn(1, heads, total, dim, device=device, dtype=dtype, generator=gen)
            k = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, generator=gen)
            v = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, generator=gen)
            grad_out = torch.randn(1, total, heads, dim, device=device, dtype=dtype, generator=gen)
            result = {"prefix": prefix, "completion": c, "G": g, "tokens": total}
            outputs = {}
            kernels = ["dense", "blocks"]
            flex_mask = None
            if args.flex and device.type == "cuda":  # flex_attention has no CPU backward
                torch.cuda.synchronize()
                start = time.perf_counter()
                flex_mask = flex_block_mask(layout, total, device)
                torch.cuda.synchronize()
                result["flex_mask_ms"] = 1000 * (time.perf_counter() - start)
                kernels.append("flex")
            for kernel in kernels:
                for _ in range(3 if kernel == "flex" else 1):  # warm-up (flex: compile, then a dynamic-shape recompile)
                    run(kernel, q, k, v, layout, module, grad_out, flex_mask)
                times = [run(kernel, q, k, v, layout, module, grad_out, flex_mask) for _ in range(args.repeats)]
                result[f"{kernel}_ms"] = 1000 * sorted(t[0] for t in times)[len(times) // 2]
                result[f"{kernel}_peak_mib"] = times[-1][1]
                outputs[kernel] = times[-1][2]
            result["max_abs_diff"] = max(
                float((a.float() - b.float()).abs().max())
                for a, b in zip(outputs["dense"], outputs["blocks"], strict=True)
            )
            result["speedup"] = result["dense_ms"] / result["blocks_ms"]
            if "flex" in outputs:
                result["flex_max_abs_diff"] = max(
                    float((a.float() - b.float()).abs().max())
                    for a, b in zip(outputs["dense"], outputs["flex"], strict=True)
                )
            rows.append(result)
            print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}, f)


if __name__ == "__main__":
    main()
