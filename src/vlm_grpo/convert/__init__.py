"""Checkpoint conversions between other layouts and the ones the VLM modules train."""

from vlm_grpo.convert.internvl_chat import ConversionError, convert_internvl_chat, export_internvl_chat

__all__ = ["ConversionError", "convert_internvl_chat", "export_internvl_chat"]
