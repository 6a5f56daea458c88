"""The decode cache sized to the rows' real lengths (``decode.SIZED_CACHE``): it grows by attention windows as the
longest running row needs, and drops the rows a compaction leaves behind, while every token stays ``generate``'s.

The batches are test_decode_compact's (TRL's shape: shuffled groups, left-padded prompts of several lengths, rows
ending at many different steps); windows of 4 slots on the CPU path, as under a CUDA graph. What the cache should
hold is built from ``generate``'s rows alone: at each step the live rows (rounded up to the width chain, checked
every 2 steps) and the window the step attends over.
"""

from __future__ import annotations

import pytest
import torch

from test_decode_compact import STEPS, _batch, _config, _lengths, _ragged_eos, _run, _tiny_qwen
from vlm_grpo.fastpath import decode, decode_compact
from vlm_grpo.fastpath.decode_cache import SharedPositionLayer, resize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW, CHECK_EVERY = 4, 2


@pytest.fixture
def windows(monkeypatch):
    monkeypatch.setattr(decode, "_CHECK_EVERY", CHECK_EVERY)
    monkeypatch.setattr(decode_compact, "COMPACT", True)
    monkeypatch.setattr(decode, "ATTENTION_WINDOW", WINDOW)
    monkeypatch.setattr(decode, "_WINDOWS_WITHOUT_GRAPH", True)
    monkeypatch.setattr(decode, "SIZED_CACHE", True)  # opt-in (off by default)


@pytest.fixture(scope="module")
def model(tiny_models):
    return _tiny_qwen(tiny_models)


def _expected(rows: list[list[int]], eos: list[int], prefix: int, drop_rows: bool = True) -> list[tuple[int, int]]:
    """The (rows, slots) of each storage the cache should have, from generate's rows: the first window's slots and a
    spare one at full width; a new storage when a step's window passes the slots (rows kept), and when the live rows
    fit a narrower width of the chain at a check (``drop_rows``: that width's rows, slots kept)."""
    ends = [next((i for i, t in enumerate(row) if t in eos), STEPS) for row in rows]
    chain = decode_compact.widths(len(rows))

    def window(t: int) -> int:
        return -(-(prefix + t + 1) // WINDOW) * WINDOW  # the cache bucket (256) is never reached here

    width, held = len(rows), (len(rows), window(0) + 1)
    out = [held]
    for t in range(STEPS):
        if window(t) + 1 > held[1]:
            held = (held[0], window(t) + 1)
            out.append(held)
        if (t + 1) % CHECK_EVERY == 0:
            live = sum(end > t for end in ends)
            if not live:
                break
            fits = [w for w in chain if live <= w < width]
            if fits and t + 1 < STEPS:
                width = min(fits)
                if drop_rows:
                    held = (width, held[1])
                    out.append(held)
    return out


@pytest.mark.parametrize("sized", [True, False], ids=["sized", "control_longest_possible"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_the_cache_follows_the_rows_lengths(sized, sample, model, windows, monkeypatch):
    """Sized: the cache's storages are the ones the rows' lengths call for, its peak a fraction of the longest
    possible cache; the control (every row's prompt + max_completion from the start) must fail that."""
    monkeypatch.setattr(decode, "SIZED_CACHE", sized)
    batch = _batch()
    eos = _ragged_eos(model, sample, batch)
    ours, plain, same_sampler = _run(model, _config(model, sample, eos), batch)
    assert ours == plain and same_sampler
    stats = decode_compact.last_stats
    prefix = batch[0].size(1) - 1
    expected = _expected(plain, eos, prefix)
    assert len(stats.widths) >= 3 and len({slots for _, slots in expected}) >= 2, (stats.widths, expected)
    assert (stats.allocations == expected) == sized, (stats.allocations, expected)
    text = decode.peft_base(model).config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_slot = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * 4  # K and V, every layer, fp32
    longest = len(plain) * (decode.cache_length(prefix + STEPS) + 1) * per_slot
    assert (stats.peak_cache_bytes * 4 < longest) == sized, (stats.peak_cache_bytes, longest)
    assert stats.peak_cache_bytes >= max(r * s for r, s in stats.allocations) * per_slot


def test_an_exported_cache_grows_but_keeps_every_row(model, windows, monkeypatch):
    """The multi-turn cache reads every row's K/V after the decode: exported, the cache grows by windows but keeps
    the finished rows, and each row's written slots equal those of the longest possible cache (the control)."""
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    config = _config(model, False, eos)
    sized: list = []
    ours, plain, _ = _run(model, config, batch, export=sized)
    assert ours == plain and len(decode_compact.last_stats.widths) >= 3
    prefix = batch[0].size(1) - 1
    assert decode_compact.last_stats.allocations == _expected(plain, eos, prefix, drop_rows=False)
    sized = [(layer.keys.clone(), layer.values.clone()) for layer in sized[0].layers]
    monkeypatch.setattr(decode, "SIZED_CACHE", False)
    full: list = []
    _run(model, config, batch, export=full)
    assert full[0].layers[0].keys.size(2) > sized[0][0].size(2)
    for (keys, values), layer in zip(sized, full[0].layers, strict=True):
        for row, n in enumerate(_lengths(plain, eos)):
            torch.testing.assert_close(keys[row, :, : prefix + n], layer.keys[row, :, : prefix + n])
            torch.testing.assert_close(values[row, :, : prefix + n], layer.values[row, :, : prefix + n])


def test_a_kept_workspace_keeps_its_whole_cache(model, windows):
    """A kept workspace's graphs replay on its cache's addresses in the next call: it is not resized."""
    eos = _ragged_eos(model, False, _batch())
    ours, plain, _ = _run(model, _config(model, False, eos), _batch(), keep=True)
    assert ours == plain
    stats = decode_compact.last_stats
    assert len(stats.widths) >= 3 and len(stats.allocations) == 1
    decode._KEPT.clear()


def test_resize_copies_the_written_slots_of_the_first_rows_and_zeros_the_rest():
    rows, heads, slots, dim = 4, 2, 6, 3
    position = torch.tensor(3)
    layers = []
    for i in range(2):
        layer = SharedPositionLayer(slots, position, advances=i == 1)
        layer.lazy_initialization(torch.zeros(rows, heads, 0, dim), torch.zeros(rows, heads, 0, dim))
        layer.keys.copy_(torch.randn(rows, heads, slots, dim))
        layer.values.copy_(torch.randn(rows, heads, slots, dim))
        layers.append(layer)
    cache = type("Cache", (), {"layers": layers})()
    before = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
    peak = resize(cache, 3, 9, 4)
    for (keys, values), layer in zip(before, layers, strict=True):
        assert layer.keys.shape == (3, heads, 9, dim) and layer.max_cache_len == 9 and layer.batch_size == 3
        assert torch.equal(layer.keys[:, :, :4], keys[:3, :, :4]) and torch.equal(
            layer.values[:, :, :4], values[:3, :, :4]
        )
        assert not layer.keys[:, :, 4:].any() and not layer.values[:, :, 4:].any()
        assert layer.cumulative_length is position
    old, new = rows * heads * slots * dim * 4, 3 * heads * 9 * dim * 4  # bytes of one tensor, before and after
    # Moving the k-th tensor holds the 4 - k old ones not yet moved and k + 1 new ones.
    assert peak == max((4 - k) * old + (k + 1) * new for k in range(4))


def _micro(monkeypatch):
    """benchmarks/micro/decode_compact_micro.py as a module (its folder and benchmarks/ on the path)."""
    import importlib.util

    from e2e_utils import BENCH

    for folder in (BENCH, BENCH / "micro"):
        monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location("_decode_compact_micro", BENCH / "micro" / "decode_compact_micro.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_compares_each_row_up_to_its_eos(monkeypatch):
    """Two decodes whose longest rows differ return outputs of different widths (each padded to its longest row): a
    row that ended the same way in both counts as the same, a row that went another way differs from the step where
    it did. The control, whole padded rows compared, would call every row different."""
    micro = _micro(monkeypatch)
    eos, pad = 7, 0
    a = torch.tensor([[5, 7, 0, 0, 0, 0], [4, 4, 4, 7, 0, 0], [9, 8, 1, 2, 3, 7], [3, 7, 0, 0, 0, 0]])
    b = torch.tensor([[5, 7, 0, 0], [4, 4, 4, 7], [9, 8, 2, 7], [3, 3, 7, pad]])
    assert micro.compared(a, b, {eos}) == (2, 1)  # rows 0 and 1 agree; row 3 differs at step 1, row 2 at step 2
    assert micro.compared(a, a, {eos}) == (4, None)
    assert sum(x == y for x, y in zip(a.tolist(), b.tolist(), strict=True)) == 0  # the control


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_the_benchmark_finds_the_sized_cache_decodes_the_default_caches_tokens(greedy, monkeypatch, tmp_path):
    """``--compare sized`` on CPU (windows of 8 slots, bf16, rows ending at many lengths): the same tokens in every
    row both ways, a cache that moved into several storages, and a lower peak than the default's."""
    from vlm_grpo.fastpath import decode

    micro = _micro(monkeypatch)
    argv = [
        "--preset", "tiny", "--device", "cpu", "--unique", "3", "--group", "4", "--prompt_len", "12",
        "--max_new_tokens", "48", "--mean", "12", "--calls", "2", "--windows_on_cpu", "true", "--window", "8",
        "--compare", "sized", "--dtype", "bfloat16", "--greedy", str(greedy), "--out", str(tmp_path / "sized.json"),
    ]  # fmt: skip
    before = (decode.SIZED_CACHE, decode.ATTENTION_WINDOW, decode._WINDOWS_WITHOUT_GRAPH)
    summary = micro.main(argv)
    assert (decode.SIZED_CACHE, decode.ATTENTION_WINDOW, decode._WINDOWS_WITHOUT_GRAPH) == before  # put back
    assert summary["rows_with_the_same_tokens"] == "24/24" and summary["first_differing_steps"] == [None, None]
    sized, default = summary["calls"][0::2], summary["calls"][1::2]
    assert all(c["sized_cache"] and c["cache_storages"] > 2 and len(c["widths"]) > 1 for c in sized), sized
    assert all(len(c["narrowed_at_steps"]) == len(c["widths"]) - 1 for c in summary["calls"])
    assert all(n % 8 == 0 and 0 < n < c["steps"] for c in summary["calls"] for n in c["narrowed_at_steps"])
    assert all(not c["sized_cache"] and c["cache_storages"] == 1 for c in default), default
    assert summary["sized_peak_cache_gib"] < summary["default_peak_cache_gib"]
