"""Real shapes of GLM-4.1V-9B and GLM-4.5V (their ``config.json``) for :data:`vlm_grpo.testing.presets.PRESETS`.

Plain data (overrides of the tiny build in ``tiny_glm4v.py``), so ``presets.py`` can import it.
"""

from __future__ import annotations

from typing import Any

# The processors' defaults in transformers (Glm4vImageProcessor / Glm4vVideoProcessor).
GLM_PIXELS = {
    "min_pixels": 112 * 112,
    "max_pixels": 28 * 28 * 15000,
    "video_min_pixels": 112 * 112,
    "video_max_pixels": 28 * 28 * 2 * 30000,
}
GLM_EOS = {"eos": ["<|endoftext|>", "<|user|>", "<|observation|>"], "pad": "<|endoftext|>", "bos": "<sop>"}
GLM4V_9B: dict[str, Any] = {
    "reference": "zai-org/GLM-4.1V-9B-Thinking",
    "vocab_size": 151552,
    "text": {
        "hidden_size": 4096,
        "intermediate_size": 13696,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [8, 12, 12],
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
        },
    },
    "vision": {
        "depth": 24,
        "hidden_size": 1536,
        "intermediate_size": 13696,
        "num_heads": 12,
        "out_hidden_size": 4096,
        "image_size": 336,
    },
    "processor": GLM_PIXELS,
    "generation": GLM_EOS,
    "params": 10.3e9,
}
GLM4V_MOE_106B: dict[str, Any] = {
    "reference": "zai-org/GLM-4.5V",
    "vocab_size": 151552,
    "text": {
        "hidden_size": 4096,
        "intermediate_size": 10944,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 65536,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.0,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [8, 12, 12],
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
        },
    },
    "vision": {
        "depth": 24,
        "hidden_size": 1536,
        "intermediate_size": 10944,
        "num_heads": 12,
        "out_hidden_size": 4096,
        "image_size": 336,
    },
    "processor": GLM_PIXELS,
    "generation": GLM_EOS,
    "params": 108e9,
}
