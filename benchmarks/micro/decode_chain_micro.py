"""What the decode step's kernel chain costs beyond reading its weights: 36 layers of a 3B decoder's matrix
work for 16 rows (norm, q|k|v, a stand-in for attention, o, norm, gate|up, SiLU-and-multiply, down), captured
in one CUDA graph, in variants that differ in who runs the GEMMs and whether kernels overlap their neighbours.

    python benchmarks/micro/decode_chain_micro.py --out chain.json

Variants: ``cublas``: the GEMMs through ``F.linear``, the pointwise steps as Triton kernels; ``triton``: the GEMMs
through ``skinny_linear_micro``'s kernel; ``*_pdl``: every kernel that can (Triton ones) launched with
Programmatic Dependent Launch (Hopper): the next kernel starts while this one finishes and waits for its output
only where it reads it (the GEMMs load their first weight tile before that wait); ``compiled``/``compiled_pdl``:
the same layer as torch ops through ``torch.compile`` (inductor fuses the pointwise steps; ``triton.enable_pdl``
on or off), cuBLAS GEMMs; ``l2_*`` (``--prefetch``): the ``cublas`` chain while a second stream in the same graph
asks L2 (50 MB on an H100) for weights before their GEMM reads them, so that HBM keeps streaming while the
layer's small kernels run: ``l2_gu<MB>``: the first MB of gate|up's weight when the layer starts; ``..._next``:
also the next layer's q|k|v and o weights when down starts; ``bulk``: Hopper's ``cp.async.bulk.prefetch.L2``
(32 KB a request), ``lines``: ``prefetch.global.L2::evict_last`` per 128-byte line. Reports microseconds per
layer against the time to read the layer's weights once.
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


@triton.jit
def _bulk_prefetch_kernel(w_ptr, sink_ptr, nbytes, CHUNK: tl.constexpr):
    """32 requests of CHUNK bytes per iteration, one per thread of one warp (fire and forget)."""
    offs = tl.arange(0, 32).to(tl.int64) * CHUNK
    step = tl.num_programs(0).to(tl.int64) * 32 * CHUNK
    done = tl.zeros((32,), dtype=tl.int32)
    for start in range(tl.program_id(0).to(tl.int64) * 32 * CHUNK, nbytes, step):
        done += tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;", "=r,l,r",
            [w_ptr + start + offs, tl.full((32,), CHUNK, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    tl.store(sink_ptr + tl.program_id(0) * 32 + tl.arange(0, 32), done)


@triton.jit
def _line_prefetch_kernel(w_ptr, sink_ptr, nbytes, BLOCK: tl.constexpr):
    """One ``prefetch.global.L2::evict_last`` per 128-byte line."""
    offs = tl.arange(0, BLOCK).to(tl.int64) * 128
    step = tl.num_programs(0).to(tl.int64) * BLOCK * 128
    done = tl.zeros((BLOCK,), dtype=tl.int32)
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK * 128, nbytes, step):
        done += tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n mov.u32 $0, 0;", "=r,l",
            [w_ptr + start + offs], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    tl.store(sink_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), done)


SINK = {}


def prefetch(w: torch.Tensor, nbytes: int, how: str, programs: int = 4) -> None:
    """Ask L2 for the first ``nbytes`` of ``w`` (whole MB) on the current stream."""
    nbytes = min(nbytes, w.numel() * w.element_size()) // 2**20 * 2**20
    flat = w.view(-1).view(torch.uint8)
    if w.device not in SINK:
        SINK[w.device] = torch.zeros(programs * 1024, dtype=torch.int32, device=w.device)
    if how == "bulk":
        _bulk_prefetch_kernel[(programs,)](flat, SINK[w.device], nbytes, CHUNK=32768, num_warps=1)
    else:
        _line_prefetch_kernel[(programs,)](flat, SINK[w.device], nbytes, BLOCK=1024, num_warps=4)


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
    parser.add_argument("--prefetch", type=int, nargs="*", default=[], help="gate|up MB to prefetch (l2_* variants)")
    parser.add_argument("--only_prefetch", action="store_true", help="only cublas and the l2_* variants")
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

    def l2(mb: int, how: str, ahead: bool):
        """The cublas chain with a second stream asking L2 for weights ahead of their GEMMs."""

        def linear(inp, w, out):
            torch.mm(inp, w.t(), out=out)

        def handoff(side: torch.cuda.Stream) -> None:
            event = torch.cuda.Event()
            event.record()
            side.wait_event(event)

        def step():
            side = torch.cuda.Stream()
            src = x
            for i, (wqkv, wo, wgu, wd) in enumerate(layers):
                handoff(side)
                with torch.cuda.stream(side):
                    prefetch(wgu, mb * 2**20, how)
                rms(src, h, H, False)
                linear(h, wqkv, qkv)
                rms(qkv, a, H, False)
                linear(a, wo, o)
                rms(o, h, H, False)
                linear(h, wgu, gu)
                silu_mul(gu, m, False)
                if ahead and i + 1 < len(layers):
                    handoff(side)
                    with torch.cuda.stream(side):
                        prefetch(layers[i + 1][0], 2**30, how)
                        prefetch(layers[i + 1][1], 2**30, how)
                linear(m, wd, y)
                src = y
            torch.cuda.current_stream().wait_stream(side)

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
    if args.only_prefetch:
        variants = {"cublas": variants["cublas"]}
    for mb in args.prefetch:
        for how in ("bulk", "lines"):
            variants[f"l2_gu{mb}_{how}"] = lambda mb=mb, how=how: l2(mb, how, False)
            variants[f"l2_gu{mb}_next_{how}"] = lambda mb=mb, how=how: l2(mb, how, True)
        variants["cublas_again"] = variants["cublas"]
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
