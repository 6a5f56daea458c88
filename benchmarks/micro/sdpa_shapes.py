"""What a new sequence length costs the packed attention: first call at an unseen shape vs a repeat.

cuDNN's sdpa builds an execution plan per new shape; real GRPO prompts change length every step. For
each of ``--lengths`` distinct prompt lengths, the block kernel (one Qwen2.5-VL-3B text attention layer,
16 query / 2 KV heads, dim 128, G blocks) runs forward + backward twice: the first call pays any
per-shape setup, the second shows the steady state. Run with cuDNN in sdpa's backends and without it.

    python3 benchmarks/micro/sdpa_shapes.py --lengths 8 --completion_length 128
    python3 benchmarks/micro/sdpa_shapes.py --device cpu --lengths 2 --first_length 20 --completion_length 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from vlm_grpo.fastpath.block_attention import LAYOUT_KWARG, PackedLayout, block_sdpa


def timed(module, q, k, v, layout: PackedLayout) -> float:
    """Forward + backward of the block kernel, ms."""
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    out, _ = block_sdpa(module, q, k, v, None, scaling=module.scaling, **{LAYOUT_KWARG: layout})
    out.sum().backward()
    sync()
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, default=8, help="distinct prompt lengths, step 7")
    p.add_argument("--first_length", type=int, default=1000)
    p.add_argument("--completion_length", type=int, default=128)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, kv_heads, dim, g, block = 16, 2, 128, args.num_generations, args.completion_length + 1
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, scaling=dim**-0.5, is_causal=True, training=True)
    rows = {}
    for backends in ("default", "no_cudnn"):
        torch.backends.cuda.enable_cudnn_sdp(backends == "default")
        first, repeat = [], []
        for i in range(args.lengths):
            prefix = args.first_length + 7 * i + (0 if backends == "default" else 3)  # unseen by the other pass too
            total = prefix + g * block
            q = torch.randn(1, heads, total, dim, device=device, dtype=dtype, requires_grad=True)
            k = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, requires_grad=True)
            v = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, requires_grad=True)
            layout = PackedLayout.uniform((prefix,), (g,), block)
            first.append(timed(module, q, k, v, layout))
            repeat.append(statistics.median(timed(module, q, k, v, layout) for _ in range(5)))
        rows[backends] = {"first_call_ms": statistics.median(first), "repeat_ms": statistics.median(repeat)}
        print(backends, json.dumps(rows[backends]), flush=True)
    torch.backends.cuda.enable_cudnn_sdp(True)
    if args.out:
        with open(args.out, "w") as f:
            name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
            json.dump({"device": name, "args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
