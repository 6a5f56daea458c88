"""The SmolVLM (Idefics3) real-shape preset (:data:`vlm_grpo.testing.presets.PRESETS`)."""

from __future__ import annotations

from typing import Any

#: HuggingFaceTB/SmolVLM-Instruct (model_type idefics3): SmolLM2-1.7B and a SigLIP-so400m tower, 384 px tiles
#: shuffled by 3 into 81 tokens, images resized to a 1536 px longest edge (4 x 4 tiles at most).
SMOLVLM_2B: dict[str, Any] = {
    "family": "idefics3",
    "reference": "HuggingFaceTB/SmolVLM-Instruct",
    "vocab_size": 49155,
    "params": 2.25e9,
    "text": {
        "hidden_size": 2048,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 8192,
        "vocab_size": 49155,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 273768.0},
        "tie_word_embeddings": False,
    },
    "vision": {
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 384,
        "patch_size": 14,
    },
    "model": {"scale_factor": 3, "tie_word_embeddings": False},
    "processor": {"tile": 384, "longest_edge": 1536},
    "generation": {"eos": ["<end_of_utterance>"], "pad": "<|im_end|>", "bos": "<|im_start|>"},
}
