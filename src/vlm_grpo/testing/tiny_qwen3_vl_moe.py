"""Tiny Qwen3-VL-MoE: Qwen3-VL's processor, template and vision tower, with a sparse-MoE language model.

Every decoder layer routes each token to 2 of 4 small experts (``moe_intermediate_size`` 48: 2 x 48 is not the
hidden size, so the hub layout of the experts, transposed, is told apart by its shape), as the real
checkpoints route to 8 of 128; ``output_router_logits`` is in the config, so TRL's router auxiliary loss applies.
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.testing.presets import Preset
from vlm_grpo.testing.tiny_parts import (
    COMMON_SPECIAL_TOKENS,
    QWEN3_TINY_VISION,
    QWEN_SPECIAL_TOKENS,
    TinyFamily,
    merged,
    qwen3_rope,
    qwen_processors,
    qwen_token_ids,
    text_config,
)
from vlm_grpo.tools.templates import QWEN_IMAGE, QWEN_VIDEO, tool_chat_template

CHAT_TEMPLATE = tool_chat_template(QWEN_IMAGE, QWEN_VIDEO, default_system=None)
MOE_DIMS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "decoder_sparse_step": 1}


def build(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Qwen3VLMoeConfig, Qwen3VLProcessor, Qwen3VLVideoProcessor

    text = text_config(tokenizer, head_dim=16, rope_parameters=qwen3_rope(), **MOE_DIMS)
    config = Qwen3VLMoeConfig(
        text_config=merged(text, preset.text),
        vision_config=merged(QWEN3_TINY_VISION, preset.vision),
        **merged({"tie_word_embeddings": True, **qwen_token_ids(tokenizer)}, preset.model),
    )
    # Qwen3-VL's processors: patch 16 x merge 2 = 32 px per image token, 64x64 .. 128x128 px (4 .. 16 tokens).
    image, video = qwen_processors(16, 64 * 64, 128 * 128, Qwen3VLVideoProcessor, preset.processor)
    return config, Qwen3VLProcessor(image, tokenizer, video, chat_template=CHAT_TEMPLATE)


def hub_layout(out_dir: Any) -> None:
    """Store the experts as the hub checkpoints do: ``gate_up_proj`` as (experts, hidden, 2 x moe_intermediate) and
    ``down_proj`` as (experts, moe_intermediate, hidden), transposed from the model's layout, which transformers
    transposes back when loading. Saved in the model's own layout, a checkpoint loads without ZeRO-3 but not with
    it (transformers 5.24 compares the shape with the partitioned parameter's, which is empty, and transposes)."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    for path in sorted(Path(out_dir).glob("*.safetensors")):
        tensors = load_file(path)
        experts = [k for k in tensors if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
        if experts:
            tensors.update({k: tensors[k].transpose(1, 2).contiguous() for k in experts})
            save_file(tensors, path, metadata={"format": "pt"})


SPEC = TinyFamily(build, CHAT_TEMPLATE, COMMON_SPECIAL_TOKENS + QWEN_SPECIAL_TOKENS, saved=hub_layout)
