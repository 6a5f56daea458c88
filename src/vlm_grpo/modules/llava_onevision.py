"""LLaVA-OneVision adapter (``LlavaOnevisionForConditionalGeneration``, the ``llava-hf/*-ov-hf`` checkpoints).

The image processor picks the best ``image_grid_pinpoints`` resolution for an image, cuts it into tiles of the
vision tower's size and prepends the whole image resized to one tile ("anyres"); ``pixel_values`` hold one row
per image, its tiles padded to the batch's largest count. The model then unpads the tile features to the image's
aspect ratio, shrinks them when they exceed ``anyres_max_9`` and ends every feature row with ``image_newline``, so
the number of ``<image>`` tokens depends on the image size (the processor counts it the same way). Images that
share a sample are not tiled: each is one tile and ``num_image_tokens + 1`` tokens. The model tells the two cases
apart by ``batch_num_images``, which TRL's log-prob pass does not hand it: the trainer adds it
(``rows_forward_kwargs``). The LLaVA lineage writes boxes as ``[0, 1]`` fractions of the image.
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
    grouped_vision_inputs: ClassVar[frozenset[str]] = frozenset({"image_sizes", "batch_num_images"})

    def apply_image_limits(self, processor: Any) -> None:
        self.refuse_image_limits(
            "the tiles come from image_grid_pinpoints, which the model's config.json and the processor share"
        )

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        # The processor's own count for a one-image sample (anyres tiles, unpadding, newlines, the
        # anyres_max cap); the chat template adds what it writes besides <image>.
        expanded = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]
        return expanded + self.image_template_overhead(processor)

    def row_image_tokens(self, processor: Any, sizes: list[tuple[int, int]]) -> int:
        """Several images in one sample are not tiled: ``num_image_tokens`` (one tile) plus a newline each."""
        if len(sizes) <= 1:
            return super().row_image_tokens(processor, sizes)
        per_image = processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")
        return len(sizes) * (per_image + self.image_template_overhead(processor))

    def rows_forward_kwargs(
        self, mm: dict[str, Any], start: int, end: int, tool_images: bool = False
    ) -> dict[str, Any]:
        """``batch_num_images``, which the model needs to leave several images in a sample untiled (not for tool
        runs' images, each expanded on its own, tiled); no pixels at all for rows without images (TRL hands them an
        empty tensor, which the vision tower cannot take)."""
        if mm.get("image_sizes") is None or not mm.get("num_images"):
            return {}
        counts = mm["num_images"][start:end]
        if not sum(counts):
            return {"pixel_values": None, "image_sizes": None}
        if tool_images:
            return {}
        return {"batch_num_images": torch.tensor(counts, device=mm["image_sizes"].device)}

    def coord_size(self, processor: Any, width: int, height: int) -> tuple[int, int]:
        return (1, 1)

    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """One ``pixel_values`` row per image (its tiles along the second axis)."""
        return mm.get("num_images")

    def group_vision_inputs(self, groups: list[Any], mm: dict[str, Any]) -> dict[str, Any]:
        """The leaders' images, their ``image_sizes`` and ``batch_num_images`` (one tile each when several).

        Where the fields say every image stands alone (``batch_num_images`` all ones: also what the image
        processor returns for the images of tool replies, each expanded on its own), every image is tiled."""
        inputs = super().group_vision_inputs(groups, mm)
        ranges = [g.image_range for g in groups if g.image_range is not None]
        if inputs and ranges:
            inputs["image_sizes"] = torch.cat([mm["image_sizes"][a:b] for a, b in ranges])
            given = mm.get("batch_num_images")
            if given is None or any(int(n) != 1 for n in given):
                counts = [b - a for a, b in ranges]
                inputs["batch_num_images"] = torch.tensor(counts, device=inputs["image_sizes"].device)
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
