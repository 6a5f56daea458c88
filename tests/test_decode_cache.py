"""The decode loop's static cache (``fastpath.decode_cache``): one write position for every layer, advanced once a
step, and put back around a capture's warm-up passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, StaticCache

from vlm_grpo.fastpath.decode_cache import SharedPositionLayer, cache_restored, decode_cache

LAYERS, ROWS, KV_HEADS, DIM, SLOTS = 3, 2, 2, 4, 10


def _config(layers: int = LAYERS) -> Qwen2Config:
    return Qwen2Config(
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=KV_HEADS, hidden_size=8,
        intermediate_size=16, vocab_size=64,
    )  # fmt: skip


def _prefill_layers(key_dtype=torch.float32, value_dtype=torch.float32) -> list[SimpleNamespace]:
    """What decode_cache reads of the prefill cache's layers: their K/V (one unique prompt of 5 slots)."""
    return [
        SimpleNamespace(keys=torch.zeros(1, KV_HEADS, 5, DIM, dtype=key_dtype),
                        values=torch.zeros(1, KV_HEADS, 5, DIM, dtype=value_dtype))
        for _ in range(LAYERS)
    ]  # fmt: skip


def _step(cache, value: float = 1.0) -> list[int]:
    """One decode step's cache writes, layer by layer (K/V of layer i filled with value + i); the position each
    layer saw before its write."""
    seen = []
    for i in range(LAYERS):
        seen.append(int(cache.get_seq_length()))
        new = torch.full((ROWS, KV_HEADS, 1, DIM), value + i)
        cache.update(new, -new, i)
    return seen


def _written(cache) -> list[list[int]]:
    """Per layer, the slots holding something other than zeros."""
    return [layer.keys.ne(0).any(dim=(0, 1, 3)).nonzero().flatten().tolist() for layer in cache.layers]


@pytest.mark.parametrize("advancing", ["last", "every"], ids=["last_layer_advances", "control_every_layer"])
def test_every_layer_writes_the_step_slot_and_the_position_moves_once(advancing):
    cache = decode_cache(_config(), SLOTS, _prefill_layers(), ROWS)
    assert len({id(layer.cumulative_length) for layer in cache.layers}) == 1  # one position for all layers
    if advancing == "every":  # control: as if each layer advanced the shared position (per-layer counters did)
        for layer in cache.layers:
            layer.advances = True
    cache.layers[0].cumulative_length.fill_(5)
    seen = _step(cache)
    if advancing == "last":
        assert seen == [5, 5, 5] and int(cache.get_seq_length()) == 6
        assert _written(cache) == [[5]] * LAYERS
        assert [float(layer.keys[0, 0, 5, 0]) for layer in cache.layers] == [1.0, 2.0, 3.0]
        assert [float(layer.values[1, 1, 5, 3]) for layer in cache.layers] == [-1.0, -2.0, -3.0]
        assert _step(cache, 10.0) == [6, 6, 6] and _written(cache) == [[5, 6]] * LAYERS
    else:
        assert seen == [5, 6, 7] and _written(cache) == [[5], [6], [7]]


def test_the_layers_keep_the_prefill_dtypes_and_the_plain_static_cache_layout():
    """Under an fp32 autocast the prefill's keys are fp32 and its values bf16: each cache layer keeps both, with
    the rows and slots asked for, as the StaticCache the decode used before (same class, same tensor shapes)."""
    cache = decode_cache(_config(), SLOTS, _prefill_layers(torch.float32, torch.bfloat16), ROWS)
    plain = StaticCache(config=_config(), max_cache_len=SLOTS)
    assert isinstance(cache, StaticCache) and len(cache.layers) == len(plain.layers) == LAYERS
    for layer in cache.layers:
        assert isinstance(layer, SharedPositionLayer)
        assert layer.keys.shape == layer.values.shape == (ROWS, KV_HEADS, SLOTS, DIM)
        assert (layer.keys.dtype, layer.values.dtype) == (torch.float32, torch.bfloat16)
    assert [layer.advances for layer in cache.layers] == [False, False, True]


def test_sliding_window_layers_are_refused():
    """A sliding layer would be replaced by a full one: refused (fast_decode sends such models to generate)."""
    config = _config()
    config.layer_types, config.sliding_window = ["full_attention", "sliding_attention", "full_attention"], 4
    assert type(StaticCache(config=config, max_cache_len=SLOTS).layers[1]).__name__ == "StaticSlidingWindowLayer"
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer"):
        decode_cache(config, SLOTS, _prefill_layers(), ROWS)


def test_cache_restored_rewinds_the_shared_position():
    """Warm-up passes under cache_restored each write the step's slot; on exit the cache is as it was."""
    cache = decode_cache(_config(), SLOTS, _prefill_layers(), ROWS)
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    cache.layers[0].cumulative_length.fill_(4)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with cache_restored(cache) as rewind:
        for value in (1e4, 2e4):
            rewind()
            assert _step(cache, value) == [4, 4, 4]
        changed = [(layer.keys != k).any(dim=(0, 1, 3)).nonzero().flatten().tolist() for layer, (k, _) in
                   zip(cache.layers, before, strict=True)]  # fmt: skip
        assert changed == [[4]] * LAYERS and int(cache.get_seq_length()) == 5
    assert int(cache.get_seq_length()) == 4
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


@pytest.mark.parametrize("kind", ["decode_cache", "static_cache"], ids=["shared_position", "control_per_layer"])
def test_a_traced_decode_step_advances_one_position(kind):
    """What the compiled step launches per token: one in-place add on the write position, not one per layer (at
    3B on an H100 the per-layer counters were 36 kernels, ~55 us of a ~3.5 ms token). Counted in the graph dynamo
    traces of a decoder's one-token forward; the plain StaticCache (control) has one per layer."""
    from transformers import Qwen2Model

    torch.manual_seed(0)
    model = Qwen2Model(_config()).eval()
    if kind == "decode_cache":
        cache = decode_cache(model.config, SLOTS, _prefill_layers(), ROWS)
    else:
        cache = StaticCache(config=model.config, max_cache_len=SLOTS)
        cache.early_initialization(ROWS, [KV_HEADS] * LAYERS, [DIM] * LAYERS, torch.float32, torch.device("cpu"))
    for layer in cache.layers:
        layer.cumulative_length.fill_(3)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(tokens, positions, mask):
        return model(
            input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=cache
        ).last_hidden_state

    tokens, positions = torch.ones(ROWS, 1, dtype=torch.long), torch.full((ROWS, 1), 3)
    mask = torch.zeros(ROWS, 1, 1, SLOTS, dtype=torch.bool)
    mask[..., :4] = True
    torch._dynamo.reset()
    out = torch.compile(step, backend=backend, fullgraph=True)(tokens, positions, mask)
    torch._dynamo.reset()
    adds = [
        n for g in graphs for n in g.graph.nodes
        if (n.op == "call_method" and n.target == "add_") or n.target in (torch.Tensor.add_, torch.ops.aten.add_.Tensor)
    ]  # fmt: skip
    assert len(adds) == (1 if kind == "decode_cache" else LAYERS), [str(n) for n in adds]
    assert torch.isfinite(out).all() and int(cache.layers[-1].cumulative_length) == 4
