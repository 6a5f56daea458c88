"""The decode step's MLP (gate and up, SiLU-and-multiply, down) as the package's two Triton kernels
(``vlm_grpo.fastpath.decode_mlp``), against the chain it replaces (cuBLAS on the fused gate|up copy, a
SiLU-and-multiply, cuBLAS on down), for 16 rows.

    python benchmarks/micro/decode_mlp_micro.py --out mlp.json
    python benchmarks/micro/decode_mlp_micro.py --sweep --out mlp_sweep.json

Why: a decode token's GEMMs run at 1.5x their weight read kernel by kernel (measured with the decode profile of
``decode_lengths.py --profile``). The kernels: phase 1, two programs per SM over contiguous strips of intermediate
columns, their gate and up rows read straight from the live weights (no fused copy), the SiLU-and-multiply written
to a scratch buffer; phase 2, each program ``BN2`` output columns of down over one of ``slices`` slices of the
intermediate dimension, written as fp32 partial sums (in a decode step, inductor adds them, in order, inside the
next kernel: the timings here are the two launches; the check adds them). ``--sweep`` times down's block shapes,
slices and pipeline depths.

Roundings follow the eager module: gate and up rounded to the weight dtype, SiLU rounded, the product rounded.
The outputs are checked against an fp64 product (relative error) and the chain's output before any timing; 36
layers of distinct weights (4.9 GB at 3B) are captured in one CUDA graph (L2 holds none of it); medians of the
replays; ``floor`` is the weight read at ``--bandwidth`` TB/s. Each kernel is also timed alone against its
cuBLAS GEMM.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
import triton
from skinny_linear_micro import graph_us

from vlm_grpo.fastpath.decode_mlp import _launch

SHAPES = {"3b": (2048, 11008), "7b": (3584, 18944)}  # hidden, intermediate (Qwen2.5-VL)


def chain(x, w_gu, wd, inter):
    """The package's decode MLP today: cuBLAS on the fused gate|up copy, SiLU-and-multiply, cuBLAS on down."""
    gu = F.linear(x, w_gu)
    gate, up = gu.split(inter, dim=-1)
    return F.linear(F.silu(gate) * up, wd)


def tunings(sweep: bool, sms: int) -> list[dict]:
    """The package's settings (empty), and with ``sweep`` other strips, block shapes and pipeline depths."""
    if not sweep:
        return [{}]
    grid = itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (3, 4))
    return [{}] + [{"BN2": bn2, "BK2": bk2, "slices": ks, "num_stages": st} for bn2, bk2, ks, st in grid]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="3b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--bandwidth", type=float, default=3.35, help="TB/s")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    hidden, inter = SHAPES[args.model]
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=dt) * k**-0.5

    layers = []
    for _ in range(args.layers):
        wg, wu = weight(inter, hidden), weight(inter, hidden)
        layers.append((wg, wu, torch.cat([wg, wu]), weight(hidden, inter)))
    x = torch.randn(args.rows, 1, hidden, device=dev, dtype=dt)
    m = torch.randn(args.rows, 1, inter, device=dev, dtype=dt)
    floor_us = 3 * hidden * inter * 2 / (args.bandwidth * 1e12) * 1e6
    wg, wu, w_gu, wd = layers[0]
    x64 = x.double()
    ref = (F.silu(x64 @ wg.double().T) * (x64 @ wu.double().T)) @ wd.double().T
    got_chain = chain(x, w_gu, wd, inter)

    def rel(t: torch.Tensor, to: torch.Tensor = ref) -> float:
        return ((t.double() - to.double()).norm() / to.double().norm()).item()

    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "model": args.model, "rows": args.rows, "floor_us_per_layer": floor_us, "variants": {}}  # fmt: skip

    def record(name: str, step, err: float | None, extra: dict | None = None) -> None:
        us = graph_us(step, args.layers)
        results["variants"][name] = {"us_per_layer": us, "x_floor": us / floor_us, "rel_err": err, **(extra or {})}
        print(f"{name:72s} {us:7.1f} us/layer  {us / floor_us:.2f}x floor  err {err}", flush=True)

    def chain_step():
        src = x
        for _, _, w_gu_i, wd_i in layers:
            src = chain(src, w_gu_i, wd_i, inter)

    def kernel_step(tuning: dict):
        def step():  # the two launches per layer (the slices' sum is fused into the next kernel in a decode step)
            for wg_i, wu_i, _, wd_i in layers:
                _launch(x, wg_i, wu_i, wd_i, tuning)

        return step

    record("chain (cuBLAS, fused gate|up copy, SiLU, down)", chain_step, rel(got_chain))
    # Each half alone (floors: 2/3 and 1/3 of the layer's): cuBLAS's GEMM against the kernel
    record("  gate|up GEMM alone (cuBLAS)", lambda: [F.linear(x, w[2]) for w in layers], None)
    record("  gate|up + SiLU kernel alone", kernel_step({"only": "gate_up"}), None)
    record("  down GEMM alone (cuBLAS)", lambda: [F.linear(m, w[3]) for w in layers], None)
    record("  down kernel alone", lambda: [_launch(x, w[0], w[1], w[3], {"only": "down"}) for w in layers], None)
    for tuning in tunings(args.sweep, sms):
        name = f"kernel {tuning or '(package)'}"
        try:
            out = _launch(x, wg, wu, wd, tuning).sum(0).to(dt)
            record(name, kernel_step(tuning), rel(out), {"vs_chain": rel(out, got_chain), "tuning": tuning})
        except Exception as exc:
            results["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(name, "failed:", results["variants"][name]["error"], flush=True)
    record("chain again", chain_step, rel(got_chain))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
