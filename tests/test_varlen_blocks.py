"""The packed pass's attention as one variable-length call (:class:`VarlenLayout`).

On GPUs it is flash's varlen kernel, which CPUs lack; here :func:`varlen_reference` (the same attention through a
dense mask) stands in for it, so the layout, its gather, the end-aligned causal mask, the gradients and the tracing
inside compiled layers are all checked against the per-row calls and against TRL. Flash itself is compared with the
per-row calls on the device (``benchmarks/micro/varlen_check.py``).
"""

from __future__ import annotations

import pytest
import torch

import test_group_sharing
import vlm_grpo.fastpath.block_attention as ba
import vlm_grpo.fastpath.varlen as varlen
from test_group_sharing import assert_parity, make_trainer, real_batch
from vlm_grpo.fastpath.block_attention import PackedLayout, VarlenLayout, varlen_layout
from vlm_grpo.fastpath.varlen import flash_varlen, varlen_reference

rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYOUT = PackedLayout.uniform(prefixes=(5, 3), blocks=(3, 2), block_len=4)
TOTAL = 5 + 3 * 4 + 2  # row 0: prefix, 3 blocks, 2 padding tokens; row 1: prefix, 2 blocks, 8 padding tokens


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(varlen, "CPU_STAND_IN", varlen_reference)


def _qkv(heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, heads, TOTAL, dim)
    q = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn((2, kv_heads, TOTAL, dim), generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    return q, k, v


def _read(layout: PackedLayout) -> torch.Tensor:
    """(rows, total) True where a token is a prefix or block token (padding outputs are read by nothing)."""
    read = torch.zeros(len(layout.rows), TOTAL, dtype=torch.bool)
    for row, groups in enumerate(layout.rows):
        read[row, : sum(g.length for g in groups)] = True
    return read


def _out_and_grads(fn, q, k, v, read):
    out = fn(q, k, v)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    (out * weights * read[:, :, None, None]).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    return out * read[:, :, None, None], grads


def test_the_layout_lists_each_rows_prefix_blocks_and_padding(stand_in):
    plan = varlen_layout(LAYOUT, TOTAL, torch.device("cpu"))
    assert isinstance(plan, VarlenLayout)
    # row 0: prefix 5, blocks 4+4+4, padding 2; row 1: prefix 3, blocks 4+4, padding 8
    assert plan.cu_q.tolist() == [0, 5, 9, 13, 17, 19, 22, 26, 30, 38]
    assert plan.cu_k.tolist() == [0, 5, 14, 23, 32, 34, 37, 44, 51, 59]
    second_block = plan.kv_index[plan.cu_k[2] : plan.cu_k[3]].tolist()
    assert second_block == [0, 1, 2, 3, 4, 9, 10, 11, 12], "a block's keys: the prefix, then its own"
    row1_block = plan.kv_index[plan.cu_k[6] : plan.cu_k[7]].tolist()
    assert row1_block == [TOTAL + i for i in (0, 1, 2, 3, 4, 5, 6)]
    assert plan.max_q.size(0) == 8 and plan.max_k.size(0) == 9


def test_one_varlen_call_equals_the_per_row_calls_with_their_gradients(stand_in):
    q, k, v = _qkv()
    read = _read(LAYOUT)
    plan = varlen_layout(LAYOUT, TOTAL, torch.device("cpu"))
    ours, our_grads = _out_and_grads(lambda *x: ba._varlen_sdpa(*x, plan, None), q, k, v, read)
    ref, ref_grads = _out_and_grads(lambda *x: ba._packed_sdpa(*x, LAYOUT, 0.0, None), q, k, v, read)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    for mine, theirs in zip(our_grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)


def test_the_comparison_catches_blocks_that_see_a_neighbour(stand_in):
    """Control: a gather that hands block 2 of row 0 the keys of block 1 must fail the comparison above."""
    q, k, v = _qkv()
    read = _read(LAYOUT)
    plan = varlen_layout(LAYOUT, TOTAL, torch.device("cpu"))
    start, end = plan.cu_k[2].item(), plan.cu_k[3].item()
    plan.kv_index = plan.kv_index.clone()
    plan.kv_index[end - 4 : end] -= 4  # block 2's own keys -> block 1's
    ours, _ = _out_and_grads(lambda *x: ba._varlen_sdpa(*x, plan, None), q, k, v, read)
    ref, _ = _out_and_grads(lambda *x: ba._packed_sdpa(*x, LAYOUT, 0.0, None), q, k, v, read)
    assert not torch.allclose(ours, ref, atol=1e-6)
    assert start < end


def test_the_per_row_calls_stay_where_no_varlen_kernel_runs(monkeypatch):
    assert varlen_layout(LAYOUT, TOTAL, torch.device("cpu")) is LAYOUT  # CPU without a stand-in
    monkeypatch.setattr(varlen, "CPU_STAND_IN", varlen_reference)
    monkeypatch.setattr(ba, "VARLEN", False)
    assert varlen_layout(LAYOUT, TOTAL, torch.device("cpu")) is LAYOUT  # switched off
    monkeypatch.setattr(ba, "VARLEN", True)
    flash = VarlenLayout(LAYOUT, TOTAL, flash_varlen, torch.device("cpu"))
    q = torch.zeros(2, 4, TOTAL, 128)
    assert not flash.fits(q, q), "flash takes no fp32 without autocast"
    assert flash.fits(q.bfloat16(), q.bfloat16())
    assert not flash.fits(torch.zeros(2, 4, TOTAL, 12).half(), torch.zeros(2, 4, TOTAL, 12).half()), "head dim 12"


@pytest.mark.parametrize(("family", "lora"), [("qwen2_5_vl", False), ("internvl", True)])
def test_compiled_layers_trace_the_varlen_call_whole(family, lora, stand_in, tiny_models, rows_file, tmp_path,
                                                     monkeypatch):  # fmt: skip
    """With a varlen kernel, a compiled decoder layer has no graph break at its attention, takes new layouts and a
    second new width without recompiling, and matches TRL under gradient checkpointing. Dynamo's tracing is what this
    checks, so the layers compile with ``aot_eager`` (no code generation: a cold CI run saves ~80 s); inductor's code
    for compiled layers is held against TRL in ``test_group_sharing``."""
    from torch._dynamo.utils import counters

    import vlm_grpo.fastpath.compiled_layers as compiled_layers

    monkeypatch.setattr(compiled_layers, "_compiled", {})
    monkeypatch.setattr(compiled_layers, "_BACKEND", "aot_eager")
    islands = []
    real_island = ba._packed_sdpa
    monkeypatch.setattr(ba, "_packed_sdpa", lambda *a: islands.append(1) or real_island(*a))
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, lora=lora, compile_layers=True)
    monkeypatch.setattr(torch.compiler.config, "job_id", None)  # a cold process's counts (see test_group_sharing)
    inputs = real_batch(trainer)
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
    trainer.model.train()
    torch._dynamo.reset()
    counters.clear()
    frames = []
    for cut in (0, 1, 2):  # narrower completions: other shapes, other layouts
        batch = {**inputs}
        for key in ("completion_ids", "completion_mask", "mm_token_type_ids"):
            if batch.get(key) is not None:
                batch[key] = inputs[key][:, : inputs[key].size(1) - cut]
        assert_parity(trainer, batch)
        frames.append(counters["frames"]["total"])
    assert not islands, "the per-row island ran"
    assert frames[2] == frames[1] > frames[0] > 0, frames
    breaks = [reason for reason in counters["graph_break"] if "disable" not in reason or "_packed_sdpa" in reason]
    assert not breaks, (
        breaks
    )  # the per-row island breaks the graph (the control: the island test in test_group_sharing)
