"""Rows that end at different steps, each at its own EOS, as real rollouts do: the speed path gives each row the tokens
``generate`` gives it and, at every step the row is live, the same distribution (log-softmax within 1e-5), with a
negative control. The host checks for finished rows every 2 steps here, so finished rows leave the decode batch
(``fastpath.decode_compact``) several times: a live row's distribution is then read from the narrow batch."""

from __future__ import annotations

import pytest
import torch
from trl import GRPOTrainer

import vlm_grpo.fastpath.decode_select as decode_select
from test_generation_parity import (
    TOL,
    _decode_logps,
    _tokenized_batch,
    generation_gap,
    sharp_models,  # noqa: F401  (a fixture)
)
from test_group_sharing import G, make_trainer, rows_file  # noqa: F401  (rows_file: a fixture)
from vlm_grpo.fastpath import decode, decode_compact

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STEPS = 12


def _ragged(trainer) -> list[int]:
    """Make EOS of up to 3 tokens the rows draw at different steps (none in the first 3 steps), chosen greedily for
    the most distinct lengths; returns the rows' lengths."""
    first, _ = _decode_logps(trainer, trainer._generate_single_turn, _tokenized_batch(trainer), seed=0)

    def lengths(tokens: list[int]) -> list[int]:
        return [next((i + 1 for i, t in enumerate(row) if t in tokens), len(row)) for row in first]

    eos: list[int] = []
    candidates = sorted({t for row in first for t in row[3:]})
    for _ in range(3):
        eos.append(max(candidates, key=lambda t: len(set(lengths([*eos, t])))))
    trainer.generation_config.eos_token_id = eos
    trainer.eos_token_ids = eos
    return lengths(eos)


def _live_gap(trainer, monkeypatch, seed: int = 0) -> tuple[bool, float, list[int]]:
    """(same tokens, max |log-prob difference| over every step of every row up to its end, the decode's widths)
    between the speed path and TRL's generate. Our decode steps' LM head outputs are mapped to batch rows through
    the decode's row order after each compaction; a live step of a row that none of them computed is a failure."""
    batch = _tokenized_batch(trainer)
    plain, plain_logps = _decode_logps(trainer, lambda *a: GRPOTrainer._generate_single_turn(trainer, *a), batch, seed)
    rows, vocab = plain_logps.size(0), plain_logps.size(-1)
    state: dict = {"decoding": False, "order": None}
    steps: list[torch.Tensor] = []
    real_decode, real_compact = decode._decode, decode_compact.compact

    def decoding(*args, **kwargs):
        state["decoding"] = True
        try:
            return real_decode(*args, **kwargs)
        finally:
            state["decoding"] = False

    def compact(ws, *args):
        real_compact(ws, *args)
        state["order"] = ws.order.clone()

    def record(module, args, out):
        if state["decoding"]:
            width = out.size(0)
            order = torch.arange(rows) if state["order"] is None else state["order"]
            step = torch.full((rows, vocab), float("nan"))
            step[order[:width]] = torch.log_softmax(out.reshape(width, -1, vocab)[:, -1].float(), dim=-1)
            steps.append(step)

    monkeypatch.setattr(decode, "_decode", decoding)
    monkeypatch.setattr(decode_compact, "compact", compact)
    hook = trainer.model.get_output_embeddings().register_forward_hook(record)
    try:
        torch.manual_seed(seed)
        ours, _ = trainer._generate_single_turn(*batch, G)
    finally:
        hook.remove()
    ours_logps = torch.stack(steps[: plain_logps.size(1)], dim=1)
    live = torch.zeros(rows, plain_logps.size(1), dtype=torch.bool)
    for r, row in enumerate(plain):
        live[r, : len(row)] = True  # generate's completions are cut after EOS
    gap = (ours_logps - plain_logps).abs().amax(-1)[live]  # nan where a live row was not computed
    return ours == plain, float(gap.max()) if not gap.isnan().any() else float("inf"), decode_compact.last_stats.widths


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_rows_ending_at_different_steps_decode_as_generate(family, sharp_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    trainer = make_trainer(sharp_models(family), rows_file, tmp_path, max_completion_length=STEPS)
    lengths = _ragged(trainer)
    assert len(set(lengths)) >= 3 and min(lengths) < STEPS, lengths  # the fixture: rows really end apart
    monkeypatch.setattr(decode, "_CHECK_EVERY", 2)
    same_tokens, gap, widths = _live_gap(trainer, monkeypatch)
    assert same_tokens and gap <= TOL, gap
    assert len(widths) >= 2, widths  # rows left the batch


def test_the_ragged_test_catches_rows_stopped_when_the_first_row_ends(sharp_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    """Negative control: a decode that ends every row once any row has ended (any for all) must fail."""
    trainer = make_trainer(sharp_models("qwen2_5_vl"), rows_file, tmp_path, max_completion_length=STEPS)
    _ragged(trainer)
    real = decode_select.Selection.select

    def any_for_all(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.eos is not None and bool((self.unfinished == 0).any()):
            self.unfinished.zero_()

    monkeypatch.setattr(decode_select.Selection, "select", any_for_all)
    same_tokens, _ = generation_gap(trainer)
    assert not same_tokens


def test_the_ragged_test_catches_a_compaction_that_mixes_up_rows(sharp_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    """Negative control: a compaction that leaves the rows' fed tokens in their old places must fail."""
    trainer = make_trainer(sharp_models("qwen2_5_vl"), rows_file, tmp_path, max_completion_length=STEPS)
    _ragged(trainer)
    monkeypatch.setattr(decode, "_CHECK_EVERY", 2)
    real = decode_compact.compact

    def tokens_left_behind(ws, *args):
        before = ws.tokens.clone()
        real(ws, *args)
        ws.tokens.copy_(before)

    monkeypatch.setattr(decode_compact, "compact", tokens_left_behind)
    same_tokens, gap, widths = _live_gap(trainer, monkeypatch)
    assert len(widths) >= 2 and not (same_tokens and gap <= TOL), (widths, gap)
