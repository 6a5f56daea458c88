"""Tiny offline LLaVA-OneVision (``llava_onevision``) build and the real-shape preset's pieces.

28 px tiles of 2 x 2 patches (4 tokens per tile, ``vision_feature_select_strategy="full"``) and
``image_grid_pinpoints`` up to 3 x 3 tiles, so anyres tiling, unpadding, the ``image_newline`` column and the
``anyres_max`` cap (``anyres_max_4`` here) all shape the image token count at a few dozen tokens. The chat
template is LLaVA-OneVision's Qwen2 turns (``<image>`` on a line of its own) with Qwen2.5's tool format.
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.testing.presets import Preset
from vlm_grpo.testing.tiny_parts import COMMON_SPECIAL_TOKENS, TinyFamily, merged, text_config
from vlm_grpo.tools.templates import LLAVA_IMAGE, LLAVA_VIDEO, tool_chat_template

TILE = 28  # px: patch 14 -> 2 x 2 patches per tile
PINPOINTS = [[TILE * r, TILE * c] for r in (1, 2, 3) for c in (1, 2, 3)]
HALF = [0.5, 0.5, 0.5]


def _build(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionImageProcessor,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    tile = preset.processor.get("tile", TILE)
    pinpoints = [list(p) for p in preset.processor.get("pinpoints", PINPOINTS)]
    vision = merged(
        {
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": tile,
            "patch_size": 14,
        },
        preset.vision,
    )
    top = merged({"tie_word_embeddings": False, "vision_aspect_ratio": "anyres_max_4"}, preset.model)
    config = LlavaOnevisionConfig(
        text_config=merged({"model_type": "qwen2", **text_config(tokenizer, SPEC)}, preset.text),
        vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        **top,
    )
    size = {"height": tile, "width": tile}
    image = LlavaOnevisionImageProcessor(
        size=size, image_grid_pinpoints=pinpoints, image_mean=HALF, image_std=HALF, do_pad=True
    )
    video = LlavaOnevisionVideoProcessor(size=size, image_mean=HALF, image_std=HALF)
    processor = LlavaOnevisionProcessor(
        image,
        tokenizer,
        video,
        num_image_tokens=(tile // vision["patch_size"]) ** 2,
        vision_feature_select_strategy="full",
        vision_aspect_ratio=top["vision_aspect_ratio"],
        chat_template=CHAT_TEMPLATE,
    )
    return config, processor


CHAT_TEMPLATE = tool_chat_template(LLAVA_IMAGE, LLAVA_VIDEO, default_system=None)
SPEC = TinyFamily(_build, CHAT_TEMPLATE, (*COMMON_SPECIAL_TOKENS, "<image>", "<video>"))
