"""Attention windows of fast_decode: each decode step reads only the written part of the static cache.

Under a CUDA graph, an sdpa model decodes in windows of ``ATTENTION_WINDOW`` cache slots, one captured step per
window, captured when the loop first reaches it. CPU cannot capture graphs, so these tests take the same windowed
path without them (``_WINDOWS_WITHOUT_GRAPH``): a step per window, its warm-up passes writing into the live cache
under ``cache_restored``, and attention over the window's slots only. Small windows and buckets make a short
decode cross several windows. The tokens must stay generate's.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import test_decode_speed
import test_group_sharing
from test_decode_speed import _decode, _tiny_qwen
from test_group_sharing import _generate_both, assert_samples_like_generate, make_trainer
from vlm_grpo.fastpath import decode, decode_attention
from vlm_grpo.testing.tiny import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")
rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images

STEPS = 14  # completion tokens: with windows of 4 slots, 3 or 4 windows


def _windows_on(monkeypatch, window: int = 4, bucket: int = 8, spy_scores: bool = True) -> dict[str, list]:
    """Small windows on the CPU path; returns what the steps saw: each window's mask length, the mask's slots (the
    whole decode's), the slots the cache had then (it grows by windows: ``SIZED_CACHE``), the cache length when the
    window's step was made (prefix + its first step), the warm-up count, and the key lengths the decode step's sdpa
    read."""
    monkeypatch.setattr(decode, "ATTENTION_WINDOW", window)
    monkeypatch.setattr(decode, "CACHE_BUCKET", bucket)
    monkeypatch.setattr(decode, "_WINDOWS_WITHOUT_GRAPH", True)
    seen: dict[str, list] = {"masks": [], "sizes": [], "cache": [], "starts": [], "warmups": [], "keys": []}
    real_init = decode._Step.__init__

    def spy_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        seen["masks"].append(self.mask.size(-1))
        seen["sizes"].append(self.mask.stride(0))  # the mask is (rows, 1, 1, slots): its rows are slots apart
        seen["cache"].append(self.cache.layers[0].keys.size(2))
        seen["starts"].append(int(self.cache.layers[0].cumulative_length))
        seen["warmups"].append(self.warmups)

    real_scores = decode_attention._fp32_scores

    def scores(q, k):
        seen["keys"].append(k.size(1))
        return real_scores(q, k)

    monkeypatch.setattr(decode._Step, "__init__", spy_init)
    if spy_scores:  # not under torch.compile: the spy would be traced
        monkeypatch.setattr(decode_attention, "_fp32_scores", scores)
    return seen


def _assert_windows(seen: dict[str, list], window: int = 4, steps: int = STEPS) -> None:
    masks, size, prefix = seen["masks"], seen["sizes"][0] - 1, seen["starts"][0]  # size: less the spare slot
    assert len(masks) >= 3, masks  # the decode crossed several windows
    starts = [start - prefix for start in seen["starts"]]
    assert list(zip(starts, masks, strict=True)) == decode.window_schedule(prefix, steps, window, size)
    assert seen["warmups"] == [2] + [1] * (len(masks) - 1)
    if decode.SIZED_CACHE:
        assert seen["cache"] == [m + 1 for m in masks]  # the cache grew by windows (and the spare slot)
    else:
        assert seen["cache"] == [size + 1] * len(masks)  # the whole decode's slots from the start
    assert set(seen["keys"]) == set(masks), (set(seen["keys"]), masks)  # sdpa read each window's slots, no more


def test_window_schedule_by_hand():
    schedule = decode.window_schedule
    # prefix 5, windows of 4 in a 16-slot cache: step 0 needs 6 slots (8), step 3 needs 9 (12), step 7 needs 13.
    assert schedule(5, 10, 4, 16) == [(0, 8), (3, 12), (7, 16)]
    assert schedule(5, 10, 0, 16) == [(0, 16)]  # windows off: the whole cache
    assert schedule(5, 10, 256, 16) == [(0, 16)]  # a window longer than the cache is the cache
    assert schedule(3, 5, 4, 8) == [(0, 4), (1, 8)]  # step 0 fills the first window exactly
    assert schedule(0, 10, 3, 12) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert schedule(0, 10, 5, 12) == [(0, 5), (5, 10)]  # steps 0..9 need at most 10 slots
    assert schedule(2, 9, 5, 16) == [(0, 5), (3, 10), (8, 15)]  # never past what the last step needs
    assert schedule(5, 0, 4, 16) == []
    # A 330-token prompt (prefix 329), 1024 new tokens, the default window and bucket: a 1536-slot cache.
    size = decode.cache_length(329 + 1024, 256)
    assert size == 1536
    assert schedule(329, 1024, 256, size) == [(0, 512), (183, 768), (439, 1024), (695, 1280), (951, 1536)]


@pytest.mark.parametrize("heads", [6, 2], ids=["grouped", "one_query_head_per_kv_head"])
def test_decode_sdpa_on_a_window_equals_the_full_cache(heads):
    """Keys past the window are masked out: cutting K/V to the window changes nothing (1e-6); a window that cuts
    off a written, attended slot (negative control) must differ. With one query head per K/V head too."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, n, 8, generator=g) for h, n in ((heads, 1), (2, 40), (2, 40)))
    written = 13
    mask = torch.rand(3, 1, 1, 40, generator=g) > 0.3  # padded prompt slots
    mask[..., written:] = False  # unwritten slots
    mask[..., written - 1] = True  # the newest token attends to itself
    layer = SimpleNamespace(num_key_value_groups=heads // 2, is_causal=True, training=False)
    full, _ = decode_attention.decode_sdpa(layer, q, k, v, mask, scaling=0.3)
    for window in (written, 16, 39):
        ours, _ = decode_attention.decode_sdpa(layer, q, k, v, mask[..., :window], scaling=0.3)
        torch.testing.assert_close(ours, full, rtol=0, atol=1e-6)
    cut, _ = decode_attention.decode_sdpa(layer, q, k, v, mask[..., : written - 1], scaling=0.3)
    assert (cut - full).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_decode_gives_generates_greedy_tokens(family, tiny_models, rows_file, tmp_path, monkeypatch):
    seen = _windows_on(monkeypatch)
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, max_completion_length=STEPS)
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens  # no early stop
    trainer.generation_config.repetition_penalty = 5.0  # tiny random models repeat one token otherwise
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert all(len(set(c)) > 2 and len(c) == STEPS for c in ours)
    _assert_windows(seen)


def test_windows_that_do_not_divide_the_cache(tiny_models, rows_file, tmp_path, monkeypatch):
    """Windows of 3 slots in a cache of a multiple of 16: the last window is capped at the cache length."""
    seen = _windows_on(monkeypatch, window=3, bucket=16)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS)
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens
    trainer.generation_config.repetition_penalty = 5.0
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    _assert_windows(seen, window=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_decode_samples_what_generate_samples(family, tiny_models, rows_file, tmp_path, monkeypatch):
    seen = _windows_on(monkeypatch)
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, max_completion_length=STEPS)
    assert_samples_like_generate(trainer, monkeypatch)
    _assert_windows(seen)


def test_windowed_decode_stops_rows_at_eos_like_generate(tiny_models, rows_file, tmp_path, monkeypatch):
    seen = _windows_on(monkeypatch)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS)
    trainer.generation_config.repetition_penalty = 2.0  # sampled rows that differ from each other
    first, _, _ = _generate_both(trainer, monkeypatch)

    def cut(row, tok):
        return row.index(tok) + 1 if tok in row else len(row)

    # An EOS that some rows emit after the first window and others never: rows end mid-decode, others go on.
    eos = next(t for row in first for t in row if len({cut(r, t) for r in first}) > 1 and cut(row, t) > 4)
    trainer.generation_config.eos_token_id = [eos]
    trainer.eos_token_ids = [eos]
    seen["masks"].clear()
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert sorted(len(c) for c in ours) == sorted(cut(r, eos) for r in first)
    assert len(set(seen["masks"])) >= 2


def test_eager_attention_takes_no_windows(tiny_models, rows_file, tmp_path, monkeypatch):
    """Eager adds the mask to scores over every cache slot: one step over the whole cache, as before windows."""
    seen = _windows_on(monkeypatch)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, attn="eager", max_completion_length=STEPS)
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens
    trainer.generation_config.repetition_penalty = 5.0
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert seen["masks"] == seen["sizes"][:1] and seen["keys"] == []  # one step, whole cache; decode_sdpa unused


def _static_cache(layers: int = 2, rows: int = 3, size: int = 10, length: int = 5):
    """A StaticCache full of random K/V, every layer's length at ``length``."""
    from transformers import Qwen2Config, StaticCache

    config = Qwen2Config(num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, hidden_size=8)
    cache = StaticCache(config=config, max_cache_len=size)
    cache.early_initialization(rows, [2] * layers, [4] * layers, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=g))
        layer.values.copy_(torch.randn(layer.values.shape, generator=g))
        layer.cumulative_length.fill_(length)
    return cache


def _snapshot(cache) -> list[tuple[torch.Tensor, ...]]:
    return [(x.keys.clone(), x.values.clone(), x.cumulative_length.clone()) for x in cache.layers]


def _garbage_passes(cache, rewind, passes: int = 2) -> None:
    """What warm-up passes do to the cache, with garbage for K/V: each pass rewinds, writes, advances."""
    for _ in range(passes):
        rewind()
        for layer in cache.layers:
            shape = (*layer.keys.shape[:2], 1, layer.keys.size(-1))
            layer.update(torch.full(shape, 1e4), torch.full(shape, -1e4))


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "control_not_restored"])
def test_cache_restored_puts_back_what_the_passes_wrote(restore):
    cache = _static_cache()
    before = _snapshot(cache)
    with decode.cache_restored(cache) if restore else contextlib.nullcontext(lambda: None) as rewind:
        _garbage_passes(cache, rewind)
        inside = _snapshot(cache)
    after = _snapshot(cache)
    for (k0, _, _), (k1, _, n1) in zip(before, inside, strict=True):
        changed = (k0 != k1).any(dim=(0, 1, 3)).nonzero().flatten().tolist()
        assert changed == ([5] if restore else [5, 6]), changed  # rewound: every pass wrote slot 5 only
        assert int(n1) == (6 if restore else 7)
    same = all(torch.equal(a, b) for x, y in zip(before, after, strict=True) for a, b in zip(x, y, strict=True))
    assert same == restore


@pytest.mark.parametrize("restore", [True, False], ids=["restored", "control_not_restored"])
def test_warm_ups_that_write_garbage_mid_decode_change_no_token(restore, tiny_models, rows_file, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """Each window's warm-up writes into the live cache, mid-decode. Here they write garbage K/V: restored, the
    tokens are generate's; without the restore (control) the decode attends the garbage and they change."""
    _windows_on(monkeypatch, window=4, bucket=256)  # room past the last step: unrestored lengths run on
    monkeypatch.setattr(decode._Step, "_warm_up", lambda self, rewind, *model: _garbage_passes(self.cache, rewind))
    if not restore:
        monkeypatch.setattr(decode, "SIZED_CACHE", False)  # unrestored lengths would run past a sized cache's end

        @contextlib.contextmanager
        def not_restored(cache):
            yield lambda: None

        monkeypatch.setattr(decode, "cache_restored", not_restored)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS)
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens
    trainer.generation_config.repetition_penalty = 5.0
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"]
    assert (ours == plain) == restore


@pytest.mark.parametrize("mark", [True, False], ids=["marked_dynamic", "control_unmarked"])
def test_windows_of_a_call_share_one_compilation(mark, tiny_models, monkeypatch):
    """The window length (the mask's last dimension) is marked dynamic: every window of a call, the last one
    (which reaches the cache's end) included, runs the compilation the first one made, and a later call in the
    same bucket compiles nothing; the cache, which grows into new storage at each window (``SIZED_CACHE``), has its
    slots marked dynamic too. Unmarked (control), the second window recompiles."""
    from torch._dynamo.utils import counters

    seen = _windows_on(monkeypatch, window=4, bucket=32, spy_scores=False)
    monkeypatch.setattr(test_decode_speed, "NEW_TOKENS", 12)
    if not mark:
        monkeypatch.setattr(decode, "_window_mask", lambda mask, length, compile: mask[..., :length])
    monkeypatch.setattr(decode, "_compiled_forward", None)
    monkeypatch.setattr(torch.compiler.config, "job_id", None)  # a cold process's counts (no saved dynamic profile)
    torch._dynamo.reset()
    model = _tiny_qwen(tiny_models)
    counters.clear()
    ours, plain = _decode(model, 20, compile=True)  # 19 + 12 slots: windows 20, 24, 28, 32 in a 32-slot cache
    assert ours == plain and seen["masks"] == [20, 24, 28, 32] and seen["sizes"][0] == 33
    first = counters["stats"]["unique_graphs"]
    ours, plain = _decode(model, 18, compile=True)  # windows 20, 24, 28, 32 from another first step
    assert ours == plain and seen["masks"][4:] == [20, 24, 28, 32]
    assert (first == 1) == mark, first
    assert counters["stats"]["unique_graphs"] == first  # a repeat call in the bucket: nothing new
