"""What the decode step's kernel chain costs beyond reading its weights: 36 layers of a 3B decoder's matrix
work for 16 rows (norm, q|k|v, a stand-in for attention, o, norm, gate|up, SiLU-and-multiply, down), captured
in one CUDA graph, in variants that differ in who runs the GEMMs and whether kernels overlap their neighbours.

    python benchmarks/decode_chain_micro.py --out chain.json

Variants: ``cublas``: the GEMMs through ``F.linear``, the pointwise steps as Triton kernels; ``triton``: the GEMMs
through ``skinny_linear_micro``'s kernel; ``*_pdl``: every kernel that can (Triton ones) launched with
Programmatic Dependent Launch (Hopper): the next kernel starts while this one finishes and waits for its output
only where it reads it (the GEMMs load their first weight tile before that wait); ``compiled``/``compiled_pdl``:
the same layer as torch ops through ``torch.compile`` (inductor fuses the pointwise steps; ``triton.enable_pdl``
on or off), cuBLAS GEMMs. Reports microseconds per layer against the time to read the layer's weights once.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from skinny_linear_micro import graph_us, launch

H, QKV, INTER = 2048, 2560, 11008  # Qwen2.5-VL-3B's text decoder


@triton.jit
def _rms_kernel(x_ptr, y_ptr, K, stride_x, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < K, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / K + 1e-6)
    tl.store(y_ptr + row * K + offs, y.to(y_ptr.dtype.element_ty), mask=offs < K)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=offs < inter, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=offs < inter, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * inter + offs, y.to(y_ptr.dtype.element_ty), mask=offs < inter)


def rms(x: torch.Tensor, out: torch.Tensor, k: int, pdl: bool) -> None:
    extra = {"launch_pdl": True} if pdl else {}
    _rms_kernel[(x.shape[0],)](x, out, k, x.stride(0), BLOCK_K=triton.next_power_of_2(k), USE_PDL=pdl, **extra)


def silu_mul(x: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    extra = {"launch_pdl": True} if pdl else {}
    _silu_mul_kernel[(x.shape[0], triton.cdiv(INTER, 1024))](x, out, INTER, BLOCK=1024, USE_PDL=pdl, **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--bandwidth", type=float, default=3.35, help="TB/s")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    dt, dev, rows = torch.bfloat16, "cuda", args.rows

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device=dev, dtype=dt) * k**-0.5

    layers = [(weight(QKV, H), weight(H, H), weight(2 * INTER, H), weight(H, INTER)) for _ in range(args.layers)]
    x = torch.randn(rows, H, device=dev, dtype=dt)
    h, qkv, a, o = (torch.empty(rows, n, device=dev, dtype=dt) for n in (H, QKV, H, H))
    gu, m, y = (torch.empty(rows, n, device=dev, dtype=dt) for n in (2 * INTER, INTER, H))

    def eager(gemm: str, pdl: bool):
        def linear(inp, w, out):
            if gemm == "cublas":
                torch.mm(inp, w.t(), out=out)
            else:
                launch(inp, w, None, out, pdl=pdl)

        def step():
            src = x
            for wqkv, wo, wgu, wd in layers:
                rms(src, h, H, pdl)
                linear(h, wqkv, qkv)
                rms(qkv, a, H, pdl)  # stands in for attention: reads q|k|v, writes the o input
                linear(a, wo, o)
                rms(o, h, H, pdl)
                linear(h, wgu, gu)
                silu_mul(gu, m, pdl)
                linear(m, wd, y)
                src = y

        return step

    def layer_ops(src, wqkv, wo, wgu, wd):
        def norm(t):
            t32 = t.float()
            return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt)

        q = F.linear(norm(src), wqkv)
        o_ = F.linear(norm(q[:, :H]), wo)
        g = F.linear(norm(o_ + src), wgu)
        gate, up = g.split(INTER, dim=-1)
        return F.linear(F.silu(gate) * up, wd) + o_ + src

    def compiled(pdl: bool):
        fn = torch.compile(layer_ops, options={"triton.enable_pdl": pdl}, dynamic=False)

        def step():
            src = x
            for w in layers:
                src = fn(src, *w)

        return step

    floor_us = (QKV + H + 2 * INTER + INTER) * H * 2 / (args.bandwidth * 1e12) * 1e6
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "floor_us_per_layer": floor_us, "variants": {}}  # fmt: skip
    variants = {
        "cublas": lambda: eager("cublas", False),
        "cublas_pdl": lambda: eager("cublas", True),
        "triton": lambda: eager("triton", False),
        "triton_pdl": lambda: eager("triton", True),
        "compiled": lambda: compiled(False),
        "compiled_pdl": lambda: compiled(True),
    }
    # Outputs are not compared: 36 random layers with a SiLU-and-multiply each amplify bf16 rounding until two
    # correct variants disagree entirely. Each GEMM kernel is checked in skinny_linear_micro.py.
    for name, make in variants.items():
        try:
            step = make()
            us = graph_us(step, args.layers)
        except Exception as exc:
            results["variants"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(name, "failed:", results["variants"][name]["error"], flush=True)
            continue
        results["variants"][name] = {"us_per_layer": us, "x_floor": us / floor_us}
        print(f"{name:14s} {us:7.1f} us/layer  {us / floor_us:.2f}x floor", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
