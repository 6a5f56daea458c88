"""Which host syncs a ``fast_decode`` call makes, and where (``torch.cuda.set_sync_debug_mode``).

    python benchmarks/micro/sync_check.py --new_tokens 32          # a GPU machine

A host sync inside the decode loop drains the GPU's queue: the kernels launched after it (sampling, the next
graph replay) start only when the host gets there, and the GPU idles meanwhile. The loop is meant to sync only
every few tokens (the "every row has ended" check). Prints each distinct syncing call site (innermost frames of
the package and of torch / transformers) with its count per call.
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from pathlib import Path

import torch
from decode_lengths import one_call


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_qwen2_5_vl")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--prompt_length", type=int, default=40)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--out", default="sync_check.json")
    args = p.parse_args(argv)

    from vlm_grpo.testing.tiny import build_model

    device = torch.device("cuda")
    torch.backends.cuda.enable_cudnn_sdp(False)
    model, _ = build_model(args.preset, dtype=torch.bfloat16, device=device)
    model.eval()
    gc = model.generation_config
    gc.max_new_tokens = gc.min_new_tokens = args.new_tokens
    gc.do_sample, gc.temperature, gc.top_p, gc.top_k = not args.greedy, 1.0, 1.0, 0
    one_call(model, gc, args.prompt_length, 2, 8, device, True, 0, keep=True)  # compile, capture
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in frames if "vlm_grpo" in f.filename]
        sites[" <- ".join(reversed(ours[-2:])) or f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _, out = one_call(model, gc, args.prompt_length, 2, 8, device, True, 0, keep=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    summary = {"tokens": out.size(1), "syncs": sum(sites.values()), "sites": dict(sites.most_common())}
    print(json.dumps(summary, indent=2), flush=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
