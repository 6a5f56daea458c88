"""The flash-decoding kernel's launch settings swept, per layer, as the decode step runs it (3B shapes: 16 rows,
16 query heads, 2 K/V heads, head dim 128): programs per SM (hence splits), slots per block, pipeline depth, warps.

    python benchmarks/micro/decode_attention_sweep.py --lengths 512 1280 1536 --out attention_sweep.json

Each layer has its own K/V (a window of a cache 256 slots longer, as ``fast_decode`` hands it over), so 36 layers in
one CUDA graph read ~36x the K/V and L2 holds none of it between layers; µs per layer is the graph's time / 36. Every
setting's output is checked against ``one_token_attention`` first.

``--prefixes P ...``: instead of the sweep, the package's settings with and without ``shared`` (rows of a group read
the prompt's first P slots from the group's first row, as ``fast_decode`` passes them; the rows' prompt slots are
copies of that row's), per length and P < length:

    python benchmarks/micro/decode_attention_sweep.py --lengths 512 1280 --prefixes 340 1100 --out attention_shared.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from vlm_grpo.fastpath import decode_kernel
from vlm_grpo.fastpath.decode_attention import one_token_attention


def per_layer_us(fn, layers: int, replays: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return 1e3 * times[len(times) // 2] / layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1280, 1536])
    p.add_argument("--targets", type=int, nargs="+", default=[132, 264, 396, 792], help="programs aimed at")
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--prefixes", type=int, nargs="*", default=[], help="shared prompt slots (see the docstring)")
    p.add_argument("--group", type=int, default=8, help="rows per prompt with --prefixes")
    p.add_argument("--out", default="attention_sweep.json")
    args = p.parse_args()
    dev, dt, b, hkv, heads, d = torch.device("cuda"), torch.bfloat16, 16, 2, 16, 128
    default = (
        decode_kernel._TARGET_PROGRAMS,
        decode_kernel.BLOCK_S,
        decode_kernel._MAX_STAGES,
        decode_kernel._NUM_WARPS,
    )
    if args.prefixes:
        return shared_prefixes(args, dev, dt, b, hkv, heads, d)
    results = []
    for length in args.lengths:
        shape = (b, hkv, length + 256, d)
        caches = [
            (torch.randn(shape, device=dev, dtype=dt), torch.randn(shape, device=dev, dtype=dt))
            for _ in range(args.layers)
        ]
        query = torch.randn(b, heads, 1, d, device=dev, dtype=dt)
        mask = torch.ones(b, 1, 1, length + 256, dtype=torch.bool, device=dev)[..., :length]
        mask[:, ..., :7] = False
        views = [(k[:, :, :length], v[:, :, :length]) for k, v in caches]
        ref = one_token_attention(query, *views[0], mask, d**-0.5)
        for setting in itertools.product(args.targets, args.blocks, args.stages, args.warps):
            target, block, stages, warps = setting
            decode_kernel._TARGET_PROGRAMS, decode_kernel.BLOCK_S = target, block
            decode_kernel._MAX_STAGES, decode_kernel._NUM_WARPS = stages, warps
            try:
                out = decode_kernel._launch(query, *views[0], mask, d**-0.5)
                err = float((out.float() - ref.float()).abs().max())

                def run(views=views, query=query, mask=mask) -> None:
                    for k, v in views:
                        decode_kernel._launch(query, k, v, mask, d**-0.5)

                us = per_layer_us(run, args.layers)
            except Exception as e:  # e.g. shared memory
                err, us = None, None
                print(f"{setting}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            row = {"length": length, "target": target, "block": block, "stages": stages, "warps": warps,
                   "splits": decode_kernel.choose_splits(length, b * hkv)[0], "us_per_layer": us, "maxerr": err,
                   "default": setting == default}  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
        done = [r for r in results if r["length"] == length and r["us_per_layer"]]
        best = min(done, key=lambda r: r["us_per_layer"])
        base = next((r for r in done if r["default"]), None)
        print(f"[best] {length}: {json.dumps(best)} default: {base and base['us_per_layer']}", flush=True)
        decode_kernel._TARGET_PROGRAMS, decode_kernel.BLOCK_S, decode_kernel._MAX_STAGES, decode_kernel._NUM_WARPS = (
            default
        )
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=2)


def shared_prefixes(args, dev, dt, b, hkv, heads, d) -> None:
    """The package's kernel settings, each row reading its own prompt slots against reading its group's first row's."""
    results = []
    src = (torch.arange(b, device=dev, dtype=torch.int32) // args.group) * args.group
    for length in args.lengths:
        shape = (b, hkv, length + 256, d)
        for prefix in [p for p in args.prefixes if p < length]:
            caches = []
            for _ in range(args.layers):
                k, v = torch.randn(shape, device=dev, dtype=dt), torch.randn(shape, device=dev, dtype=dt)
                k[:, :, :prefix], v[:, :, :prefix] = k[src.long(), :, :prefix], v[src.long(), :, :prefix]
                caches.append((k[:, :, :length], v[:, :, :length]))
            query = torch.randn(b, heads, 1, d, device=dev, dtype=dt)
            mask = torch.ones(b, 1, 1, length + 256, dtype=torch.bool, device=dev)[..., :length]
            mask[:, ..., :7] = False
            shared = (src, torch.tensor(prefix, device=dev, dtype=torch.int32))
            ref = one_token_attention(query, *caches[0], mask, d**-0.5)
            row = {"length": length, "prefix": prefix, "group": args.group}
            for name, pair in (("own_rows", None), ("shared", shared)):
                out = decode_kernel._launch(query, *caches[0], mask, d**-0.5, shared=pair)
                row[f"{name}_maxerr"] = float((out.float() - ref.float()).abs().max())

                def run(caches=caches, query=query, mask=mask, pair=pair) -> None:
                    for k, v in caches:
                        decode_kernel._launch(query, k, v, mask, d**-0.5, shared=pair)

                row[f"{name}_us_per_layer"] = per_layer_us(run, args.layers)
            results.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
