"""The benchmarks' MFU counts an MoE's active parameters: each token runs through ``num_experts_per_tok`` of the
routed experts (plus the router and any shared experts), not all of them (``benchmarks/bench_policy.py``).

The expected counts are worked out from the configs' own shapes (a routed expert is a SwiGLU MLP: gate, up and
down, ``3 * hidden * moe_intermediate`` weights), not read back from the model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from vlm_grpo.testing.tiny import build_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_policy import active_params, mfu

sys.path.pop(0)


def meta_model(preset: str):
    config, _ = build_config(preset)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def routed_expert_weights(config) -> tuple[int, int]:
    """(routed experts' weights of the whole model, the share of them a token runs through), from the config."""
    text = config.get_text_config()
    experts = getattr(text, "num_experts", None) or text.n_routed_experts
    dense = getattr(text, "first_k_dense_replace", 0) or 0  # GLM-4.5V: the first layers are dense MLPs
    per_layer = experts * 3 * text.hidden_size * text.moe_intermediate_size
    total = (text.num_hidden_layers - dense) * per_layer
    return total, total * text.num_experts_per_tok // experts


@pytest.mark.parametrize("preset", ["tiny_qwen3_vl_moe", "tiny_glm4v_moe"])
def test_tiny_moe_counts_the_experts_a_token_runs_through(preset):
    model = meta_model(preset)
    total = sum(p.numel() for p in model.parameters())
    experts, active_experts = routed_expert_weights(model.config)
    assert 0 < active_experts < experts < total
    assert active_params(model) == total - experts + active_experts


def test_a_dense_model_counts_every_parameter():
    model = meta_model("tiny_qwen2_5_vl")
    assert active_params(model) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("preset", "total", "active"),
    [("qwen3_vl_30b_a3b", 31.07e9, (3.0e9, 4.5e9)), ("glm4v_moe_106b", 108e9, (12e9, 15e9))],
)
def test_real_shape_moe_mfu_uses_the_active_parameters(preset, total, active):
    """Qwen3-VL-30B-A3B runs about 3B parameters a token (the "A3B"; 3.9B here, with its vision tower and input
    embedding), GLM-4.5V about 12B of its 106B (14.3B here): the MFU of a step that read 146% with all parameters
    counted reads about an eighth of it."""
    model = meta_model(preset)
    every = sum(p.numel() for p in model.parameters())
    assert every == pytest.approx(total, rel=0.03)
    assert active[0] < active_params(model) < active[1]
    tokens, seconds, peak = 4096.0, 1.0, 989.0
    dense_mfu = 6 * every * tokens / seconds / (peak * 1e12)
    assert mfu(model, tokens, seconds, peak) == pytest.approx(dense_mfu * active_params(model) / every)
    assert mfu(model, tokens, 0.0, peak) is None and mfu(model, tokens, seconds, None) is None
