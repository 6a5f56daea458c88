"""Tiny offline builds of GLM-4.1V (``glm4v``) and GLM-4.5V (``glm4v_moe``), and their real shapes.

GLM-4.1V pairs a Qwen2-VL-like vision tower (patch 14, 2x2 merge, 3-D rope positions from ``get_rope_index``)
with the GLM-4 language model: fused ``gate_up_proj`` MLP, extra norms after attention and MLP, and rotary
embeddings on half of each head (``partial_rotary_factor`` 0.5). GLM-4.5V swaps the MLPs (after the first layer)
for sigmoid-routed experts with a shared expert. Images are written
``<|begin_of_image|><|image|><|end_of_image|>`` and the processor expands ``<|image|>`` into one token per 2x2
patches; its pixel budget counts the two temporal frames an image is repeated into (``t * h * w``).
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.testing.presets import Preset
from vlm_grpo.testing.tiny_parts import MROPE_SECTION, TEXT_DIMS, TinyFamily, merged, text_config
from vlm_grpo.tools.templates import glm_tool_template

GLM_SPECIALS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
    "<|begin_of_box|>",
    "<|end_of_box|>",
)

GLM_CHAT_TEMPLATE = glm_tool_template()

# GLM's processors budget t * h * w with t = 2 (an image is two identical frames): 56x56 .. 112x112 px here,
# i.e. 4 .. 16 image tokens (patch 14, 2x2 merge).
TINY_PIXELS = {"min_pixels": 2 * 56 * 56, "max_pixels": 2 * 112 * 112}
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def _token_ids(tokenizer: Any) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image|>"),
        "video_token_id": ids("<|video|>"),
        "image_start_token_id": ids("<|begin_of_image|>"),
        "image_end_token_id": ids("<|end_of_image|>"),
        "video_start_token_id": ids("<|begin_of_video|>"),
        "video_end_token_id": ids("<|end_of_video|>"),
    }


def _vision(preset: Preset) -> dict[str, Any]:
    return merged(
        {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,  # the merger's MLP width
            "num_heads": 2,
            "out_hidden_size": TEXT_DIMS["hidden_size"],
            "patch_size": 14,
            "image_size": 56,  # a 4x4 grid of position embeddings, interpolated to each image's grid
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        preset.vision,
    )


def _text(tokenizer: Any, preset: Preset, **extra: Any) -> dict[str, Any]:
    # Rotary on half of a 32-wide head: 16 dims, 8 frequencies split 2/3/3 over (t, h, w).
    rope = {"rope_type": "default", "mrope_section": MROPE_SECTION, "partial_rotary_factor": 0.5}
    base = text_config(tokenizer, SPEC, head_dim=32, rope_parameters=rope, attention_bias=True, **extra)
    return merged(base, preset.text)


def _processor(tokenizer: Any, preset: Preset) -> Any:
    from transformers import Glm4vImageProcessor, Glm4vProcessor, Glm4vVideoProcessor

    knobs = {**TINY_PIXELS, **preset.processor}
    common = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
    norm = {"image_mean": list(knobs.get("image_mean", CLIP_MEAN)), "image_std": list(knobs.get("image_std", CLIP_STD))}
    image = Glm4vImageProcessor(
        **common, **norm, size={"shortest_edge": knobs["min_pixels"], "longest_edge": knobs["max_pixels"]}
    )
    video_size = {
        "shortest_edge": knobs.get("video_min_pixels", knobs["min_pixels"]),
        "longest_edge": knobs.get("video_max_pixels", knobs["max_pixels"]),
    }
    video = Glm4vVideoProcessor(**common, **norm, size=video_size)
    return Glm4vProcessor(image, tokenizer, video, chat_template=GLM_CHAT_TEMPLATE)


def build_glm4v(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Glm4vConfig

    top = merged({"tie_word_embeddings": False, **_token_ids(tokenizer)}, preset.model)
    config = Glm4vConfig(text_config=_text(tokenizer, preset), vision_config=_vision(preset), **top)
    return config, _processor(tokenizer, preset)


def build_glm4v_moe(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Glm4vMoeConfig

    # Four routed experts (two per token) and one shared; the first layer stays dense, as in GLM-4.5V.
    moe = {
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
    }
    top = merged({"tie_word_embeddings": False, **_token_ids(tokenizer)}, preset.model)
    config = Glm4vMoeConfig(text_config=_text(tokenizer, preset, **moe), vision_config=_vision(preset), **top)
    return config, _processor(tokenizer, preset)


SPEC = TinyFamily(build_glm4v, GLM_CHAT_TEMPLATE, GLM_SPECIALS, eos="<|endoftext|>", pad="<|endoftext|>", bos="<sop>")
MOE_SPEC = TinyFamily(
    build_glm4v_moe, GLM_CHAT_TEMPLATE, GLM_SPECIALS, eos="<|endoftext|>", pad="<|endoftext|>", bos="<sop>"
)
