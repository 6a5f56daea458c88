"""Tiny offline Idefics3 (``idefics3``) build, shared with SmolVLM (``smolvlm``), and the real-shape pieces.

28 px tiles of 2 x 2 patches shuffled by ``scale_factor`` 2 into one ``<image>`` token; images are resized to a
longest edge of 56 px and split into up to 2 x 2 tiles plus the global image, so the row/column tags, the row
newlines and the global image all show in a few dozen tokens. The chat template is SmolVLM's ``User:`` /
``Assistant:`` turns with Qwen2.5's tool format (:func:`~vlm_grpo.tools.templates.smolvlm_tool_template`).
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.testing.presets import Preset
from vlm_grpo.testing.tiny_parts import TinyFamily, merged, text_config
from vlm_grpo.tools.templates import smolvlm_tool_template

TILE = 28  # px: patch 14 -> 2 x 2 patches -> scale 2 -> 1 token
HALF = [0.5, 0.5, 0.5]
CHAT_TEMPLATE = smolvlm_tool_template()
# The SmolLM2 tokenizer's specials plus the image tags the processors look up.
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)


def build(tokenizer: Any, preset: Preset, smolvlm: bool) -> tuple[Any, Any]:
    import transformers

    prefix = "SmolVLM" if smolvlm else "Idefics3"
    tile = preset.processor.get("tile", TILE)
    vision = merged(
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": tile,
            "patch_size": 14,
        },
        preset.vision,
    )
    top = merged({"scale_factor": 2, "tie_word_embeddings": False}, preset.model)
    image_seq_len = (tile // vision["patch_size"]) ** 2 // top["scale_factor"] ** 2
    config = getattr(transformers, f"{prefix}Config")(
        vision_config=vision,
        text_config=merged({"model_type": "llama", **text_config(tokenizer, SPEC)}, preset.text),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        pad_token_id=tokenizer.convert_tokens_to_ids(SPEC.pad),
        **top,
    )
    image = getattr(transformers, f"{prefix}ImageProcessor")(
        size={"longest_edge": preset.processor.get("longest_edge", 2 * TILE)},
        max_image_size={"longest_edge": tile},
        do_image_splitting=True,
        image_mean=HALF,
        image_std=HALF,
    )
    parts = [image, tokenizer]
    if smolvlm:
        parts.append(transformers.SmolVLMVideoProcessor(max_image_size={"longest_edge": tile}))
    processor = getattr(transformers, f"{prefix}Processor")(
        *parts, image_seq_len=image_seq_len, chat_template=CHAT_TEMPLATE
    )
    return config, processor


SPEC = TinyFamily(
    lambda tokenizer, preset: build(tokenizer, preset, smolvlm=False),
    CHAT_TEMPLATE,
    SPECIALS,
    eos="<end_of_utterance>",
    pad="<|im_end|>",
    bos="<|im_start|>",
)
