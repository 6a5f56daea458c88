"""Tiny offline build of GLM-4.5V (``glm4v_moe``): see ``tiny_glm4v.py``."""

from vlm_grpo.testing.tiny_glm4v import MOE_SPEC as SPEC

__all__ = ["SPEC"]
