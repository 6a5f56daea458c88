"""Real-shape preset of Qwen3-VL-MoE (Qwen/Qwen3-VL-30B-A3B-Instruct's ``config.json``): keyword arguments of a
:class:`~vlm_grpo.testing.presets.Preset`, which ``presets.py`` builds (this file imports nothing of ours)."""

from __future__ import annotations

from typing import Any

QWEN3_VL_VOCAB = 151936
QWEN3_VL_30B_A3B: dict[str, Any] = {
    "family": "qwen3_vl_moe",
    "reference": "Qwen/Qwen3-VL-30B-A3B-Instruct",
    "vocab_size": QWEN3_VL_VOCAB,
    "text": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "vocab_size": QWEN3_VL_VOCAB,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
            "rope_theta": 5e6,
        },
    },
    "vision": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,  # a 48x48 grid
        "deepstack_visual_indexes": [8, 16, 24],
    },
    "model": {"tie_word_embeddings": False},
    "params": 31.07e9,
}
