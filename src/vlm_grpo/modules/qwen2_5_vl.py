"""Qwen2.5-VL adapter.

Same processor and layout as Qwen2-VL, but the model was trained to write boxes in absolute pixel
coordinates of the image it was actually fed, i.e. after ``smart_resize``. Rewards must therefore
map boxes from the resized frame back to the original image.
"""

from __future__ import annotations

from typing import Any, ClassVar

from vlm_grpo.modules.base import rec_template
from vlm_grpo.modules.qwen2_vl import Qwen2VLModule, resized_size


class Qwen25VLModule(Qwen2VLModule):
    """Qwen2.5-VL: absolute-pixel boxes in the resized frame."""

    name: ClassVar[str] = "qwen2_5_vl"
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("absolute pixel coordinates of the image")}

    def coord_size(self, processor: Any, width: int, height: int) -> tuple[int, int]:
        """The resized (width, height): factor and pixel limits come from the processor."""
        return resized_size(processor, width, height)
