"""Qwen3-VL adapter.

Uses the Qwen2-VL image processor with patch 16 (32 px per image token); the Qwen2-VL logic reads
patch and merge sizes from the processor, so it applies unchanged. The vision tower, its merger and
the deepstack mergers all live under ``model.visual``. Qwen3-VL returns to a 0-1000 normalised box
frame (unlike Qwen2.5-VL's absolute pixels).
"""

from __future__ import annotations

from typing import ClassVar

from vlm_grpo.modules.qwen2_vl import Qwen2VLModule


class Qwen3VLModule(Qwen2VLModule):
    """Qwen3-VL: 0-1000 normalised boxes, patch 16."""

    name: ClassVar[str] = "qwen3_vl"
