"""Helpers for tests and smoke runs that must work offline (tiny random checkpoints).

Names are resolved lazily so ``python -m vlm_grpo.testing.tiny`` does not import the module twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlm_grpo.testing.tiny import FAMILIES, build_tiny_model

__all__ = ["FAMILIES", "build_tiny_model"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vlm_grpo.testing import tiny

        return getattr(tiny, name)
    raise AttributeError(f"module 'vlm_grpo.testing' has no attribute '{name}'")
