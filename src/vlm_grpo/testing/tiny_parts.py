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


@dataclass(frozen=True)
class TinyFamily:
    """What the offline builder needs to know about one family.

    ``build(tokenizer, preset) -> (config, processor)`` makes the model config and the processor around the
    tokenizer that :func:`vlm_grpo.testing.tiny.build_tokenizer` made from ``specials`` (added as special tokens
    after the shared BPE), ``extra_tokens`` (the tokenizer's ``extra_special_tokens``) and ``chat_template``.
    ``eos`` / ``pad`` / ``bos`` are token strings (each must be in ``specials``).
    """

    build: Callable[[Any, Preset], tuple[Any, Any]]
    chat_template: str
    specials: tuple[str, ...] = COMMON_SPECIAL_TOKENS
    extra_tokens: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    bos: str = "<|endoftext|>"


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


def merged(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with (a deep copy of) a preset's overrides."""
    return {**base, **copy.deepcopy(dict(overrides))}
