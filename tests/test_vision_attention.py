"""The batched varlen vision attention (``vlm_grpo.fastpath.vision_attention``) against transformers' per-segment sdpa.

Images of different sizes give segments of several lengths (Qwen2.5-VL: windows of several lengths too),
and two images of one size give a length with more than one segment, so the batching is exercised where
it can go wrong: gathers, the inverse permutation, and gradients through both.
"""

from __future__ import annotations

import functools
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AutoModelForImageTextToText
from transformers.vision_utils import get_vision_window_index

import test_group_sharing
import vlm_grpo.fastpath.varlen as varlen
from e2e_utils import base_args, make_dataset
from test_group_sharing import assert_parity, make_trainer, real_batch
from vlm_grpo.fastpath.vision_attention import NAME, use_batched_vision_attention, varlen_sdpa
from vlm_grpo.grpo_jsonl import main, parse_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")
rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# (t, h, w) in patches; h, w multiples of the merge size 2. Lengths 60, 24, 32, 24: three distinct, one twice.
GRID = torch.tensor([[1, 6, 10], [1, 4, 6], [1, 8, 4], [1, 4, 6]])
TOL = 1e-5


def load(tiny_models, family: str, attn: str = "sdpa") -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(
        tiny_models[family], dtype=torch.float32, attn_implementation=attn
    )


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [block.attn for block in model.model.visual.blocks]


def vision_pass(model: torch.nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], list[list[tuple]]]:
    """Image features (deepstack too), gradients of a random projection of them w.r.t. the vision
    parameters, and the q shape of every sdpa call, per vision layer."""
    visual = model.model.visual
    embed = visual.patch_embed
    width = embed.in_channels * embed.temporal_patch_size * embed.patch_size**2
    pixels = torch.randn(int(GRID.prod(-1).sum()), width, generator=torch.Generator().manual_seed(0))
    calls: list[list[tuple]] = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append([])) for m in attention_modules(model)]
    real_sdpa = F.scaled_dot_product_attention

    def spy(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls[-1].append(tuple(query.shape))
        return real_sdpa(query, *args, **kwargs)

    model.zero_grad(set_to_none=True)
    F.scaled_dot_product_attention = spy  # transformers' sdpa and ours both look it up at call time
    try:
        out = model.model.get_image_features(pixel_values=pixels, image_grid_thw=GRID, return_dict=True)
    finally:
        F.scaled_dot_product_attention = real_sdpa
        for hook in hooks:
            hook.remove()
    features = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    features = [torch.cat(f) if isinstance(f, (list, tuple)) else f for f in features]  # per-image splits
    generator = torch.Generator().manual_seed(1)
    sum((f * torch.randn(f.shape, generator=generator)).sum() for f in features).backward()
    grads = {n: p.grad for n, p in visual.named_parameters() if p.grad is not None}
    return [f.detach() for f in features], grads, calls


def assert_same(ref: tuple, ours: tuple) -> None:
    (ref_features, ref_grads, _), (features, grads, _) = ref, ours
    assert len(features) == len(ref_features)
    for a, b in zip(features, ref_features, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for name, g in ref_grads.items():
        rel = (grads[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert rel <= TOL, f"{name}: relative L2 {rel:.2e}"


def segment_lengths(model: torch.nn.Module) -> list[list[int]]:
    """Per vision layer, the segment lengths transformers splits the sequence into under sdpa."""
    visual = model.model.visual
    images = GRID.prod(-1).tolist()
    if not hasattr(visual, "fullatt_block_indexes"):
        return [images] * len(visual.blocks)
    _, cu = get_vision_window_index(GRID, visual.spatial_merge_size, visual.window_size, visual.patch_size)
    windows = cu.diff().tolist()
    return [images if i in visual.fullatt_block_indexes else windows for i in range(len(visual.blocks))]


@pytest.mark.parametrize("family", QWEN)
def test_batched_vision_attention_matches_per_segment_sdpa(family, tiny_models):
    model = load(tiny_models, family)
    ref = vision_pass(model)
    lengths = segment_lengths(model)
    assert [len(c) for c in ref[2]] == [len(seg) for seg in lengths]  # the reference: one call per segment
    if family == "qwen2_5_vl":
        windows = lengths[0]
        assert len(set(windows)) > 1 and len(windows) > len(set(windows)), windows

    assert use_batched_vision_attention(model, True)
    assert all(m.config._attn_implementation == NAME for m in attention_modules(model))
    assert model.config.get_text_config(decoder=True)._attn_implementation == "sdpa"  # the decoder is untouched
    ours = vision_pass(model)
    assert_same(ref, ours)
    for layer, (calls, seg) in enumerate(zip(ours[2], lengths, strict=True)):
        # One call per distinct length, on all segments of that length at once: (n_L, heads, L, dim).
        assert Counter({shape[2]: shape[0] for shape in calls}) == Counter(seg), (layer, calls, seg)
        assert len(calls) == len(set(seg)) < len(seg), (layer, calls)


@pytest.mark.parametrize("family", QWEN)
def test_the_comparison_catches_attention_across_segments(family, tiny_models):
    """One sdpa over all tokens (segments see each other) must fail the same comparison."""

    def leaky(module, query, key, value, attention_mask, scaling=None, **kwargs):
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling)
        return out.transpose(1, 2), None

    model = load(tiny_models, family)
    ref = vision_pass(model)
    leaky_name = "vlm_grpo_test_flash_leaky"
    AttentionInterface.register(leaky_name, leaky)
    model.config.vision_config._attn_implementation = leaky_name
    with pytest.raises(AssertionError):
        assert_same(ref, vision_pass(model))
    model.config.vision_config._attn_implementation = NAME  # and the real kernel passes on the same model
    assert_same(ref, vision_pass(model))


@pytest.fixture
def stand_in(monkeypatch):
    """CPUs have no varlen kernel: the dense-mask reference stands in for flash's (compared on the device by
    ``benchmarks/micro/varlen_check.py``); ``islands`` records the per-length calls that still run."""
    import vlm_grpo.fastpath.vision_attention as va

    monkeypatch.setattr(varlen, "CPU_STAND_IN", varlen.varlen_reference)
    islands = []
    real = va._segmented_sdpa
    monkeypatch.setattr(va, "_segmented_sdpa", lambda *a: islands.append(1) or real(*a))
    return islands


@pytest.mark.parametrize("family", QWEN)
def test_one_varlen_call_per_layer_matches_per_segment_sdpa(family, tiny_models, stand_in, monkeypatch):
    """Where a varlen kernel runs, each layer is one call over the whole packed sequence, with the same features and
    gradients as transformers' per-segment sdpa; a kernel that is handed one segment for everything fails (control)."""
    model = load(tiny_models, family)
    ref = vision_pass(model)
    use_batched_vision_attention(model, True)
    ours = vision_pass(model)
    assert_same(ref, ours)
    tokens = int(GRID.prod(-1).sum())
    assert all(calls == [(1, calls[0][1], tokens, calls[0][3])] for calls in ours[2]), ours[2]
    assert not stand_in, "the per-length calls ran"

    def one_segment(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
        whole = cu_q[[0, -1]]
        return varlen.varlen_reference(q, k, v, whole, whole, tokens, tokens, scale, causal)

    monkeypatch.setattr(varlen, "CPU_STAND_IN", one_segment)
    with pytest.raises(AssertionError):
        assert_same(ref, vision_pass(model))


def test_the_per_length_calls_stay_where_no_varlen_kernel_runs(stand_in, monkeypatch):
    """No kernel (CPU), no ``max_length_q`` int (older transformers hand a tensor), dropout, or the switch off: the
    per-length calls run, with the same result."""
    import vlm_grpo.fastpath.vision_attention as va

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in "qkv")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    module = torch.nn.Module()
    varlen_out, _ = varlen_sdpa(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6)
    assert not stand_in
    for kwargs in ({"max_length_q": None}, {"max_length_q": torch.tensor(6)}):
        out, _ = varlen_sdpa(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, **kwargs)
        torch.testing.assert_close(out, varlen_out, rtol=0, atol=1e-6)
    monkeypatch.setattr(va, "VARLEN", False)
    varlen_sdpa(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6)
    monkeypatch.setattr(va, "VARLEN", True)
    varlen_sdpa(module, q, k, v, None, dropout=0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6)
    assert len(stand_in) == 4
    monkeypatch.setattr(varlen, "CPU_STAND_IN", None)
    varlen_sdpa(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6)
    assert len(stand_in) == 5
    assert not varlen.kernel_fits(varlen.flash_varlen, q, v), "flash takes no fp32 without autocast"
    assert varlen.kernel_fits(varlen.flash_varlen, q.bfloat16(), v.bfloat16())


def test_compiled_vision_blocks_trace_the_varlen_call_for_new_image_sizes(tiny_models, stand_in):
    """A compiled block traces the varlen call whole (no island, no graph break), new sets of image sizes stop
    recompiling after the first few (the longest segment is an int input: specialized once, then dynamic), and the
    features stay transformers' eager ones."""
    from torch._dynamo.utils import counters

    model = load(tiny_models, "qwen2_5_vl")
    visual = model.model.visual
    width = visual.patch_embed.in_channels * visual.patch_embed.temporal_patch_size * visual.patch_embed.patch_size**2
    grids = ([[1, 6, 10], [1, 4, 6]], [[1, 8, 8]], [[1, 4, 4], [1, 8, 12], [1, 6, 6]], [[1, 10, 10], [1, 2, 2]])
    inputs = [(torch.randn(int(torch.tensor(g).prod(-1).sum()), width), torch.tensor(g)) for g in grids]
    with torch.no_grad():
        ref = [model.model.get_image_features(pixel_values=p, image_grid_thw=g).pooler_output for p, g in inputs]
    use_batched_vision_attention(model, True)
    compiled = torch.compile(type(visual.blocks[0]).forward.__wrapped__, backend="aot_eager")  # traced, not codegen
    for block in visual.blocks:
        block.forward = functools.partial(compiled, block)
    torch._dynamo.reset()
    counters.clear()
    frames = []
    with torch.no_grad():
        for (pixels, grid), expected in zip(inputs, ref, strict=True):
            out = model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid).pooler_output
            torch.testing.assert_close(torch.cat(out), torch.cat(expected), rtol=0, atol=TOL)
            frames.append(counters["frames"]["total"])
    assert not stand_in and not counters["graph_break"], dict(counters["graph_break"])
    assert frames[-1] == frames[-2] <= 5, frames


def test_the_segment_plan_is_computed_once_per_cu_seqlens(tiny_models, monkeypatch):
    """Every layer gets the same cu_seqlens tensor: one host read per distinct tensor, not per layer."""
    import vlm_grpo.fastpath.vision_attention as va

    model = load(tiny_models, "qwen2_5_vl")
    use_batched_vision_attention(model, True)
    built = []
    real = va._build_plan
    monkeypatch.setattr(va, "_build_plan", lambda bounds, device: built.append(bounds) or real(bounds, device))
    model.model.visual.blocks.extend([model.model.visual.blocks[0]] * 2)  # three window layers, one full
    vision_pass(model)
    assert len(built) == 2 and sorted(len(b) for b in built) == [len(GRID) + 1, len(segment_lengths(model)[0]) + 1]


def test_varlen_sdpa_without_cu_seqlens_is_plain_sdpa():
    q, k, v = (torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = varlen_sdpa(module, q, k, v, None, scaling=0.3)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_switch_touches_only_sdpa_qwen_towers_and_is_not_saved(tiny_models, tmp_path):
    eager = load(tiny_models, "qwen2_5_vl", attn="eager")
    assert not use_batched_vision_attention(eager, True)
    assert eager.config.vision_config._attn_implementation == "eager"
    internvl = load(tiny_models, "internvl")
    assert not use_batched_vision_attention(internvl, True)
    assert internvl.config.vision_config._attn_implementation == "sdpa"

    model = load(tiny_models, "qwen3_vl")
    assert use_batched_vision_attention(model, True)
    model.save_pretrained(tmp_path / "saved")
    saved = (tmp_path / "saved" / "config.json").read_text()
    assert NAME not in saved and "flash" not in saved
    assert json.loads(saved)["vision_config"]["model_type"] == "qwen3_vl_vision"
    assert not use_batched_vision_attention(model, False)
    assert all(m.config._attn_implementation == "sdpa" for m in attention_modules(model))


def test_grpo_trains_with_the_flag_and_leaves_sdpa_without_it(tiny_models, tmp_path, monkeypatch):
    data, plugin = make_dataset(tmp_path / "data", kinds=("single", "multi"), n=2)
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs.get("cu_seq_lens_q") is not None)
        return varlen_sdpa(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, NAME, counting)
    argv = [*base_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "on", steps=1), "--beta", "0.04"]
    script_args, training_args, model_args = parse_args(argv)
    assert training_args.batch_vision_attention  # on by default
    before = {n: p.detach().clone() for n, p in load(tiny_models, "qwen2_5_vl").model.visual.named_parameters()}
    trainer = main(script_args, training_args, model_args)
    assert trainer.state.global_step == 1
    for target in (trainer.model, trainer.ref_model):
        assert target.config.vision_config._attn_implementation == NAME
    assert calls and all(calls)
    after = dict(trainer.model.model.visual.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), "no vision weight changed"
    assert NAME not in (tmp_path / "on" / "config.json").read_text()

    calls.clear()
    argv = base_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "off", steps=1)
    trainer = main(*parse_args([*argv, "--batch_vision_attention", "false"]))
    assert trainer.state.global_step == 1
    assert trainer.model.config.vision_config._attn_implementation == "sdpa"
    assert not calls


@pytest.mark.parametrize(
    ("family", "vision_param", "batched", "kernel"),
    [
        ("qwen2_5_vl", "modules_qkv_parameters", True, False),
        ("qwen2_5_vl", "modules_qkv_parameters", True, True),
        ("internvl", "layernorm_before", True, False),
        ("qwen2_5_vl", None, False, False),
    ],
    ids=["qwen2_5_vl", "qwen2_5_vl_varlen_kernel", "internvl", "qwen2_5_vl_unbatched_control"],
)
def test_compile_layers_compiles_the_vision_blocks_too(family, vision_param, batched, kernel, tiny_models, rows_file,
                                                       tmp_path, monkeypatch):  # fmt: skip
    """Full fine-tuning trains the vision tower: its blocks run compiled in the packed pass, with TRL's numbers. Qwen's
    batched attention is one varlen call where a kernel runs (the block is one graph, no segment plan), else an island
    read from one segment plan per ``cu_seqlens`` (the block splits around it: the control). A Qwen tower on plain sdpa
    splits its sequence with ``.tolist()`` inside the attention: its blocks stay eager (the control)."""
    import vlm_grpo.fastpath.compiled_layers as compiled_layers
    import vlm_grpo.fastpath.vision_attention as vision_attention

    graphs, plans = [], []
    build_plan = vision_attention._build_plan

    def recording(graph, example_inputs):
        graphs.append(" ".join(n.name for n in graph.graph.nodes if n.op == "placeholder"))
        return graph.forward

    monkeypatch.setattr(compiled_layers, "_compiled", {})
    monkeypatch.setattr(compiled_layers, "_BACKEND", recording)
    monkeypatch.setattr(vision_attention, "_build_plan", lambda *a: plans.append(1) or build_plan(*a))
    if kernel:
        monkeypatch.setattr(varlen, "CPU_STAND_IN", varlen.varlen_reference)
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, compile_layers=True,
                           batch_vision_attention=batched)  # fmt: skip
    inputs = real_batch(trainer)
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
    trainer.model.train()
    torch._dynamo.reset()
    plans.clear()
    assert_parity(trainer, inputs)
    blocks = compiled_layers.vision_blocks(trainer.model, trainer.vlm_module)
    text = [g for g in graphs if "input_layernorm" in g]
    assert text, "the decoder layers compile in every case"
    if vision_param is None:
        assert blocks == [] and not any("norm1" in g for g in graphs), "an unbatched Qwen tower must stay eager"
        return
    assert blocks and any(vision_param in g for g in graphs), graphs
    if family == "qwen2_5_vl":  # island: TRL's pass and ours, each one plan for the windows, one for the full layers
        assert len(plans) == (0 if kernel else 4), f"{len(plans)} segment plans"
        whole_block = any("norm1" in g and "norm2" in g for g in graphs)
        assert whole_block == kernel, "a block is one graph exactly when its attention is the varlen call"
    assert all("forward" not in block.__dict__ for block in blocks), "blocks restored after the pass"
