"""A Triton kernel for the decode step's projections (a few rows times a weight) against cuBLAS (``F.linear``),
per projection of the shapes ``fast_decode`` runs. It measured about 3% of a token at one shape and slower at others,
so the package keeps cuBLAS.

    python benchmarks/micro/skinny_linear_micro.py --rows 16 --models 3b 7b --out skinny.json
    python benchmarks/micro/skinny_linear_micro.py --rows 16 --sweep --out sweep.json

The kernel: every program owns a strip of ``BLOCK_N`` output columns for all rows and walks the whole input
dimension, so every weight byte is read once, by hundreds of programs, with the bias and the cast in the same
pass; each output is one fp32 dot product (deterministic, no split-K). ``triton`` is the block shape chosen by
:func:`config`; ``--sweep`` times a grid of others.

Each shape gets enough distinct weights (at least 4) for one graph of launches to read >= 512 MB, so the 50 MB
L2 holds none of it; the launches are captured in one CUDA graph, as in the decode step, and the median of the
replays is taken. ``GB/s`` counts the weight bytes only; ``floor`` is the weight read at the card's bandwidth
(``--bandwidth`` TB/s). Every variant's output is checked against an fp64 product first (poisoned with NaN).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """y[:, strip] = x @ w[strip].T (+ b[strip]) for one strip of BLOCK_N output columns and all rows.

    ``USE_PDL`` (launched with ``launch_pdl=True``, Hopper): the first weight tile is loaded before waiting for the
    previous kernel, whose output ``x`` is, so the weight stream starts while that kernel finishes."""
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = 0
    if USE_PDL:  # the first tile peeled off: its weight load comes before the wait
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=col_ok & (ks[:, None] < K), other=0.0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok & (ks[None, :] < K), other=0.0)
        acc += tl.dot(x, w)
        start = BLOCK_K
    for k0 in range(start, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok & (k[None, :] < K), other=0.0)
        # The weight strip as (BLOCK_K, BLOCK_N): each column is one weight row, contiguous along k.
        w = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None], mask=col_ok & (k[:, None] < K), other=0.0)
        acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y, mask=row_ok & col_ok)


def config(rows: int, n: int, k: int) -> dict[str, int]:
    """Block shapes for ``rows`` x ``k`` times an ``n`` x ``k`` weight: a strip per program narrow enough for a few
    hundred programs; 4 pipeline stages within the 228 KB of shared memory."""
    block_m = max(16, triton.next_power_of_2(rows))
    wide = n > 8192
    return {"BLOCK_M": block_m, "BLOCK_N": 64 if wide else 16, "BLOCK_K": 256 if wide or block_m > 16 else 512,
            "num_warps": 4, "num_stages": 3 if block_m > 16 else 4}  # fmt: skip


def launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, pdl: bool = False, **cfg
) -> None:
    """The kernel on 2-D ``x`` (rows, k) into ``out`` (rows, n); ``cfg`` overrides :func:`config`."""
    rows, k = x.shape
    n = weight.shape[0]
    settings = {**config(rows, n, k), **cfg, **({"USE_PDL": True, "launch_pdl": True} if pdl else {})}
    grid = (triton.cdiv(n, settings["BLOCK_N"]),)
    _skinny_kernel[grid](
        x, weight, bias if bias is not None else weight, out, rows, n, k,
        x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, **settings,
    )  # fmt: skip


# (name, out features, in features, bias): Qwen2.5-VL-3B and -7B's decoder projections, fused as the decode fuses.
SHAPES = {
    "3b": [("qkv", 2560, 2048, True), ("o", 2048, 2048, False), ("gate_up", 22016, 2048, False),
           ("down", 2048, 11008, False), ("head", 151936, 2048, False)],
    "7b": [("qkv", 4608, 3584, True), ("o", 3584, 3584, False), ("gate_up", 37888, 3584, False),
           ("down", 3584, 18944, False), ("head", 152064, 3584, False)],
}  # fmt: skip


def graph_us(step, units: int, replays: int = 20) -> float:
    """Median microseconds per unit over ``replays`` replays of ``step`` captured in one CUDA graph (``units``
    pieces of work per step), after two warm-up runs on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / units)
    return statistics.median(times)


def timed(fn, weights) -> float:
    """Microseconds per launch of ``fn`` over every weight in turn (one graph)."""

    def step() -> None:
        for w in weights:
            fn(w)

    return graph_us(step, len(weights))


def sweep_configs() -> list[tuple[str, dict]]:
    grid = itertools.product((16, 32, 64, 128), (128, 256, 512), ((4, 3), (4, 4), (4, 6), (8, 4)))  # 48
    return [
        (f"n{bn}_k{bk}_w{warps}_s{stages}", {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages})
        for bn, bk, (warps, stages) in grid
    ]


LAYOUTS = ("nn", "tall", "lt")


def layout_variants(x: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """cuBLAS on the same product laid out otherwise (``--layouts``): each entry maps a weight (n, k) to the
    operand it is given (built once, as the decode builds its fused copies) and that operand to the output (rows,
    n), possibly as a transposed view. ``nn``: the weight stored (k, n); ``tall``: ``w @ x.T``, n output rows and
    ``rows`` columns; ``lt``: ``F.linear`` with cuBLASLt preferred for every product."""
    xt = x.t().contiguous()
    col = None if bias is None else bias[:, None]

    def tall(w: torch.Tensor) -> torch.Tensor:
        return (torch.mm(w, xt) if col is None else torch.addmm(col, w, xt)).t()

    def nn(wt: torch.Tensor) -> torch.Tensor:
        return x @ wt if bias is None else torch.addmm(bias, x, wt)

    return {"nn": (lambda w: w.t().contiguous(), nn), "tall": (lambda w: w, tall)}


def measure(
    model: str, name: str, n: int, k: int, has_bias: bool, rows: int, sweep: bool, bandwidth: float,
    layouts: bool = False,
) -> dict:  # fmt: skip
    """One projection shape: cuBLAS, the package's blocks and (``sweep``) the grid; each checked, then timed."""
    dtype = torch.bfloat16
    nbytes = n * k * 2
    layers = max(4, -(-512 * 2**20 // nbytes))  # >= 512 MB per graph: L2 (50 MB) holds none of it
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * k**-0.5 for _ in range(layers)]
    bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    ref = (x.double() @ weights[0].double().T + (0 if bias is None else bias.double())).float()
    out = torch.empty(rows, n, device="cuda", dtype=dtype)
    row = {"model": model, "proj": name, "rows": rows, "n": n, "k": k, "bias": has_bias,
           "floor_us": nbytes / (bandwidth * 1e12) * 1e6, "config": config(rows, n, k),
           "variants": {}}  # fmt: skip
    for label, cfg in [("cublas", None), ("triton", {}), *(sweep_configs() if sweep else [])]:
        try:
            if cfg is None:
                got = F.linear(x, weights[0], bias)
            else:
                out.fill_(float("nan"))  # every element must be written
                launch(x, weights[0], bias, out, **cfg)
                got = out
            err = ((got.float() - ref).norm() / ref.norm()).item()  # before the timing overwrites ``out``
            if cfg is None:
                us = timed(lambda w: F.linear(x, w, bias), weights)
            else:
                us = timed(lambda w, cfg=cfg: launch(x, w, bias, out, **cfg), weights)
        except Exception as exc:  # a block shape the card cannot hold (shared memory): recorded, skipped
            row["variants"][label] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            continue
        row["variants"][label] = {"us": us, "GBps": nbytes / us / 1e3, "rel_err": err}
    for label, (prepare, product) in (layout_variants(x, bias) if layouts else {}).items():
        operands = [prepare(w) for w in weights]
        err = ((product(operands[0]).float() - ref).norm() / ref.norm()).item()
        row["variants"][label] = {"us": timed(product, operands), "rel_err": err}
        row["variants"][label]["GBps"] = nbytes / row["variants"][label]["us"] / 1e3
        del operands
    if layouts:  # cuBLASLt for every product, the weight as the package holds it
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            err = ((F.linear(x, weights[0], bias).float() - ref).norm() / ref.norm()).item()
            us = timed(lambda w: F.linear(x, w, bias), weights)
            row["variants"]["lt"] = {"us": us, "GBps": nbytes / us / 1e3, "rel_err": err}
        finally:
            torch.backends.cuda.preferred_blas_library(previous)
    ok = {key: v for key, v in row["variants"].items() if "us" in v and v["rel_err"] < 2e-2}
    row["best"] = min(ok, key=lambda key: ok[key]["us"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[16])
    parser.add_argument("--models", nargs="+", default=["3b"], choices=sorted(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also time a grid of block shapes")
    parser.add_argument("--bandwidth", type=float, default=3.35, help="TB/s (H100 SXM 3.35, H200 4.8)")
    parser.add_argument("--layouts", action="store_true", help="also time cuBLAS on other layouts (nn, tall, lt)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for model, rows in itertools.product(args.models, args.rows):
        for name, n, k, has_bias in SHAPES[model]:
            row = measure(model, name, n, k, has_bias, rows, args.sweep, args.bandwidth, args.layouts)
            results.append(row)
            cub, pkg, best = row["variants"]["cublas"], row["variants"].get("triton", {}), row["best"]
            print(
                f"{model} {name:8s} rows {rows:3d} {n}x{k}: floor {row['floor_us']:.1f} us | cublas {cub['us']:.1f} "
                f"({cub['GBps']:.0f} GB/s) | triton {pkg.get('us', float('nan')):.1f} "
                f"({pkg.get('GBps', float('nan')):.0f} GB/s, err {pkg.get('rel_err', float('nan')):.1e}) | "
                f"best {best} {row['variants'][best]['us']:.1f}"
                + "".join(f" | {key} {v['us']:.1f}" for key, v in row["variants"].items() if key in LAYOUTS),
                flush=True,
            )
            torch.cuda.empty_cache()
    if args.out:
        summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
