"""Qwen3-VL-MoE, Gemma 3 and Mistral 3: the speed path's parity (or its stepping aside) on real TRL batches."""

from __future__ import annotations

import pytest

from test_group_sharing import _generate_both, assert_parity, make_trainer, real_batch, rows_file  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _greedy(trainer):
    config = trainer.generation_config
    config.do_sample = False
    config.min_new_tokens = config.max_new_tokens  # no early stop
    config.repetition_penalty = 5.0  # tiny random models repeat one token otherwise


@pytest.mark.parametrize("family", ["qwen3_vl_moe"])
def test_packed_pass_matches_trl(family, tiny_models, rows_file, tmp_path):  # noqa: F811
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    assert_parity(trainer, real_batch(trainer))


@pytest.mark.parametrize("family", ["qwen3_vl_moe"])
def test_fast_decode_gives_generates_tokens(family, tiny_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    _greedy(trainer)
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert all(len(set(c)) > 2 for c in ours)
