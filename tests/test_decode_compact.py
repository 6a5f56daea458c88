"""Finished rows leave fast_decode's batch (``fastpath.decode_compact``): the tokens stay generate's, greedy and
sampled under the same seed, while the rows computed drop to the live rows' (rounded up to the width chain).

The batches are as TRL hands them: prompts of several lengths (left-padded), each prompt's G rows spread over the
batch in shuffled order. EOS ids are picked from a first decode so that the rows end at many different steps, and
the host checks for finished rows every 2 steps, so a decode of 12 rows narrows several times (12 -> 6 -> 3 -> 2).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from test_decode_speed import _tiny_qwen
from vlm_grpo.fastpath import decode, decode_attention, decode_compact, decode_select
from vlm_grpo.fastpath.sharing import _generation_positions, _next_positions
from vlm_grpo.utils import peft_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT_LENGTHS = (9, 14, 6, 11)  # four prompts, left-padded to 14
G = 3
STEPS = 16
CHECK_EVERY = 2
NEVER = 10**6  # an EOS id past the vocabulary: no row ends (the same draws as with the EOS ids picked later)


def _batch(seed: int = 0):
    """(prompt ids (4, 14) left-padded, their mask, the shuffled row -> prompt index of 12 rows)."""
    g = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, width - n :] = torch.randint(100, 1000, (n,), generator=g)
        mask[i, width - n :] = 1
    index = torch.arange(len(PROMPT_LENGTHS)).repeat_interleave(G)
    return ids, mask, index[torch.randperm(index.numel(), generator=g)]


def _config(model, sample: bool, eos: list[int] | None):
    config = peft_base(model).generation_config
    config.max_new_tokens, config.min_new_tokens = STEPS, None
    config.do_sample, config.top_k, config.top_p, config.temperature = sample, None, None, 1.0
    config.repetition_penalty = None if sample else 5.0  # tiny random models repeat one token otherwise
    config.eos_token_id = eos or [NEVER]
    return config


def _run(model, config, batch, seed: int = 1, export: list | None = None, keep: bool = False, compile: bool = False):
    """fast_decode's tokens and generate's for the batch (each after ``torch.manual_seed(seed)``)."""
    ids, mask, index = batch
    base = peft_base(model)
    with torch.no_grad():
        cache = DynamicCache(config=base.config)
        prefill = {"attention_mask": mask[:, :-1]}
        positions = _generation_positions(base, ids[:, :-1], prefill)
        prefill["position_ids"] = positions
        model(input_ids=ids[:, :-1], **decode.cache_kwarg(model, cache), use_cache=True, **prefill)
        nxt = _next_positions(positions, getattr(base.model, "rope_deltas", None))
        torch.manual_seed(seed)
        ours = decode.fast_decode(
            model,
            cache,
            index,
            ids[index],
            mask[index],
            nxt,
            config,
            use_graph=False,
            compile=compile,
            keep=keep,
            export=export,
        )
        after = torch.rand(1)  # the sampler as the decode leaves it
        torch.manual_seed(seed)
        plain = model.generate(input_ids=ids[index], attention_mask=mask[index], generation_config=config)
        plain_after = torch.rand(1)
    return ours.tolist(), plain[:, ids.size(1) :].tolist(), bool(after == plain_after)


def _lengths(rows: list[list[int]], eos: list[int]) -> list[int]:
    return [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in rows]


def _ragged_eos(model, sample: bool, batch) -> list[int]:
    """5 EOS ids picked from a decode without them: the most narrowings of the batch, then rows ending at the most
    distinct steps (none in the first 2 steps)."""
    first, _, _ = _run(model, _config(model, sample, None), batch)
    candidates = sorted({t for row in first for t in row[2:]} - {t for row in first for t in row[:2]})
    eos: list[int] = []
    for _ in range(5):
        eos.append(
            max(candidates, key=lambda t: (len(_row_steps(first, [*eos, t])[1]), len(set(_lengths(first, [*eos, t])))))
        )
    return eos


def _row_steps(rows: list[list[int]], eos: list[int]) -> tuple[int, list[int]]:
    """The rows computed and the widths, as the width chain and a check every CHECK_EVERY steps give them: built
    from generate's rows alone (a row is live after step t until its EOS, if any, lies at or before t)."""
    ends = [next((i for i, t in enumerate(row) if t in eos), STEPS) for row in rows]
    chain, w = [len(rows)], len(rows)
    while w > decode_compact.MIN_ROWS:
        w = max(decode_compact.MIN_ROWS, -(-w // 2))
        chain.append(w)
    width, total, widths = len(rows), 0, [len(rows)]
    for t in range(STEPS):
        total += width
        if (t + 1) % CHECK_EVERY == 0:
            live = sum(end > t for end in ends)
            if not live:
                break
            fits = [c for c in chain if live <= c < width]
            if fits and t + 1 < STEPS:
                width = min(fits)
                widths.append(width)
    return total, widths


@pytest.fixture
def compacting(monkeypatch):
    monkeypatch.setattr(decode, "_CHECK_EVERY", CHECK_EVERY)
    monkeypatch.setattr(decode_compact, "COMPACT", True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return _tiny_qwen(tiny_models)


@pytest.mark.parametrize("windows", [False, True], ids=["one_window", "windows"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_rows_leave_the_batch_and_every_token_stays_generates(sample, windows, model, compacting, monkeypatch):
    if windows:  # a step per (width, window): windows of 4 slots, as under a CUDA graph
        monkeypatch.setattr(decode, "ATTENTION_WINDOW", 4)
        monkeypatch.setattr(decode, "_WINDOWS_WITHOUT_GRAPH", True)
    batch = _batch()
    eos = _ragged_eos(model, sample, batch)
    ours, plain, same_sampler = _run(model, _config(model, sample, eos), batch)
    lengths = _lengths(plain, eos)
    assert len(set(lengths)) >= 4 and min(lengths) < STEPS // 2, lengths  # the fixture: rows end far apart
    assert ours == plain
    assert same_sampler
    stats = decode_compact.last_stats
    expected, widths = _row_steps(plain, eos)
    assert stats.widths == widths and len(widths) >= 3, (stats.widths, widths, str(lengths))
    assert stats.row_steps == expected < stats.full_row_steps, (stats.row_steps, expected, stats.full_row_steps)
    live = sum(min(n, stats.steps) for n in lengths)  # each row's steps up to and with its EOS
    assert live <= stats.row_steps < (live + stats.full_row_steps) / 2, (live, stats.row_steps, stats.full_row_steps)


def test_in_step_selection_narrows_too(model, compacting, monkeypatch):
    """The selection the CUDA graph captures (processors read scores only: top-k), run in the step on CPU."""
    monkeypatch.setattr(decode, "_SELECT_IN_STEP_WITHOUT_GRAPH", True)
    batch = _batch(seed=3)
    eos = _ragged_eos(model, True, batch)
    config = _config(model, True, eos)
    config.top_k = 50
    ours, plain, same_sampler = _run(model, config, batch)
    assert ours == plain and same_sampler
    assert len(decode_compact.last_stats.widths) >= 3


def test_compaction_that_moves_the_wrong_rows_cache_fails_the_parity(model, compacting, monkeypatch):
    """Negative control: the cache rows gathered one place off (everything else right) must change tokens."""
    real = decode_compact.compact

    def off_by_one(ws, width, new, written, column, index):
        real(ws, width, new, written, column, index)
        for layer in ws.cache.layers:
            for x in (layer.keys, layer.values):
                x[:width, :, :written] = x[:width, :, :written].roll(1, 0)

    monkeypatch.setattr(decode_compact, "compact", off_by_one)
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    ours, plain, _ = _run(model, _config(model, False, eos), batch)
    assert len(decode_compact.last_stats.widths) >= 2
    assert ours != plain


def scores_only_sampling(model: Any) -> tuple[Any, Any]:
    """The ragged batch and a sampled config whose processor (top-k) reads the scores only, so the selection runs in
    the decode step."""
    batch = _batch()
    config = _config(model, True, _ragged_eos(model, True, batch))
    config.top_k = 50
    return batch, config


def prompt_map_kernel(monkeypatch: pytest.MonkeyPatch, updated: bool) -> None:
    """A stand-in for the GPU's decode kernel: it reads each row's prompt slots from the first row of its prompt
    (``shared``), which must be a row of the cache it is handed. ``updated`` False: compactions leave that map as it
    was (the control)."""
    from types import SimpleNamespace

    def kernel(query, key, value, mask, scale, shared=None):
        src, prefix = shared[0].long(), int(shared[1])
        assert int(src.max()) < key.size(0)
        key, value = (torch.cat([x[src, :, :prefix], x[:, :, prefix:]], dim=2) for x in (key, value))
        return decode_attention.one_token_attention(query, key, value, mask, scale)

    monkeypatch.setattr(
        decode_attention, "decode_kernel", SimpleNamespace(supported=lambda *t: True, decode_attention_kernel=kernel)
    )
    real = decode_compact.compact

    def stale(ws, *args):
        before = ws.shared[0].clone()
        real(ws, *args)
        ws.shared[0].copy_(before)

    if not updated:
        monkeypatch.setattr(decode_compact, "compact", stale)


@pytest.mark.parametrize("updated", [True, False], ids=["first_rows_updated", "control_stale_first_rows"])
def test_rows_read_their_prompt_from_a_first_row_of_the_narrow_batch(updated, model, compacting, monkeypatch):
    """The decode attention's kernel reads a row's prompt slots from the first row of its prompt (``shared``): after
    a compaction that must be a row of the narrow batch holding the same prompt. A stand-in kernel that reads them
    there keeps generate's tokens; the control, a compaction that leaves the map as it was, must not."""
    prompt_map_kernel(monkeypatch, updated)
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    ours, plain, _ = _run(model, _config(model, False, eos), batch)
    assert len(decode_compact.last_stats.widths) >= 3
    assert (ours == plain) == updated


def test_the_narrow_draw_takes_each_rows_noise_of_the_full_batch():
    """A narrowed selection's draw: the token torch.multinomial gives each row over the whole batch, and the
    generator left where it leaves it; the control (a draw over the narrow rows alone) differs."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(12, 300, generator=g) * 3, -1)
    rows = torch.tensor([7, 2, 11, 4, 0])
    sel = decode_select.Selection(12, 4, 1, torch.device("cpu")).narrowed(5, rows)
    torch.manual_seed(5)
    full = torch.multinomial(probs, 1).squeeze(1)
    after = torch.rand(1)
    torch.manual_seed(5)
    narrow = decode_select.multinomial_with(probs[rows], sel.noise(probs[rows]))
    assert narrow.tolist() == full[rows].tolist() and torch.rand(1) == after
    torch.manual_seed(5)
    alone = torch.multinomial(probs[rows], 1).squeeze(1)
    assert alone.tolist() != full[rows].tolist()


def test_an_exported_cache_is_in_batch_order(model, compacting, monkeypatch):
    """The multi-turn cache reads the decode's cache by batch row: after compaction each row's written slots are
    where a full-width decode leaves them."""
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    config = _config(model, False, eos)
    compacted: list = []
    ours, plain, _ = _run(model, config, batch, export=compacted)
    assert ours == plain and len(decode_compact.last_stats.widths) >= 3
    compacted = [(layer.keys.clone(), layer.values.clone()) for layer in compacted[0].layers]
    monkeypatch.setattr(decode_compact, "COMPACT", False)
    full: list = []
    _run(model, config, batch, export=full)
    assert decode_compact.last_stats.widths == [len(plain)]
    prefix = batch[0].size(1) - 1
    for (keys, values), layer in zip(compacted, full[0].layers, strict=True):
        for row, n in enumerate(_lengths(plain, eos)):
            torch.testing.assert_close(keys[row, :, : prefix + n], layer.keys[row, :, : prefix + n])
            torch.testing.assert_close(values[row, :, : prefix + n], layer.values[row, :, : prefix + n])


def test_a_kept_workspace_decodes_again_after_compacting(model, compacting):
    """Two calls in a row on one kept workspace: the second starts at full width from a fresh prompt (the first
    left its rows reordered) and reuses the steps of the widths both reach."""
    eos = _ragged_eos(model, False, _batch())
    config = _config(model, False, eos)
    for seed in (0, 0, 4):
        ours, plain, _ = _run(model, config, _batch(seed), keep=True)
        assert ours == plain, seed
        assert decode_compact.last_stats.widths[0] == len(plain)
    kept = decode._KEPT[peft_base(model).get_decoder()]
    assert len({width for width, _ in kept.steps}) >= 3
    decode._KEPT.clear()


def test_a_processor_with_rows_of_its_own_keeps_the_full_width(model, compacting, caplog):
    """encoder_repetition_penalty holds each row's prompt: no compaction, one info line, generate's tokens."""
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    config = _config(model, False, eos)
    config.encoder_repetition_penalty = 1.5
    try:
        with caplog.at_level(logging.INFO, logger="vlm_grpo.fastpath.decode_compact"):
            ours, plain, _ = _run(model, config, batch)
    finally:
        config.encoder_repetition_penalty = None
    assert ours == plain
    assert decode_compact.last_stats.widths == [len(plain)]
    assert "EncoderRepetitionPenaltyLogitsProcessor" in caplog.text


def test_width_chain():
    assert decode_compact.widths(320) == [320, 160, 80, 40, 20, 10, 5, 3, 2]
    assert decode_compact.narrower(320, 320, 161) is None  # more than half the width live: no move
    assert decode_compact.narrower(320, 320, 160) == 160
    assert decode_compact.narrower(320, 320, 7) == 10  # several halvings at once
    assert decode_compact.narrower(320, 3, 1) == 2
    assert decode_compact.narrower(320, 2, 1) is None  # the narrowest


@pytest.mark.parametrize("marked", [True, False], ids=["rows_dynamic", "control_unmarked"])
def test_a_compiled_step_compiles_once_for_every_width(marked, model, compacting, monkeypatch):
    """Compiled, a step reads its rows marked dynamic from the full width on (``decode_compact.rows_dynamic``): one
    compilation of the step serves every width, and a second call compiles nothing; its in-step selection compiles
    twice (at full width the draw is multinomial's own, narrowed each row takes its noise from the batch's draw).
    The tokens stay generate's. Unmarked (control), the first narrower width recompiles the step and the selection."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(decode, "_SELECT_IN_STEP_WITHOUT_GRAPH", True)  # the selection a CUDA graph captures
    if not marked:
        monkeypatch.setattr(decode_compact, "rows_dynamic", lambda v, mask: None)
    monkeypatch.setattr(decode, "_compiled_forward", None)
    torch._dynamo.reset()
    batch, config = scores_only_sampling(model)
    counters.clear()
    graphs = []
    for _ in range(2 if marked else 1):
        ours, plain, same_sampler = _run(model, config, batch, compile=True)
        assert ours == plain and same_sampler
        assert len(decode_compact.last_stats.widths) >= 3
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [3, 3] if marked else graphs[0] > 3, graphs


def test_an_eager_attention_model_narrows_with_its_additive_mask(tiny_models, compacting):
    """Eager attention adds a float mask to the scores: its rows move with the rest."""
    from vlm_grpo.modules import get_vlm_module

    path = str(tiny_models["qwen2_5_vl"])
    eager = get_vlm_module(path).load_model(path, dtype=torch.float32, attn_implementation="eager").eval()
    batch = _batch()
    eos = _ragged_eos(eager, False, batch)
    ours, plain, _ = _run(eager, _config(eager, False, eos), batch)
    assert ours == plain and len(decode_compact.last_stats.widths) >= 3
