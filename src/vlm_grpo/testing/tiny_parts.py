"""Pieces every tiny family builder shares: the family spec, the tiny text dimensions, config merging.

A family's tiny build lives in ``tiny.py`` (the Qwen-VL and InternVL families) or in its own
``tiny_<family>.py`` that exposes a :class:`TinyFamily` named ``SPEC``; ``tiny.py`` loads those lazily
by name (``TINY_FAMILY_FILES``), so a family file never imports ``tiny.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vlm_grpo.testing.presets import Preset

TEXT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
MROPE_SECTION = [2, 3, 3]  # sums to head_dim / 2 = 64 / 4 / 2
COMMON_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen3-VL's (and Qwen3-VL-MoE's) tiny vision tower.
QWEN3_TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": TEXT_DIMS["hidden_size"],
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,  # an 8x8 grid, interpolated to the image's grid
    "deepstack_visual_indexes": [0],
}


@dataclass(frozen=True)
class TinyFamily:
    """What the offline builder needs to know about one family.

    ``build(tokenizer, preset) -> (config, processor)`` makes the model config and the processor around the
    tokenizer that :func:`vlm_grpo.testing.tiny.build_tokenizer` made from ``specials`` (added as special tokens
    after the shared BPE), ``extra_tokens`` (the tokenizer's ``extra_special_tokens``) and ``chat_template``.
    ``eos`` / ``pad`` / ``bos`` are token strings (each must be in ``specials``). ``init_weights(model)``, where
    given, sets what the model's own random init leaves at zero but a checkpoint has trained (run under the
    builder's seed).
    """

    build: Callable[[Any, Preset], tuple[Any, Any]]
    chat_template: str
    specials: tuple[str, ...] = COMMON_SPECIAL_TOKENS
    extra_tokens: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    bos: str = "<|endoftext|>"
    init_weights: Callable[[Any], None] | None = None
    saved: Callable[[Any], None] | None = None  # saved(out_dir): rewrite the saved weights as the hub stores them


def text_config(tokenizer: Any, spec: TinyFamily | None = None, **extra: Any) -> dict[str, Any]:
    """The tiny language model's config fields, with the family's special-token ids."""
    ids = tokenizer.convert_tokens_to_ids
    eos, pad, bos = (spec.eos, spec.pad, spec.bos) if spec else ("<|im_end|>", "<|endoftext|>", "<|endoftext|>")
    return {
        **TEXT_DIMS,
        "vocab_size": len(tokenizer),
        "bos_token_id": ids(bos),
        "eos_token_id": ids(eos),
        "pad_token_id": ids(pad),
        **extra,
    }


def qwen3_rope() -> dict[str, Any]:
    """Qwen3-VL's interleaved mrope at the tiny head size (a fresh dict: configs keep what they are given)."""
    return {"rope_type": "default", "mrope_section": list(MROPE_SECTION), "mrope_interleaved": True, "rope_theta": 5e6}


def merged(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with (a deep copy of) a preset's overrides."""
    return {**base, **copy.deepcopy(dict(overrides))}


# ----------------------------------------------------------------------------- Qwen-VL parts
def qwen_token_ids(tokenizer: Any) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def qwen_processors(
    patch_size: int, min_pixels: int, max_pixels: int, video_cls: Any, overrides: Mapping[str, Any]
) -> tuple[Any, Any]:
    """Image and video processors; ``overrides`` (a preset's ``processor``) replace the tiny limits."""
    from transformers import Qwen2VLImageProcessor

    min_pixels = overrides.get("min_pixels", min_pixels)
    max_pixels = overrides.get("max_pixels", max_pixels)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    video_size = {
        "shortest_edge": overrides.get("video_min_pixels", min_pixels),
        "longest_edge": overrides.get("video_max_pixels", max_pixels),
    }
    common = {"patch_size": patch_size, "temporal_patch_size": 2, "merge_size": 2}
    common.update({k: list(overrides[k]) for k in ("image_mean", "image_std") if k in overrides})
    return Qwen2VLImageProcessor(**common, size=size), video_cls(**common, size=video_size)
