"""The LLaVA-OneVision real-shape preset (:data:`vlm_grpo.testing.presets.PRESETS`)."""

from __future__ import annotations

from typing import Any

#: llava-hf/llava-onevision-qwen2-7b-ov-hf: Qwen2-7B and SigLIP-so400m (384 px, patch 14: 729 tokens a tile).
LLAVA_ONEVISION_7B: dict[str, Any] = {
    "family": "llava_onevision",
    "reference": "llava-hf/llava-onevision-qwen2-7b-ov-hf",
    "vocab_size": 152128,
    "params": 8.03e9,
    "text": {
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152128,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
    },
    "vision": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 26,
        "num_attention_heads": 16,
        "image_size": 384,
        "patch_size": 14,
    },
    "model": {"tie_word_embeddings": False, "vision_aspect_ratio": "anyres_max_9"},
    "processor": {"tile": 384, "pinpoints": [[384 * r, 384 * c] for r in range(1, 7) for c in range(1, 7)]},
    "generation": {"eos": ["<|im_end|>"], "pad": "<|endoftext|>", "bos": "<|endoftext|>"},
}
