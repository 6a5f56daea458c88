"""The decode step's MLP (gate and up, SiLU-and-multiply, down) as two Triton kernels on the live weights.

At decode a batch is ~16 rows, so the MLP is three matrix-vector products bound by reading ~3/4 of a layer's
weights. As cuBLAS GEMMs (gate|up fused, down split over K plus its reduction) with a SiLU-and-multiply kernel
between, they read those weights at ~65% of an H100's bandwidth: 61-65 us a layer against 40.4 us to read them
once (Qwen2.5-VL-3B, 16 rows, 36 layers in one CUDA graph; ``benchmarks/micro/decode_mlp_micro.py``). Two kernels
shaped for a few rows take 51.5 us:

* ``_gate_up_kernel``: two programs per SM, each over one contiguous strip of intermediate columns, reads its gate
  and up rows straight from the live weights (no fused copy) and writes the SiLU-and-multiply, rounded as the
  eager module rounds it (gate, up, SiLU and the product each in the weights' dtype);
* ``_down_kernel``: each program takes ``BN2`` output columns of down over one of ``DOWN_SLICES`` slices of the
  intermediate dimension and writes their fp32 partial sums. Over the whole dimension, each program would also
  read the whole activation from L2, as many bytes as its weight strip: that version ran at 1.55x its weight read
  (21 us), this one at 1.36x (18.3 us). No reduction kernel: :func:`fused_mlp` adds the slices in order and rounds
  once, and under torch.compile inductor does that inside the kernel that reads the MLP's output next (the residual
  add and the next norm). In the decode loop the slices take 5% off a token against down over the whole dimension.

Every output is fp32 dot products in a fixed order, added in a fixed order: deterministic. (One launch with a grid
barrier between the phases was measured too: no faster than two, so not kept.)

The kernels stand in for a decoder layer's MLP module during a generation call (``decode_fusion`` swaps it in,
as it swaps in the fused projections): only for the plain ``gate_proj``/``up_proj``/``down_proj`` + SiLU MLP of
the supported families, with bias-free ``nn.Linear`` projections in one dtype, and for calls of at most
``ROWS_MAX`` rows. Under PEFT, where each projection is a plain Linear or a LoRA layer ``decode_fusion`` can fold
(no dropout), they run on its per-call copies with the adapters folded in; otherwise the fused GEMM path stays.
``KERNEL = False`` turns them off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # the module still imports; stand_in_for says None
    triton = None

KERNEL = True  # on a GPU with Triton: the decode step's MLP as these kernels; False: the fused gate|up GEMM path
# Rows a decode step may have for these kernels (H100, 3B: faster than the GEMM path at 8, 16 and 32 rows, slower
# at 48 and 64, where all rows' accumulators and tiles crowd the SM). decode_fusion plans by the call's rows; more
# rows reaching the stand-in (a prefill) run the module itself.
ROWS_MAX = 32
# down: output columns per program, K columns per block (halved for fp32, so the pipelined tiles fit shared memory),
# slices of K (one program each per column strip; fp32 partial sums, added in order). Read where a step is traced.
BN2, BK2, DOWN_SLICES = 32, 128, 4
_INTERPRETED_PROGRAMS = 4  # the "SM count" on CPU (Triton's interpreter): several programs in phase 1


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        x_ptr, wg_ptr, wu_ptr, m_ptr, M, H, INTER, stride_x, stride_m, PAIRS,
        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """m[:, strip] = silu(x @ gate[strip].T) * (x @ up[strip].T) for this program's ``PAIRS`` columns, each
        product rounded to m's dtype as the eager module rounds it."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        local = tl.arange(0, BLOCK_P)
        p = tl.program_id(0) * PAIRS + local
        p_ok = (local < PAIRS) & (p < INTER)
        acc_g = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
        for k0 in range(0, H, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < H
            xb = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = p_ok[None, :] & k_ok[:, None]  # the weight strips as (BK, BLOCK_P): rows contiguous along k
            wg = tl.load(wg_ptr + p[None, :].to(tl.int64) * H + k[:, None], mask=w_mask, other=0.0)
            wu = tl.load(wu_ptr + p[None, :].to(tl.int64) * H + k[:, None], mask=w_mask, other=0.0)
            acc_g = tl.dot(xb, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xb, wu, acc_u, input_precision=PRECISION)
        dtype = m_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        tl.store(
            m_ptr + rows[:, None] * stride_m + p[None, :], (act * up).to(dtype), mask=row_ok[:, None] & p_ok[None, :]
        )

    @triton.jit
    def _down_kernel(
        m_ptr, wd_ptr, part_ptr, M, H, INTER, stride_m, per,
        BLOCK_M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """part[s, :, cols] = m[:, K slice s] @ down[cols, K slice s].T in fp32, for this program's ``BN`` output
        columns and slice ``s`` (``per`` columns of m, a whole number of ``BK`` blocks): one dot product per
        (slice, output) in a fixed order; the caller adds the slices in a fixed order too (deterministic)."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        c = tl.program_id(0) * BN + tl.arange(0, BN)
        c_ok = c < H
        s = tl.program_id(1)
        acc = tl.zeros((BLOCK_M, BN), dtype=tl.float32)
        for k0 in range(s * per, tl.minimum(s * per + per, INTER), BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < INTER
            mb = tl.load(m_ptr + rows[:, None] * stride_m + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = c_ok[None, :] & k_ok[:, None]
            wd = tl.load(wd_ptr + c[None, :].to(tl.int64) * INTER + k[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(mb, wd, acc, input_precision=PRECISION)
        tl.store(part_ptr + (s * M + rows[:, None]) * H + c[None, :], acc, mask=row_ok[:, None] & c_ok[None, :])


def down_slices(inter: int, block: int, slices: int) -> tuple[int, int]:
    """(slices, columns per slice) of down's K (the intermediate dimension): up to ``slices``, each a whole number
    of ``block`` columns, none empty."""
    per = -(-inter // slices)
    per = -(-per // block) * block  # up to whole blocks: then fewer slices may cover K
    return -(-inter // per), per


def switches() -> tuple:
    """The module's settings a captured decode step bakes in (part of a kept workspace's key)."""
    return KERNEL, BN2, BK2, DOWN_SLICES


def _settings(x: torch.Tensor) -> dict:
    """Down's settings for ``x``'s dtype, from the module's (fp32: half the K blocks)."""
    return {"BN2": BN2, "BK2": BK2 // 2 if x.element_size() >= 4 else BK2, "slices": DOWN_SLICES}


def strip(inter: int, programs: int) -> int:
    """Intermediate columns per phase-1 program: ``programs`` strips, none wider than 128."""
    return min(-(-inter // programs), 128)


def stages(stage_bytes: int, budget: int) -> int:
    """Pipeline depth: up to 4, as many stages of ``stage_bytes`` as ``budget`` bytes of shared memory hold
    (Triton keeps up to one tile per stage there), at least 1."""
    return max(1, min(4, budget // stage_bytes))


def _run(kernel: Any, grid: tuple[int], args: tuple, depth: int, **kwargs: Any) -> None:
    """Launch at pipeline depth ``depth``, one shallower each time shared memory cannot hold it (checked before
    the launch, so a CUDA graph being captured sees only the launch that fits)."""
    while True:
        try:
            kernel[grid](*args, num_stages=depth, **kwargs)
            return
        except OutOfResources:
            if depth == 1:
                raise
            depth -= 1


def _device(x: torch.Tensor) -> tuple[int, int]:
    """(SMs, shared memory a program may use); on CPU (Triton's interpreter) a few "SMs" and no limit."""
    if not x.is_cuda:
        return _INTERPRETED_PROGRAMS, 1 << 30
    props = torch.cuda.get_device_properties(x.device)
    return props.multi_processor_count, props.shared_memory_per_multiprocessor - 1024  # the opt-in per block


def _launch(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, tuning: dict | None = None
) -> torch.Tensor:
    """The fp32 partial sums of ``down(silu(gate(x)) * up(x))`` over slices of K, (slices, ..., hidden), for ``x``
    (..., hidden), contiguous: their sum over the first dimension (in order) is the MLP's output. ``tuning``
    (benchmarks): ``programs`` (phase 1's; default two per SM), ``BK1``, ``BN2``, ``BK2``, ``slices`` (default: the
    module's), ``num_stages`` (default: as deep as fits, up to 4); ``only``: "gate_up" or "down" to launch that
    kernel alone (for its time: the output is then meaningless)."""
    x2 = x.reshape(-1, x.size(-1))
    rows, hidden = x2.shape
    inter = gate.size(0)
    sms, smem = _device(x)
    size = x.element_size()
    t = {"programs": 2 * sms, "BK1": 64 if size >= 4 else 128, **_settings(x), **(tuning or {})}
    pairs = strip(inter, t["programs"])
    block_m, block_p = max(16, triton.next_power_of_2(rows)), triton.next_power_of_2(pairs)
    slices, per = down_slices(inter, t["BK2"], t["slices"])
    m = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    part = torch.empty(slices, rows, hidden, dtype=torch.float32, device=x.device)
    common = {"BLOCK_M": block_m, "PRECISION": "ieee" if size >= 4 else "tf32", "num_warps": 4}
    if t.get("only") != "down":
        depth = t.get("num_stages") or stages((2 * block_p + block_m) * t["BK1"] * size, smem)
        args = (x2, gate, up, m, rows, hidden, inter, x2.stride(0), m.stride(0), pairs)
        _run(_gate_up_kernel, (-(-inter // pairs),), args, depth, BLOCK_P=block_p, BK=t["BK1"], **common)
    if t.get("only") != "gate_up":
        depth = t.get("num_stages") or stages((block_m + t["BN2"]) * t["BK2"] * size, smem)
        args = (m, down, part, rows, hidden, inter, m.stride(0), per)
        _run(_down_kernel, (-(-hidden // t["BN2"]), slices), args, depth, BN=t["BN2"], BK=t["BK2"], **common)
    return part.view(slices, *x.shape[:-1], hidden)


if triton is not None:
    # Opaque to torch.compile: inductor calls it as it is (a CUDA graph captures its two launches).
    @torch.library.custom_op("vlm_grpo::decode_mlp", mutates_args=())
    def _decode_mlp_op(
        x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, bn2: int, bk2: int, slices: int
    ) -> torch.Tensor:
        return _launch(x, gate, up, down, {"BN2": bn2, "BK2": bk2, "slices": slices})

    @_decode_mlp_op.register_fake
    def _(x, gate, up, down, bn2, bk2, slices):
        slices = down_slices(gate.size(0), bk2, slices)[0]
        return x.new_empty(slices, *x.shape[:-1], down.size(0), dtype=torch.float32)


def fused_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The MLP's output through the kernels, in ``x``'s dtype: the slices' partial sums added in order and rounded
    once, as one fp32 dot product would be. Under torch.compile inductor adds them inside the kernel that reads the
    output next (the residual add and the next norm): no launch of its own."""
    t = _settings(x)
    return torch.ops.vlm_grpo.decode_mlp(x, gate, up, down, t["BN2"], t["BK2"], t["slices"]).sum(0).to(x.dtype)


def _on_gpu(*tensors: torch.Tensor) -> bool:
    """Where the kernel runs (tests on CPU replace this while Triton's interpreter runs it)."""
    return all(t.is_cuda for t in tensors)


Weights = Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class FusedMLP(nn.Module):
    """Stands in for a decoder layer's MLP module during a generation call: the kernels on its live weights, or on
    what ``weights`` returns (``decode_fusion``'s copies with LoRA adapters folded in)."""

    def __init__(self, mlp: nn.Module, weights: Weights | None = None) -> None:
        super().__init__()
        self.mlp = mlp  # a child: code that lists the decoder's parameters during the call still finds its weights
        self.weights = weights or (lambda: (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.weights()
        if x.numel() > ROWS_MAX * x.size(-1) or not x.is_contiguous() or x.dtype != gate.dtype:
            return self.mlp(x)
        return fused_mlp(x, gate, up, down)


def silu_mlp(module: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module] | None:
    """(gate_proj, up_proj, down_proj) of a plain SiLU MLP (those three, a SiLU ``act_fn``, nothing else), or None."""
    if set(dict(module.named_children())) != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        return None
    return (module.gate_proj, module.up_proj, module.down_proj) if _is_silu(module.act_fn) else None


def kernel_takes(gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> bool:
    """Whether the kernels compute with these projections' weights (or same-shaped copies): bias-free, 2-D, one
    floating dtype, contiguous, on a GPU with Triton, and the switch on."""
    weights = [gate.weight, up.weight, down.weight]
    if not KERNEL or triton is None or any(m.bias is not None for m in (gate, up, down)):
        return False
    if any(w.dim() != 2 for w in weights):  # e.g. ZeRO-3's partitioned placeholders
        return False
    if not _on_gpu(*weights) or len({(w.dtype, w.device) for w in weights}) != 1:
        return False
    if gate.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    inter, hidden = gate.weight.shape
    if up.weight.shape != (inter, hidden) or down.weight.shape != (hidden, inter):
        return False
    return all(w.is_contiguous() for w in weights)


def stand_in_for(module: nn.Module) -> FusedMLP | None:
    """A :class:`FusedMLP` on the live weights if ``module`` is a plain SiLU MLP of plain ``nn.Linear`` projections
    that the kernels take, else None (a PEFT-wrapped MLP: see ``decode_fusion``)."""
    projections = silu_mlp(module)
    if projections is None or any(type(m) is not nn.Linear for m in projections):
        return None
    return FusedMLP(module) if kernel_takes(*projections) else None


def _is_silu(act: nn.Module) -> bool:
    """``nn.SiLU`` or transformers' ``SiLUActivation`` (what ``ACT2FN["silu"]`` gives), nothing derived."""
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # an older transformers: ACT2FN["silu"] is nn.SiLU
        SiLUActivation = nn.SiLU
    return type(act) in (nn.SiLU, SiLUActivation)
