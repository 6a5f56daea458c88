"""The decode step's MLP as two Triton kernels (``fastpath.decode_mlp``), on CPU through Triton's interpreter."""

from __future__ import annotations

import json

import pytest

from interpreted import check_decode_parity, python_runs

# name: (dtype, rows, hidden, intermediate); 8 phase-1 programs on CPU (strips of 25, 12, 13, 12 columns);
# down: 4-10 programs
CASES = {
    "f32_rows5": ("float32", 5, 64, 200),
    "f32_one_row_wide_down": ("float32", 1, 160, 96),  # 10 phase-2 programs, more than phase 1's 8
    "f16_rows16": ("float16", 16, 64, 100),
    "f16_rows16_long_down": ("float16", 16, 64, 300),  # down in 3 slices of K, the last one short
    "f32_rows3_odd_hidden": ("float32", 3, 48, 90),  # hidden not a power of two: masked K blocks
}
# Largest error relative to the output's largest value, measured (Triton interpreter, CPU): float32 3.0e-7,
# float16 4.3e-5 (f16_rows16_long_down: three slices of K summed in fp32, then rounded once).
TOLERANCE = {"float32": 1e-6, "float16": 1e-4}

_RUN_CASES = r"""
import json, sys
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP
from vlm_grpo.fastpath import decode_mlp

decode_mlp._on_gpu = lambda *tensors: True  # the interpreter runs the kernel on CPU tensors
results = {}
for name, (dtype, rows, hidden, inter) in json.loads(sys.argv[1]).items():
    torch.manual_seed(len(results))
    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    mlp = Qwen2MLP(config).to(getattr(torch, dtype))
    fused = decode_mlp.stand_in_for(mlp)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    x = torch.randn(rows, 1, hidden).to(mlp.gate_proj.weight.dtype)  # (rows, one token, hidden), as a decode step
    with torch.no_grad():
        ref, out = mlp(x), fused(x)
        # control: gate and up trade places (the kernel must tell them apart)
        swapped = decode_mlp.fused_mlp(x, mlp.up_proj.weight, mlp.gate_proj.weight, mlp.down_proj.weight)
    scale = ref.float().abs().max().item()
    results[name] = {
        "stand_in": type(fused).__name__,
        "shape_ok": out.shape == ref.shape and out.dtype == ref.dtype,
        "err": (out.float() - ref.float()).abs().max().item() / scale,
        "swapped_err": (swapped.float() - ref.float()).abs().max().item() / scale,
        "programs": [-(-inter // decode_mlp.strip(inter, 2 * decode_mlp._INTERPRETED_PROGRAMS)),
                     -(-hidden // decode_mlp.BN2), decode_mlp._launch(x, *weights).size(0)],
    }
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    pytest.importorskip("triton")
    out = python_runs(_RUN_CASES, [(json.dumps(CASES),)], interpret=True)[0]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_computes_the_module(interpreted: dict[str, dict], name: str) -> None:
    """``down(silu(gate(x)) * up(x))`` as the eager module computes it; with gate and up swapped, far from it."""
    dtype = CASES[name][0]
    result = interpreted[name]
    assert result["stand_in"] == "FusedMLP"
    assert result["shape_ok"]
    assert result["err"] < TOLERANCE[dtype], result
    assert result["swapped_err"] > 100 * TOLERANCE[dtype], result


def test_the_cases_split_the_work_over_several_programs(interpreted: dict[str, dict]) -> None:
    """[phase-1 programs, down's column strips, down's slices of K]."""
    assert interpreted["f32_rows5"]["programs"] == [8, 2, 4]  # K 200 in 64-column blocks: slices of 64
    assert interpreted["f32_one_row_wide_down"]["programs"] == [8, 5, 2]
    assert interpreted["f16_rows16_long_down"]["programs"] == [8, 2, 3]  # K 300 in 128-column blocks


def test_strip() -> None:
    """Phase 1's strips: as many as programs asked for where none is wider than 128 columns, every column covered;
    the pipeline as deep as shared memory allows."""
    from vlm_grpo.fastpath.decode_mlp import stages, strip

    assert strip(11008, 264) == 42  # Qwen2.5-VL-3B on an H100, two programs per SM: 263 strips
    assert strip(18944, 264) == 72  # 7B
    assert strip(18944, 132) == 128  # one per SM: 148 strips of at most 128
    # (2 x 64 strip rows + 16 rows) x 128 K x 2 bytes a stage: 4 stages on an H100 (227 KB), 2 on an A100's 163
    assert stages(36864, 232448) == 4 and stages(69632, 166912) == 2
    assert stages(81920, 232448) == 2  # down at 64 rows: (64 + 16) x 512 x 2 bytes; 3 stages do not fit (measured)
    assert stages(10**6, 1000) == 1
    for inter, sms in ((200, 8), (11008, 114), (14336, 132), (7, 3), (1, 132)):
        pairs = strip(inter, sms)
        programs = -(-inter // pairs)
        assert 0 < pairs <= 128 and (programs - 1) * pairs < inter <= programs * pairs
        assert programs <= sms or pairs == 128


def _mlp(**overrides):
    torch = pytest.importorskip("torch")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP

    config = Qwen2Config(hidden_size=32, intermediate_size=48, hidden_act=overrides.pop("act", "silu"))
    return Qwen2MLP(config).to(overrides.pop("dtype", torch.float32))


def test_the_stand_in_only_takes_the_plain_silu_mlp(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from torch import nn

    from vlm_grpo.fastpath import decode_mlp

    assert decode_mlp.stand_in_for(_mlp()) is None  # on CPU, without the interpreter: never
    monkeypatch.setattr(decode_mlp, "_on_gpu", lambda *tensors: True)
    assert isinstance(decode_mlp.stand_in_for(_mlp()), decode_mlp.FusedMLP)
    assert decode_mlp.stand_in_for(_mlp(act="gelu")) is None
    biased = _mlp()
    biased.up_proj = nn.Linear(32, 48, bias=True)
    assert decode_mlp.stand_in_for(biased) is None
    mixed = _mlp()
    mixed.down_proj.half()
    assert decode_mlp.stand_in_for(mixed) is None
    extra = _mlp()
    extra.norm = nn.LayerNorm(48)  # a module the kernel would not run
    assert decode_mlp.stand_in_for(extra) is None
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(nn.Sequential(_mlp()), peft.LoraConfig(r=2, target_modules=["down_proj"]))
    assert decode_mlp.stand_in_for(wrapped.base_model.model[0]) is None  # LoRA: the fused path folds it
    monkeypatch.setattr(decode_mlp, "KERNEL", False)
    assert decode_mlp.stand_in_for(_mlp()) is None


def test_no_gate_up_copy_where_the_kernel_runs(monkeypatch: pytest.MonkeyPatch, tiny_models) -> None:
    """For a call of at most ``ROWS_MAX`` rows, ``fused_projections`` swaps each decoder MLP for the kernels'
    stand-in and back, and makes no fused gate|up copy for it (3B: 3.2 GB less while generating); q|k|v stays one
    GEMM. With more rows (where the kernels are slower), the gate|up groups are fused as before."""
    pytest.importorskip("triton")
    import torch

    from vlm_grpo.fastpath import decode_fusion, decode_mlp
    from vlm_grpo.modules import get_vlm_module

    path = str(tiny_models["qwen2_5_vl"])
    model = get_vlm_module(path).load_model(path, dtype=torch.float32, attn_implementation="sdpa")
    decoder = model.model.language_model
    mlps = {name: m for name, m in decoder.named_modules() if name.endswith(".mlp")}
    assert mlps
    monkeypatch.setattr(decode_mlp, "_on_gpu", lambda *tensors: True)
    few, many = decode_mlp.ROWS_MAX, decode_mlp.ROWS_MAX + 1
    gate_up = sum(m.gate_proj.weight.nbytes + m.up_proj.weight.nbytes for m in mlps.values())
    assert decode_fusion.fused_nbytes(decoder, rows=few) == decode_fusion.fused_nbytes(decoder, rows=many) - gate_up
    with decode_fusion.fused_projections(decoder, rows=few) as groups:
        assert groups == len(mlps)  # the q|k|v groups only
        current = {name: decoder.get_submodule(name) for name in mlps}
        assert all(isinstance(m, decode_mlp.FusedMLP) and m.mlp is mlps[name] for name, m in current.items())
        # the decoder's parameters are still all there (a kept graph's address check lists them)
        assert {id(p) for p in decoder.parameters()} >= {id(m.down_proj.weight) for m in mlps.values()}
    assert {name: decoder.get_submodule(name) for name in mlps} == mlps
    with decode_fusion.fused_projections(decoder, rows=many) as groups:
        assert groups == 2 * len(mlps)  # q|k|v and gate|up
        assert {name: decoder.get_submodule(name) for name in mlps} == mlps
    monkeypatch.setattr(decode_mlp, "KERNEL", False)
    with decode_fusion.fused_projections(decoder, rows=few) as groups:
        assert groups == 2 * len(mlps)


_SETUP = r"""
from vlm_grpo.fastpath import decode_mlp

decode_mlp._on_gpu = lambda *tensors: True  # the interpreter runs the kernels on CPU tensors
real, calls, broken = decode_mlp._launch, [], []

def counted(x, gate, up, down, tuning=None):
    calls.append(x.shape[0])
    out = real(x, gate, up, down, tuning)
    return -out if broken else out

decode_mlp._launch = counted
"""


def test_fast_decode_with_the_mlp_kernel_samples_what_generate_samples(tiny_models) -> None:
    """The decode step's MLP through the (interpreted) kernels: sampled tokens equal ``generate``'s under one seed
    in every family, a row left-padded; the kernels ran at every layer and step. Control: their output negated
    changes the tokens, so the comparison sees what they return."""
    pytest.importorskip("triton")
    check_decode_parity(_SETUP, tiny_models)


def test_a_compiled_step_takes_the_stand_in_as_one_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile(fullgraph=True)`` traces through the stand-in to one call of the op (nothing is run)."""
    pytest.importorskip("triton")
    import torch

    from vlm_grpo.fastpath import decode_mlp

    monkeypatch.setattr(decode_mlp, "_on_gpu", lambda *tensors: True)
    fused = decode_mlp.stand_in_for(_mlp())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: (None,)  # recorded, not run

    torch.compile(lambda x: fused(x) * 2, fullgraph=True, backend=backend)(torch.randn(16, 1, 32))
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and ops.count(torch.ops.vlm_grpo.decode_mlp) == 1


_COMPILED_SLICES = r"""
import json, sys
import torch
from transformers.models.qwen2.modeling_qwen2 import Qwen2Config, Qwen2MLP, Qwen2RMSNorm
from vlm_grpo.fastpath import decode_mlp

decode_mlp._on_gpu = lambda *tensors: True  # the interpreter runs the kernels on CPU tensors
if sys.argv[1] == "first_slice_only":  # control: the slices' partial sums not added up
    op = torch.ops.vlm_grpo.decode_mlp
    decode_mlp.fused_mlp = lambda x, *w: op(x, *w, decode_mlp.BN2, decode_mlp.BK2 // 2, 4)[0].to(x.dtype)
torch.manual_seed(0)
mlp, norm = Qwen2MLP(Qwen2Config(hidden_size=64, intermediate_size=300, hidden_act="silu")), Qwen2RMSNorm(64)
fused = decode_mlp.stand_in_for(mlp)

def step(x, residual):  # a decoder layer's end and the next layer's norm
    h = residual + fused(x)
    return norm(h), h

x, residual = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
with torch.no_grad():
    out = torch.compile(step, fullgraph=True)(x, residual)
    ref = (norm(residual + mlp(x)), residual + mlp(x))
    slices = decode_mlp._launch(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight).size(0)
print(json.dumps({"slices": slices, "err": max((a - b).abs().max().item() for a, b in zip(out, ref))}))
"""


def test_a_compiled_step_adds_the_slices_as_the_module_would() -> None:
    """Through inductor (a residual add and the next RMSNorm after the stand-in, as in a decode step, where the
    slices' sum is fused into that kernel), down in 3 slices of K gives the eager module's output. Control: with only
    the first slice's partial sums, it is far off."""
    pytest.importorskip("triton")
    runs = python_runs(_COMPILED_SLICES, [("package",), ("first_slice_only",)], interpret=True)
    package, control = (json.loads(out.strip().splitlines()[-1]) for out in runs)
    assert package["slices"] == 3 and package["err"] < 1e-5, package  # K 300: slices of 128 (two 64-column blocks)
    assert control["err"] > 1e-2, control


def _lora(model, targets=("up_proj", "down_proj", "q_proj"), dropout: float = 0.0):
    from peft import LoraConfig, get_peft_model

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)  # random A and B (init_lora_weights=False): the adapters change the tokens
    config = LoraConfig(
        r=4, lora_alpha=64, lora_dropout=dropout, target_modules=list(targets), init_lora_weights=False
    )  # fmt: skip
    return get_peft_model(model, config)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["folded", "dropout_keeps_the_gemms"])
def test_a_lora_mlp_runs_on_copies_with_the_adapters_folded_in(dropout, monkeypatch, tiny_models) -> None:
    """Under LoRA without dropout the MLP runs as the kernels on per-call copies: gate|up (up's adapter folded in,
    gate's rows as they are) and down (folded); the model's own weights never change. With dropout the LoRA layers
    must run: no stand-in, the fused GEMM path as before."""
    pytest.importorskip("triton")
    import torch

    from vlm_grpo.fastpath import decode_fusion, decode_mlp
    from vlm_grpo.modules import get_vlm_module
    from vlm_grpo.utils import peft_base

    path = str(tiny_models["qwen2_5_vl"])
    model = _lora(
        get_vlm_module(path).load_model(path, dtype=torch.float32, attn_implementation="sdpa"), dropout=dropout
    )
    decoder = peft_base(model).get_decoder()
    name, mlp = next((n, m) for n, m in decoder.named_modules() if n.endswith(".mlp"))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    monkeypatch.setattr(decode_mlp, "_on_gpu", lambda *tensors: True)
    with decode_fusion.fused_projections(decoder, rows=4):
        fused = decoder.get_submodule(name)
        if dropout:
            assert fused is mlp
            return
        assert isinstance(fused, decode_mlp.FusedMLP) and fused.mlp is mlp
        gate, up, down = fused.weights()
        assert torch.equal(gate, mlp.gate_proj.weight)  # no adapter on gate: its rows of the copy as they are
        for got, lora in ((up, mlp.up_proj), (down, mlp.down_proj)):
            adapter = lora.lora_B["default"].weight @ lora.lora_A["default"].weight * lora.scaling["default"]
            assert adapter.abs().max() > 0.1
            assert torch.allclose(got, lora.base_layer.weight + adapter, atol=1e-6)
    assert decoder.get_submodule(name) is mlp
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


_LORA_SETUP = (
    _SETUP
    + r"""
from peft import LoraConfig, get_peft_model
_plain_module = get_vlm_module

class _WithLora:  # every family loads with random LoRA adapters on up, down and q (no dropout: folded)
    def __init__(self, path):
        self.inner = _plain_module(path)

    def load_model(self, *args, **kwargs):
        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=64, lora_dropout=0.0, target_modules=["up_proj", "down_proj", "q_proj"],
                            init_lora_weights=False)
        return get_peft_model(self.inner.load_model(*args, **kwargs), config)

get_vlm_module = _WithLora
"""
)


def test_fast_decode_with_lora_and_the_mlp_kernel_samples_what_generate_samples(tiny_models) -> None:
    """As above with LoRA adapters on the MLP: the kernels on the folded copies sample ``generate``'s tokens (which
    the adapters change) in every family; negating the kernels' output changes them."""
    pytest.importorskip("triton")
    pytest.importorskip("peft")
    check_decode_parity(_LORA_SETUP, tiny_models)
