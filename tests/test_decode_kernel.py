"""The flash-decoding kernel (``fastpath.decode_kernel``) against ``one_token_attention``, on CPU.

Triton's interpreter (``TRITON_INTERPRET=1``, read when kernels are defined) runs the kernels on CPU tensors. The
variable must not leak into this session's other tests, so the kernels run in one subprocess for all cases
(float16 and float32: the interpreter's bfloat16 dots are wrong). A second subprocess, without the interpreter,
checks that torch.compile traces the op into one graph (nothing can launch it here).
"""

from __future__ import annotations

import json

import pytest

from interpreted import check_decode_parity, python_run

# name: (dtype, B, H, H_kv, L, d, mask, cache slots (> L: K/V are a window of it), expected splits)
CASES = {
    "f32_bool_window_g8": ("float32", 4, 8, 1, 300, 64, "bool", 384, 5),
    "f16_bool_window_g8": ("float16", 4, 8, 1, 300, 64, "bool", 384, 5),
    "f16_additive_g2_d128": ("float16", 2, 4, 2, 200, 128, "additive", 256, 4),
    "f32_nomask_g1": ("float32", 2, 2, 2, 100, 64, "none", 100, 2),
    "f16_short_g8": ("float16", 3, 8, 1, 20, 64, "bool", 64, 1),
    "f16_b16_g8": ("float16", 16, 8, 1, 130, 64, "bool", 160, 3),
    "f32_additive_g16": ("float32", 2, 16, 1, 90, 64, "additive", 128, 2),
    "f16_nomask_g4_d128": ("float16", 1, 8, 2, 70, 128, "none", 70, 2),
    "f32_one_mask_row_g4": ("float32", 3, 8, 2, 70, 64, "one_row", 80, 2),  # a (1, 1, 1, L) mask for every row
}
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}

_RUN_CASES = r"""
import json, sys
import torch
from vlm_grpo.fastpath.decode_attention import one_token_attention
from vlm_grpo.fastpath.decode_kernel import _launch, choose_splits

results = {}
for name, (dtype, B, H, Hkv, L, d, kind, slots, _) in json.loads(sys.argv[1]).items():
    gen = torch.Generator().manual_seed(len(results))
    dtype = getattr(torch, dtype)
    # query: a transpose (B, 1, H, d) -> (B, H, 1, d) of a strided view; K/V: a window of a longer static cache
    query = torch.randn(B, 1, H, d + 8, generator=gen).to(dtype)[..., :d].transpose(1, 2)
    cache_k = torch.randn(B, Hkv, slots, d, generator=gen).to(dtype)
    cache_v = torch.randn(B, Hkv, slots, d, generator=gen).to(dtype)
    key, value = cache_k[:, :, :L], cache_v[:, :, :L]
    # left padding: row i masks its first pads[i] slots (some more than a whole split), a view of a longer mask
    pads = [(i * 137) % max(L - 3, 1) for i in range(B)]
    attend = torch.ones(B, 1, 1, L + 16, dtype=torch.bool)
    for i, pad in enumerate(pads):
        attend[i, ..., :pad] = False
    attend = attend[..., :L]
    if kind == "bool":
        mask = attend
    elif kind == "one_row":
        mask = attend[1:2]
    elif kind == "additive":
        mask = torch.zeros(B, 1, 1, L + 16, dtype=dtype)[..., :L].masked_fill(~attend, torch.finfo(dtype).min)
    else:
        mask = None
    scale = d**-0.5
    out = _launch(query, key, value, mask, scale)
    ref = one_token_attention(query, key, value, mask, scale)
    # negative control: query head h against K/V head h % H_kv instead of h // G (G=1 reference on expanded K/V)
    wrong = torch.arange(H) % Hkv
    bad = one_token_attention(query, key[:, wrong], value[:, wrong], mask, scale)
    results[name] = {
        "shape_ok": out.shape == ref.shape and out.dtype == value.dtype,
        "err": (out.float() - ref.float()).abs().max().item(),
        "wrong_heads_err": (out.float() - bad.float()).abs().max().item(),
        "splits": choose_splits(L, B * Hkv)[0],
        "key_contiguous": key.is_contiguous(),
        "query_contiguous": query.is_contiguous(),
        "max_pad_over_split": max(pads) / (choose_splits(L, B * Hkv)[1] * 64),
    }

# shared prompt slots: rows 0-2 and 3-5 are two prompts' samples; row b reads slots < 130 from row src[b]
gen = torch.Generator().manual_seed(11)
for dtype in (torch.float32, torch.float16):
    B, H, Hkv, L, d, P = 6, 8, 2, 200, 64, 130
    k = torch.randn(B, Hkv, L + 10, d, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, L + 10, d, generator=gen).to(dtype)
    src = torch.tensor([0, 0, 0, 3, 3, 3], dtype=torch.int32)
    copies_k, copies_v = k.clone(), v.clone()  # what fast_decode's cache holds: each row a copy of its prompt
    copies_k[:, :, :P], copies_v[:, :, :P] = k[src.long(), :, :P], v[src.long(), :, :P]
    query = torch.randn(B, H, 1, d, generator=gen).to(dtype)
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    mask[3:, ..., :5] = False
    ref = one_token_attention(query, copies_k[:, :, :L], copies_v[:, :, :L], mask, d**-0.5)
    shared = (src, torch.tensor(P, dtype=torch.int32))
    # the copies: the same output as each row reading its own slots
    on_copies = _launch(query, copies_k[:, :, :L], copies_v[:, :, :L], mask, d**-0.5, shared=shared)
    # k / v: the other rows' prompt slots differ from their source's, so only reading the source matches ref
    on_sources = _launch(query, k[:, :, :L], v[:, :, :L], mask, d**-0.5, shared=shared)
    own = _launch(query, k[:, :, :L], v[:, :, :L], mask, d**-0.5)  # control: each row its own (differing) slots
    results[f"shared_{dtype}"] = {
        "copies_err": (on_copies.float() - ref.float()).abs().max().item(),
        "sources_err": (on_sources.float() - ref.float()).abs().max().item(),
        "own_rows_err": (own.float() - ref.float()).abs().max().item(),
        "src_rows_own_err": (own[[0, 3]].float() - ref[[0, 3]].float()).abs().max().item(),
    }
print(json.dumps(results))
"""

_TRACE = r"""
import torch
from vlm_grpo.fastpath.decode_kernel import decode_attention_kernel

graphs = []
def backend(gm, example_inputs):
    graphs.append(gm)
    return lambda *args: (None,)  # recorded, not run: nothing here can launch a Triton kernel

def step(query, key, value, mask):
    return decode_attention_kernel(query, key, value, mask, 0.125) * 2

cache = torch.randn(2, 1, 256, 64, dtype=torch.float16)
query = torch.randn(2, 1, 8, 64, dtype=torch.float16).transpose(1, 2)
mask = torch.ones(2, 1, 1, 300, dtype=torch.bool)
torch.compile(step, fullgraph=True, backend=backend, dynamic=True)(query, cache[:, :, :150], cache[:, :, :150],
                                                                     mask[..., :150])
ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
print("OPS", len(graphs), ops.count(torch.ops.vlm_grpo.decode_attention))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """Every case of ``CASES`` run once through the interpreted kernels."""
    pytest.importorskip("triton")
    return json.loads(python_run(_RUN_CASES, json.dumps(CASES), interpret=True).strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_of_one_prompt_read_its_first_rows_prompt_slots(interpreted: dict[str, dict], dtype: str) -> None:
    """``shared``: each row reads the slots below the prompt's length from its source row, its own slots after.
    On a cache of copies (what fast_decode holds) the output is unchanged; where the other rows' prompt slots differ
    from their source's, the output still matches the copies' reference, and reading their own slots (the control)
    does not, except for the source rows themselves."""
    result = interpreted[f"shared_torch.{dtype}"]
    assert result["copies_err"] < TOLERANCE[dtype], result
    assert result["sources_err"] < TOLERANCE[dtype], result
    assert result["own_rows_err"] > 100 * TOLERANCE[dtype], result
    assert result["src_rows_own_err"] < TOLERANCE[dtype], result


@pytest.mark.parametrize("name", list(CASES))
def test_matches_one_token_attention(interpreted: dict[str, dict], name: str) -> None:
    dtype, *_, expected_splits = CASES[name]
    result = interpreted[name]
    assert result["shape_ok"]
    assert result["err"] < TOLERANCE[dtype], result
    # the same comparison fails when query heads meet the wrong K/V head (only G > 1 with H_kv > 1 differs)
    _, _, heads, kv_heads, *_ = CASES[name]
    if kv_heads > 1 and heads > kv_heads:
        assert result["wrong_heads_err"] > 100 * TOLERANCE[dtype], result
    assert result["splits"] == expected_splits


def test_cases_cover_the_contract(interpreted: dict[str, dict]) -> None:
    """The inputs the decode step hands over: strided windows, a transposed query, splits that are all padding."""
    interpreted = {name: interpreted[name] for name in CASES}
    assert any(r["splits"] == 1 for r in interpreted.values())
    assert max(r["splits"] for r in interpreted.values()) > 1
    assert any(r["max_pad_over_split"] > 1 for r in interpreted.values())  # a whole split masked out
    assert not interpreted["f16_bool_window_g8"]["key_contiguous"]
    assert not interpreted["f16_bool_window_g8"]["query_contiguous"]


def test_choose_splits() -> None:
    from vlm_grpo.fastpath.decode_kernel import BLOCK_S, choose_splits

    for length in (1, 63, 64, 65, 300, 1536, 4096, 32768):
        for rows in (1, 2, 16, 32, 128, 512):
            splits, per_split = choose_splits(length, rows)
            blocks = -(-length // BLOCK_S)
            assert (splits - 1) * per_split < blocks <= splits * per_split  # every slot, no empty split
            assert rows * splits < 3 * 132 + rows  # about 3 programs per SM of an H100, not more
    assert choose_splits(1536, 16) == (24, 1)  # 16 (row, K/V head) programs at 1536 slots: 24 splits of one block
    assert choose_splits(1536, 32) == (12, 2)  # the 3B model's 16 rows x 2 K/V heads: 32 x 12 programs


def test_supported_is_false_on_cpu() -> None:
    torch = pytest.importorskip("torch")
    from vlm_grpo.fastpath.decode_kernel import supported

    query, key = torch.zeros(1, 8, 1, 64), torch.zeros(1, 1, 16, 64)
    assert not supported(query, key, key, None)


def test_traces_into_one_graph() -> None:
    """``torch.compile(fullgraph=True)`` takes the op without a graph break (the kernels themselves are not run)."""
    pytest.importorskip("triton")
    assert "OPS 1 1" in python_run(_TRACE, interpret=False)


_SETUP = r"""
from vlm_grpo.fastpath import decode_kernel

decode_kernel._on_gpu = lambda *tensors: True  # the interpreter runs the kernels on CPU tensors
real, calls, broken = decode_kernel.decode_attention_kernel, [], []

def counted(query, key, value, mask, scale, shared=None):
    calls.append(None if shared is None else (shared[0].tolist(), int(shared[1])))
    out = real(query, key, value, mask, scale, shared)
    return -out if broken else out

def extra(family_calls):  # the (source rows, prompt slots) the kernel was handed in this family's calls
    return sorted({json.dumps(c) for c in family_calls})

decode_kernel.decode_attention_kernel = counted
"""


def test_fast_decode_with_the_kernel_samples_what_generate_samples(tiny_models) -> None:
    """The decode step's attention through the (interpreted) kernel: sampled tokens equal ``generate``'s under one
    seed in every family, a row left-padded; the kernel ran at every layer and step. Control: the kernel's output
    negated changes the tokens, so the comparison sees what the kernel returns."""
    pytest.importorskip("triton")
    results = check_decode_parity(_SETUP, tiny_models)
    # every call had the rows of one prompt (index 0, 0, 1, 1) read the 17 prompt slots from its first row
    for family, result in results.items():
        assert result["extra"] == [json.dumps([[0, 0, 2, 2], 17])], (family, result["extra"])
