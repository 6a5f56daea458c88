"""A decoder on a kernel that ignores dense masks (flash_attention_2, flex, ...) never gets the packed pass's
block mask: the trainer moves the text decoder to sdpa's kernels (one info line) and the numbers stay TRL's."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import test_group_sharing
from test_group_sharing import assert_parity, make_trainer, real_batch
from vlm_grpo.fastpath.block_attention import NAME, PackedGroup
from vlm_grpo.fastpath.sharing import build_mask

STAND_IN = "vlm_grpo_test_no_dense_masks"  # (a name with "flash" in it would be looked up on the hub)
CALLS: list[int] = []


def flash_stand_in(module, query, key, value, attention_mask, **kwargs):
    """Like flash-attn: no dense 4-D masks (flash_attention_2 would ignore one and attend across blocks)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        raise AssertionError("a flash-like kernel was handed a dense 4-D mask")
    CALLS.append(query.shape[-2])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(STAND_IN, flash_stand_in)
rows_file = test_group_sharing.rows_file  # the same two-row file (a module-scoped fixture)
AttentionMaskInterface.register(STAND_IN, sdpa_mask)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_a_flash_like_decoder_trains_the_packed_pass_on_sdpa_kernels(
    family, tiny_models, rows_file, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr("vlm_grpo.utils._warned", set())  # the info line is once per process
    with caplog.at_level(logging.INFO, logger="vlm_grpo.fastpath.block_attention"):
        trainer = make_trainer(tiny_models[family], rows_file, tmp_path, attn=STAND_IN)
    text = trainer.model.config.get_text_config(decoder=True)
    assert text._attn_implementation == NAME  # moved off the stand-in, onto the block kernel
    assert sum(STAND_IN in r.getMessage() and "sdpa" in r.getMessage() for r in caplog.records) == 1
    CALLS.clear()
    assert_parity(trainer, real_batch(trainer))  # the packed pass equals TRL's per-row pass


def test_the_stand_in_refuses_the_dense_block_mask(tiny_models, rows_file, tmp_path):
    """Negative control: the packed pass's dense mask, handed to the stand-in, is refused."""
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    layer = next(m for m in trainer.model.modules() if hasattr(m, "q_proj"))
    q = k = v = torch.randn(1, 2, 6, 8)
    mask = build_mask((PackedGroup(2, (2, 2)),), 6, None, "cpu")
    with pytest.raises(AssertionError, match="dense 4-D mask"):
        flash_stand_in(layer, q, k, v, mask)
