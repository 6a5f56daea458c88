"""Speed features of fast_decode that must not change a token.

Static cache lengths come in buckets: a new prompt length in a bucket already seen reuses the compiled
decode step (a new compilation costs tens of seconds at 3B on a GPU), and the extra cache slots change
no token. The decode step's attention reads grouped K/V without copying it per query head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from vlm_grpo.fastpath import decode, decode_attention
from vlm_grpo.fastpath.sharing import _generation_positions, _next_positions
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.utils import peft_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")

G = 2
NEW_TOKENS = 5


def test_cache_lengths_round_up_to_the_bucket():
    assert [decode.cache_length(n, 256) for n in (1, 255, 256, 257, 600)] == [256, 256, 256, 512, 768]
    assert decode.cache_length(427) == decode.cache_length(458) == 512  # 300..331-token prompts, 128 new


def _decode(model, prompt_len: int, compile: bool, keep: bool | None = False, index: list[int] | None = None):
    """Prefill two random text prompts of ``prompt_len`` tokens and decode G rows each (or the rows ``index``
    names), greedily; returns fast_decode's tokens and generate's on the same rows."""
    g = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(100, 1000, (2, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    index = torch.arange(2).repeat_interleave(G) if index is None else torch.tensor(index)
    config = peft_base(model).generation_config
    config.do_sample, config.max_new_tokens, config.min_new_tokens = False, NEW_TOKENS, NEW_TOKENS
    config.repetition_penalty = 5.0  # tiny random models repeat one token otherwise
    base = peft_base(model)
    with torch.no_grad():
        cache = DynamicCache(config=base.config)
        prefill = {"attention_mask": mask[:, :-1]}
        positions = _generation_positions(base, ids[:, :-1], prefill)
        if positions is not None:  # mrope families
            prefill["position_ids"] = positions
        model(input_ids=ids[:, :-1], **decode.cache_kwarg(model, cache), use_cache=True, **prefill)
        nxt = _next_positions(positions, getattr(base.model, "rope_deltas", None))
        ours = decode.fast_decode(
            model, cache, index, ids[index], mask[index], nxt, config, use_graph=False, compile=compile, keep=keep
        )
        plain = model.generate(input_ids=ids[index], attention_mask=mask[index], generation_config=config)
    return ours.tolist(), plain[:, prompt_len:].tolist()


@pytest.mark.parametrize("bucket", [None, 1], ids=["buckets", "control_no_buckets"])
def test_a_new_prompt_length_in_a_seen_bucket_compiles_nothing(bucket, tiny_models, monkeypatch):
    from torch._dynamo.utils import counters

    if bucket is not None:
        monkeypatch.setattr(decode, "CACHE_BUCKET", bucket)
    # A full-size cache, as a kept workspace has (a sized one marks its length dynamic from the first call).
    monkeypatch.setattr(decode, "SIZED_CACHE", False)
    monkeypatch.setattr(decode, "_compiled_forward", None)  # a fresh compiled step, no shapes seen
    monkeypatch.setattr(torch.compiler.config, "job_id", None)  # a cold process's counts (no saved dynamic profile)
    torch._dynamo.reset()
    module = get_vlm_module(str(tiny_models["qwen2_5_vl"]))
    model = module.load_model(str(tiny_models["qwen2_5_vl"]), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    counters.clear()
    compiled = []
    for length in (20, 23, 31):
        ours, plain = _decode(model, length, compile=True)
        assert ours == plain, length  # the masked extra slots change no token
        assert len({t for row in ours for t in row}) > 2
        compiled.append(counters["stats"]["unique_graphs"])
    assert compiled[0] >= 1, "dynamo compiled nothing"
    if bucket is None:
        assert compiled[-1] == compiled[0], compiled  # 20, 23 and 31 tokens share one cache length
    else:
        assert compiled[-1] > compiled[0], compiled  # without buckets the second length recompiles


def _tiny_qwen(tiny_models):
    module = get_vlm_module(str(tiny_models["qwen2_5_vl"]))
    model = module.load_model(str(tiny_models["qwen2_5_vl"]), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def test_decode_attention_reads_grouped_kv_uncopied_and_keeps_generates_tokens(tiny_models, monkeypatch):
    """4 query heads share 2 K/V heads in the tiny model: the step's scores GEMM gets the 2-head cache as it is,
    the 2 query heads of each K/V head stacked on the query axis."""
    shapes = []
    real = decode_attention._fp32_scores

    def spy(q, k):
        shapes.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k)

    monkeypatch.setattr(decode_attention, "_fp32_scores", spy)
    model = _tiny_qwen(tiny_models)
    ours, plain = _decode(model, 20, compile=False)
    assert ours == plain and len({t for row in ours for t in row}) > 2
    rows, kv_heads = 2 * G, model.config.text_config.num_key_value_heads
    group = model.config.text_config.num_attention_heads // kv_heads
    assert shapes and all(q[:2] == (rows * kv_heads, group) and k[0] == rows * kv_heads for q, k in shapes), shapes
    assert model.config.text_config._attn_implementation == "sdpa"  # restored after the decode


@pytest.mark.parametrize("shared_prompt", [True, False], ids=["shared", "control_off"])
def test_every_family_hands_the_attention_kernel_each_rows_first_row(shared_prompt, tiny_models, monkeypatch):
    """The decode attention's kernel gets, per row, the first row of its prompt and the prompt's slot count
    (rows 1, 0, 1, 0 of two prompts: first rows 0, 1, 0, 1), through each family's decoder, which passes the keyword
    down to the attention function; the tokens are generate's. With ``SHARED_PROMPT`` off (the control) it gets
    None. The kernel is a stand-in here (Triton's interpreter runs the real one in test_decode_kernel.py)."""
    from vlm_grpo.testing.tiny import FAMILIES

    handed = []

    def kernel(query, key, value, mask, scale, shared=None):
        handed.append(None if shared is None else (shared[0].tolist(), int(shared[1])))
        return decode_attention.one_token_attention(query, key, value, mask, scale)

    stand_in = SimpleNamespace(supported=lambda *tensors: True, decode_attention_kernel=kernel)
    monkeypatch.setattr(decode_attention, "decode_kernel", stand_in)
    monkeypatch.setattr(decode_attention, "SHARED_PROMPT", shared_prompt)
    for family in FAMILIES:
        path = str(tiny_models[family])
        model = get_vlm_module(path).load_model(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        handed.clear()
        ours, plain = _decode(model, 20, compile=False, index=[1, 0, 1, 0])
        assert ours == plain, family
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        assert len(handed) == layers * NEW_TOKENS, (family, len(handed))
        expected = ([0, 1, 0, 1], 19) if shared_prompt else None
        assert all(h == expected for h in handed), (family, handed[:2])


@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_decode_attention_equals_transformers_sdpa_with_repeated_kv(mask_kind, monkeypatch):
    """The function against transformers' own sdpa path (which expands K/V per query head), on a padded
    mask; the negative control pairs query heads with the wrong K/V head and must differ."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, n, 8, generator=g) for h, n in ((6, 1), (2, 40), (2, 40)))
    mask = torch.rand(3, 1, 1, 40, generator=g) > 0.3
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    layer = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
    ours, _ = decode_attention.decode_sdpa(layer, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    real = decode_attention._fp32_scores

    def misgrouped(q, k):  # query head h to K/V head h % 2 instead of h // 3
        rows_kv, group, dim = q.shape
        return real(q.reshape(-1, 2, group, dim).transpose(1, 2).reshape(rows_kv, group, dim), k)

    monkeypatch.setattr(decode_attention, "_fp32_scores", misgrouped)
    wrong, _ = decode_attention.decode_sdpa(layer, q, k, v, mask, scaling=0.3)
    assert (wrong - ref).abs().max() > 1e-2


def test_decode_attention_keeps_half_precision_scores_in_fp32():
    """bf16 inputs: the scores are computed in fp32 as sdpa's kernels do, so a large logit keeps its precision; the
    result stays within bf16 rounding of an fp32 reference."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((4, 1), (2, 30), (2, 30)))
    q = q * 6  # large logits: bf16 scores would round them by ~0.1
    mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    layer = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    ref, _ = decode_attention.decode_sdpa(layer, q, k, v, mask, scaling=0.25)
    half, _ = decode_attention.decode_sdpa(layer, *(t.bfloat16() for t in (q, k, v)), mask, scaling=0.25)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=0, atol=3e-2)
    scores = decode_attention._fp32_scores(q[:, :2, 0].bfloat16().reshape(4, 1, 16), k.bfloat16().reshape(4, 30, 16))
    assert scores.dtype == torch.float32


def test_decode_attention_under_autocast_keeps_fp32_scores_as_sdpa_does(monkeypatch):
    """fp32 weights under a bf16 autocast hand the decode fp32 q / k (rotary) and bf16 v. sdpa, cast by autocast,
    computes bf16 inputs with fp32 scores; so must the decode's attention (autocast would round its scores GEMM's
    output to bf16): the same scores as without autocast on bf16 inputs, and the result sdpa gives there."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((4, 1), (2, 30), (2, 30)))
    q, v = q * 6, v.bfloat16()  # large logits: bf16 scores would round them by ~0.1
    mask = torch.rand(2, 1, 1, 30, generator=g) > 0.2
    layer = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    real, seen = decode_attention._fp32_scores, []
    monkeypatch.setattr(decode_attention, "_fp32_scores", lambda *a: seen.append(real(*a)) or seen[-1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.25)
        ours, _ = decode_attention.decode_sdpa(layer, q, k, v, mask, scaling=0.25)
    plain, _ = decode_attention.decode_sdpa(layer, q.bfloat16(), k.bfloat16(), v, mask, scaling=0.25)
    assert [s.dtype for s in seen] == [torch.float32, torch.float32]
    torch.testing.assert_close(seen[0], seen[1], rtol=0, atol=0)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours, plain, rtol=0, atol=0)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0, atol=2e-2)


def _count_gemms(monkeypatch) -> list[int]:
    """Spy on the GEMMs of the fused groups: the output width of each call."""
    from vlm_grpo.fastpath import decode_fusion

    widths: list[int] = []

    def linear(x, weight, bias=None):
        widths.append(weight.size(0))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(decode_fusion, "F", SimpleNamespace(linear=linear))
    return widths


def test_fused_projections_run_one_gemm_per_group_and_keep_generates_tokens(tiny_models, monkeypatch):
    """q|k|v and gate|up: one GEMM each per layer and token; the tokens stay generate's; the modules are the
    model's own again after the call."""
    model = _tiny_qwen(tiny_models)
    text = model.config.text_config
    before = {name: module for name, module in model.named_modules()}
    widths = _count_gemms(monkeypatch)
    ours, plain = _decode(model, 20, compile=False)
    assert ours == plain and len({t for row in ours for t in row}) > 2
    qkv = (text.num_attention_heads + 2 * text.num_key_value_heads) * (text.hidden_size // text.num_attention_heads)
    gate_up = 2 * text.intermediate_size
    layers = text.num_hidden_layers
    # Every decode step: one q|k|v and one gate|up GEMM per layer (the step's last token is not fed back).
    steps = len(widths) // (2 * layers)
    assert steps >= NEW_TOKENS - 1 and sorted(set(widths)) == sorted({qkv, gate_up}), (widths[:4], qkv, gate_up)
    assert widths.count(qkv) == widths.count(gate_up) == steps * layers
    assert {name: module for name, module in model.named_modules()} == before


def _lora_model(tiny_models, dropout: float = 0.0, dora: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(
        r=4,
        lora_alpha=64,
        lora_dropout=dropout,
        use_dora=dora,
        target_modules=["q_proj", "v_proj", "up_proj", "o_proj", "down_proj"],
        init_lora_weights=False,
    )  # random A and B: the adapter changes the tokens
    return get_peft_model(_tiny_qwen(tiny_models), config).eval()


def _adapter_calls(model) -> list[int]:
    calls = [0]
    for module in model.modules():
        if hasattr(module, "lora_A"):  # the LoRA layers (folded ones are swapped out and never called)
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(
    ("dropout", "dora"), [(0.0, False), (0.1, False), (0.0, True)], ids=["folded", "dropout_layer_runs", "dora_runs"]
)
def test_fused_projections_keep_the_lora_terms(dropout, dora, tiny_models, monkeypatch):
    """LoRA without dropout: the adapters are folded into the fused GEMMs, o and down projections included (no
    adapter GEMM runs while decoding); with dropout, or DoRA, the LoRA layer runs as it is around the fused base.
    Either way the tokens are generate's with the adapter. The negative control folds nothing and must change the
    tokens."""
    from vlm_grpo.fastpath import decode_fusion

    model = _lora_model(tiny_models, dropout, dora)
    folded = dropout == 0.0 and not dora
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = _adapter_calls(model)
    fast_calls = []
    fast_decode = decode.fast_decode

    def counted(*args, **kwargs):
        before = calls[0]
        out = fast_decode(*args, **kwargs)
        fast_calls.append(calls[0] - before)
        return out

    monkeypatch.setattr(decode, "fast_decode", counted)
    widths = _count_gemms(monkeypatch)
    ours, plain = _decode(model, 20, compile=False)
    assert widths and ours == plain
    assert (fast_calls[0] == 0) == folded, fast_calls  # adapters folded, or run by their layers
    assert all(torch.equal(weights[n], p) for n, p in model.named_parameters())  # the model is never changed

    monkeypatch.setattr(decode_fusion, "_lora_delta", lambda lora: None)  # control: adapters left out
    decode_fusion._PLANS.clear()
    control, plain_again = _decode(model, 20, compile=False)
    assert plain_again == plain
    assert (control != plain) == folded


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control_unguarded"])
def test_fused_projections_follow_merged_and_disabled_adapters(guarded, tiny_models, monkeypatch):
    """Adapters merged into the base weights: fused decode gives generate's tokens. Merged and then disabled,
    PEFT unmerges them on the layer's next forward: fusion stands aside for that call (the decoder then gives
    the base model's output); the control fuses anyway and keeps the adapter in its output."""
    from vlm_grpo.fastpath import decode_fusion

    model = _lora_model(tiny_models)
    model.merge_adapter()
    ours, plain = _decode(model, 20, compile=False)
    assert ours == plain
    if not guarded:
        monkeypatch.setattr(decode_fusion, "_unmerges_on_forward", lambda module: False)
    decoder = peft_base(model).get_decoder()
    ids = torch.randint(100, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
    with model.disable_adapter(), torch.no_grad():
        with decode_fusion.fused_projections(decoder) as fused:
            inside = decoder(input_ids=ids).last_hidden_state
        base = decoder(input_ids=ids).last_hidden_state  # PEFT has unmerged by now: the base model's output
    assert (fused == 0) == guarded
    assert torch.allclose(inside, base, atol=1e-5) == guarded
