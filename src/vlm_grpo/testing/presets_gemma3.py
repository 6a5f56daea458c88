"""Real-shape preset of Gemma 3 (google/gemma-3-4b-it's ``config.json``): keyword arguments of a
:class:`~vlm_grpo.testing.presets.Preset`, which ``presets.py`` builds (this file imports nothing of ours)."""

from __future__ import annotations

from typing import Any

GEMMA3_VOCAB = 262208  # embedding rows (the tokenizer has 262145 entries)
GEMMA3_LAYERS = 34
GEMMA3_4B: dict[str, Any] = {
    "family": "gemma3",
    "reference": "google/gemma-3-4b-it",
    "vocab_size": GEMMA3_VOCAB,
    "text": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": GEMMA3_LAYERS,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "vocab_size": GEMMA3_VOCAB,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 1024,
        # Five local layers, then a global one.
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(GEMMA3_LAYERS)],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    },
    "vision": {  # SigLIP so400m, 896 px
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "image_size": 896,
        "patch_size": 14,
        "layer_norm_eps": 1e-6,
        "vision_use_head": False,
    },
    "model": {"mm_tokens_per_image": 256, "tie_word_embeddings": True},
    "processor": {"tile": 896},
    # generation_config.json: <eos> and <end_of_turn> stop.
    "generation": {"eos": ["<eos>", "<end_of_turn>"], "pad": "<pad>", "bos": "<bos>"},
    "params": 4.30e9,
}
