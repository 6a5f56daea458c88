"""Tiny offline SmolVLM (``smolvlm``) build: Idefics3's (:mod:`vlm_grpo.testing.tiny_idefics3`) with SmolVLM's
classes (its processor also carries a video processor)."""

from __future__ import annotations

import dataclasses

from vlm_grpo.testing import tiny_idefics3

SPEC = dataclasses.replace(
    tiny_idefics3.SPEC, build=lambda tokenizer, preset: tiny_idefics3.build(tokenizer, preset, smolvlm=True)
)
