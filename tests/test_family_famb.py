"""Qwen3-VL-MoE, Gemma 3 and Mistral 3 on real TRL batches: the speed path matches TRL where it serves the
family, and steps aside (one info line, TRL's numbers) where it cannot."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from PIL import Image

import test_group_sharing
import vlm_grpo.fastpath.sharing as sharing
import vlm_grpo.utils
from test_group_sharing import MM_KEYS, G, _generate_both, assert_parity, make_trainer, real_batch, rows_file  # noqa: F401
from vlm_grpo.fastpath import route

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def fresh_log_once(monkeypatch):
    """Each test sees the speed path's once-per-process lines anew."""
    monkeypatch.setattr(vlm_grpo.utils, "_warned", set())
    monkeypatch.setattr(route, "_logged", set())


@pytest.fixture
def packed_calls(monkeypatch):
    calls = []
    real = sharing._packed_forward
    monkeypatch.setattr(sharing, "_packed_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.fixture(scope="module")
def text_rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "rows.jsonl"
    rows = [
        {"conversations": [{"from": "human", "value": "How many dots?"}, {"from": "gpt", "value": "1"}]},
        {
            "conversations": [
                {"from": "human", "value": "Count the red squares, please."},
                {"from": "gpt", "value": "2"},
            ]
        },
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def noisy_rows(tmp_path_factory):
    """Rows with noise images: a one-colour image's patches are all alike, its attention uniform, and the vision
    tower's q/k gradients are zero up to rounding (relative comparisons of them measure noise)."""
    root = tmp_path_factory.mktemp("noisy")
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a.png": (64, 48), "b.png": (56, 90)}.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / name)
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Red?"}, {"from": "gpt", "value": "1"}]},
        {
            "image": ["a.png", "b.png"],
            "conversations": [{"from": "human", "value": "<image> or <image>?"}, {"from": "gpt", "value": "2"}],
        },
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _greedy(trainer):
    config = trainer.generation_config
    config.do_sample = False
    config.min_new_tokens = config.max_new_tokens  # no early stop
    config.repetition_penalty = 5.0  # tiny random models repeat one token otherwise


def test_qwen3_vl_moe_packed_pass_matches_trl(tiny_models, rows_file, tmp_path, packed_calls):  # noqa: F811
    trainer = make_trainer(tiny_models["qwen3_vl_moe"], rows_file, tmp_path)
    assert_parity(trainer, real_batch(trainer))
    assert packed_calls  # the packed pass served it


def test_qwen3_vl_moe_fast_decode_gives_generates_tokens(tiny_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    trainer = make_trainer(tiny_models["qwen3_vl_moe"], rows_file, tmp_path)
    _greedy(trainer)
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert all(len(set(c)) > 2 for c in ours)


def test_qwen3_vl_moe_router_loss_goes_through_trl(tiny_models, rows_file, tmp_path, packed_calls, caplog):  # noqa: F811
    """TRL adds the router's load-balancing loss for MoE models: that pass is TRL's, said once."""
    trainer = make_trainer(tiny_models["qwen3_vl_moe"], rows_file, tmp_path)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == pytest.approx(0.001)
    inputs = real_batch(trainer)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    C = inputs["completion_ids"].size(1)
    mm = {k: inputs.get(k) for k in MM_KEYS}
    with caplog.at_level(logging.INFO, logger="vlm_grpo"):
        ours = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, compute_aux_loss=True, **mm)
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, compute_aux_loss=True, **mm)
    ref = test_group_sharing.GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, trainer.model, ids, mask, C, compute_aux_loss=True, **mm
    )
    assert not packed_calls
    assert ours[2] is not None and torch.equal(ours[2], ref[2]) and ours[2] > 0
    assert caplog.text.count("router's auxiliary loss") == 1


def test_mistral3_image_batches_take_the_packed_pass_and_shared_prefill(
    tiny_models, noisy_rows, tmp_path, packed_calls, monkeypatch
):
    """Pixtral's ``image_sizes`` are sliced per group with the pixels: the packed pass and the shared prefill (one
    vision pass over the unique images) give TRL's numbers."""
    trainer = make_trainer(tiny_models["mistral3"], noisy_rows, tmp_path)
    inputs = real_batch(trainer)
    assert inputs["image_sizes"].shape == (3 * G, 2) and len(set(map(tuple, inputs["image_sizes"].tolist()))) == 2
    assert_parity(trainer, inputs)
    assert packed_calls
    _greedy(trainer)
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert all(len(set(c)) > 2 for c in ours)


@pytest.mark.parametrize("family, why", [("gemma3", "token_type_ids")])
def test_image_batches_step_aside_to_trl(family, why, tiny_models, rows_file, tmp_path, packed_calls,  # noqa: F811
                                         caplog):  # fmt: skip
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    with caplog.at_level(logging.INFO, logger="vlm_grpo"):
        inputs = real_batch(trainer)
        assert inputs.get(why) is not None
        assert_parity(trainer, inputs)
    assert not packed_calls
    assert f"share_prompt steps aside: model inputs the packed pass does not build ({why})" in caplog.text
    assert "share_prefill/fast_decode cannot honour sliding-window or hybrid attention layers" in caplog.text


def test_gemma3_sliding_window_keeps_the_packed_pass_off(tiny_models, rows_file, tmp_path, packed_calls, monkeypatch):  # noqa: F811
    """Without token types (a text-only caller), Gemma 3's local layers alone keep the packed pass off; the
    negative control packs anyway and the numbers differ from TRL's."""
    trainer = make_trainer(tiny_models["gemma3"], rows_file, tmp_path)
    inputs = real_batch(trainer)
    del inputs["token_type_ids"]
    assert_parity(trainer, inputs)
    assert not packed_calls
    monkeypatch.setattr(sharing.decode, "has_local_layers", lambda model: False)
    with pytest.raises(AssertionError, match="not close"):
        assert_parity(trainer, inputs)
    assert packed_calls


def test_mistral3_text_batches_take_the_speed_path(tiny_models, text_rows, tmp_path, packed_calls, monkeypatch):
    trainer = make_trainer(tiny_models["mistral3"], text_rows, tmp_path)
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    pad = trainer._tokenizer.pad_token_id
    inputs["completion_mask"][1, 2:] = 0
    inputs["completion_ids"][1, 2:] = pad
    assert_parity(trainer, inputs)
    assert packed_calls
    _greedy(trainer)
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
