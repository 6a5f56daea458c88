"""InternVL adapter for native transformers checkpoints (``*-hf``, ``InternVLForConditionalGeneration``).

The processor cuts an image into up to ``max_patches`` square tiles (plus a thumbnail when there is
more than one) and expands each ``<IMG_CONTEXT>`` into ``<img>`` + ``image_seq_length`` context
tokens per tile + ``</img>``. Beware: ``InternVLProcessor`` passes ``crop_to_patches=True`` on every
call (a processor-level default), so the image processor's own ``crop_to_patches`` is ignored and
``max_patches`` is the knob that matters. Boxes are written in a 0-1000 normalised frame.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import VLMModule, rec_template


class InternVLModule(VLMModule):
    """InternVL (-hf): vision tower plus the pixel-shuffle MLP projector."""

    name: ClassVar[str] = "internvl"
    vision_prefixes: ClassVar[tuple[str, ...]] = ("model.vision_tower", "model.multi_modal_projector")
    reuses_image_features: ClassVar[bool] = True
    # The InternViT blocks (q/k/v_proj are among the default names) and the projector's MLP.
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("projection_layer", "fc1", "fc2", "linear_1", "linear_2")
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("coordinates normalised to 0-1000")}

    def apply_image_limits(self, processor: Any) -> None:
        """``--max_anyres_num N``: dynamic tiling with at most N tiles per image."""
        if self.limits.max_anyres_num is not None:
            ip = processor.image_processor
            ip.crop_to_patches = True
            ip.max_patches = self.limits.max_anyres_num

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        # The processor's own count (the one vLLM uses) merges its call-time defaults, crop_to_patches
        # included, and counts <img>/</img>; the template adds what it writes besides <IMG_CONTEXT>.
        expanded = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]
        return expanded + self.image_template_overhead(processor)

    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """InternVL pixel values are tiles, a variable count per image: TRL counts them per sample
        (``num_tiles``), and leaves them out when every image is one tile."""
        return mm.get("num_tiles") or mm.get("num_images")

    def image_units(self, model: Any, placeholders: int) -> int | None:
        """Tiles: each fills ``image_seq_length`` placeholders."""
        tiles, rest = divmod(placeholders, model.config.image_seq_length)
        return None if rest else tiles

    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """One blank tile at the vision tower's input size."""
        vision = backbone.config.vision_config
        height, width = vision.image_size
        return {"pixel_values": torch.zeros(1, vision.num_channels, height, width, device=device)}
