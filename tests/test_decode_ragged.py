"""Rows that end at different steps, each at its own EOS, as real rollouts do: the speed path gives each row the tokens
``generate`` gives it and, at every step, the same distribution (log-softmax within 1e-5), with a negative control."""

from __future__ import annotations

import pytest

import vlm_grpo.fastpath.decode_select as decode_select
from test_generation_parity import (
    TOL,
    _decode_logps,
    _tokenized_batch,
    generation_gap,
    sharp_models,  # noqa: F401  (a fixture)
)
from test_group_sharing import make_trainer, rows_file  # noqa: F401  (rows_file: a fixture)

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


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_rows_ending_at_different_steps_decode_as_generate(family, sharp_models, rows_file, tmp_path):  # noqa: F811
    trainer = make_trainer(sharp_models(family), rows_file, tmp_path, max_completion_length=STEPS)
    lengths = _ragged(trainer)
    assert len(set(lengths)) >= 3 and min(lengths) < STEPS, lengths  # the fixture: rows really end apart
    same_tokens, gap = generation_gap(trainer)
    assert same_tokens and gap <= TOL, gap


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
