"""LLaVA-OneVision adapter (``LlavaOnevisionForConditionalGeneration``, the ``llava-hf/*-ov-hf`` checkpoints).

The image processor picks the best ``image_grid_pinpoints`` resolution for an image, cuts it into tiles of the
vision tower's size and prepends the whole image resized to one tile ("anyres"); ``pixel_values`` hold one row
per image, its tiles padded to the batch's largest count. The model then unpads the tile features to the image's
aspect ratio, shrinks them when they exceed ``anyres_max_9`` and ends every feature row with ``image_newline``, so
the number of ``<image>`` tokens depends on the image size (the processor counts it the same way). A sample with
more than one image is not tiled: each image is then one tile and ``num_image_tokens + 1`` tokens, but TRL's
log-prob pass does not hand the model ``batch_num_images``, so the model tiles them anyway: rows with several
images are bad rows (``max_images_per_sample``). The LLaVA lineage writes boxes as ``[0, 1]`` fractions of the image.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import VLMModule, rec_template


class LlavaOnevisionModule(VLMModule):
    """LLaVA-OneVision: SigLIP tower, MLP projector and the ``image_newline`` row separator."""

    name: ClassVar[str] = "llava_onevision"
    vision_prefixes: ClassVar[tuple[str, ...]] = (
        "model.vision_tower",
        "model.multi_modal_projector",
        "model.image_newline",
    )
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("fractions of the image width and height (0 to 1)")}
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("out_proj", "fc1", "fc2", "linear_1", "linear_2")
    max_images_per_sample: ClassVar[int | None] = 1
    packed_mm_keys: ClassVar[frozenset[str]] = frozenset({"image_sizes", "batch_num_images"})

    def apply_image_limits(self, processor: Any) -> None:
        self.refuse_image_limits(
            "the tiles come from image_grid_pinpoints, which the model's config.json and the processor share"
        )

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        # The processor's own count for a one-image sample (anyres tiles, unpadding, newlines, the
        # anyres_max cap); the chat template adds what it writes besides <image>.
        expanded = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]
        return expanded + self.image_template_overhead(processor)

    def coord_size(self, processor: Any, width: int, height: int) -> tuple[int, int]:
        return (1, 1)

    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """One ``pixel_values`` row per image (its tiles along the second axis)."""
        return mm.get("num_images")

    def group_vision_inputs(self, groups: list[Any], mm: dict[str, Any]) -> dict[str, Any]:
        """The leaders' images and their ``image_sizes``; without ``batch_num_images`` every image is tiled, as
        a one-image sample is."""
        inputs = super().group_vision_inputs(groups, mm)
        ranges = [g.image_range for g in groups if g.image_range is not None]
        if inputs and ranges:
            inputs["image_sizes"] = torch.cat([mm["image_sizes"][a:b] for a, b in ranges])
        return inputs

    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """One blank image of one tile's size: the base image and the one tile anyres cuts it into."""
        from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

        config = backbone.config
        size, channels = config.vision_config.image_size, config.vision_config.num_channels
        tiles = image_size_to_num_patches((size, size), config.image_grid_pinpoints, size)
        return {
            "pixel_values": torch.zeros(1, tiles, channels, size, size, device=device),
            "image_sizes": torch.tensor([[size, size]], device=device),
        }
