"""Real-shape preset of Mistral 3 (mistralai/Mistral-Small-3.1-24B-Instruct-2503's ``config.json``): keyword
arguments of a :class:`~vlm_grpo.testing.presets.Preset`, which ``presets.py`` builds (this file imports nothing
of ours)."""

from __future__ import annotations

from typing import Any

MISTRAL3_VOCAB = 131072
MISTRAL3_24B: dict[str, Any] = {
    "family": "mistral3",
    "reference": "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
    "vocab_size": MISTRAL3_VOCAB,
    "text": {
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": MISTRAL3_VOCAB,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e9},
        "tie_word_embeddings": False,
    },
    "vision": {  # Pixtral
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "head_dim": 64,
        "image_size": 1540,
        "patch_size": 14,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "model": {"tie_word_embeddings": False, "spatial_merge_size": 2},
    "processor": {"longest_edge": 1540},
    "generation": {"eos": ["</s>"], "pad": "<pad>", "bos": "<s>"},
    "params": 24.01e9,
}
