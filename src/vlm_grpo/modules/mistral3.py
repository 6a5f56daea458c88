"""Mistral 3 adapter (``Mistral3ForConditionalGeneration``: Mistral-Small-3.1 / 3.2, Pixtral vision tower).

The Pixtral processor scales an image down (never up) so its longest edge fits ``size["longest_edge"]``
(1540 px in the real checkpoints), rounds each side up to ``patch_size * spatial_merge_size`` (14 x 2 = 28 px)
and replaces the template's ``[IMG]`` with one ``[IMG]`` per 28 x 28 cell, an ``[IMG_BREAK]`` after every row
and ``[IMG_END]`` in place of the last break: ``rows * (columns + 1)`` tokens. The model's patch merger folds
2 x 2 patches into one token; ``image_sizes`` (the resized height and width) travel with ``pixel_values``,
and TRL's GRPO passes them on. The image budget is that longest edge, set in the checkpoint's
``preprocessor_config.json``; the Qwen-style ``--min_pixels`` / ``--max_pixels`` and InternVL's
``--max_anyres_num`` do not apply.

The language model is Mistral's (1-D rope, global attention), so the whole speed path serves it: the packed
log-prob pass and the shared prefill slice ``image_sizes`` per group with the pixels (one ``pixel_values`` row per
image, padded to the batch's largest; the tower crops each by its size). Mistral 3 has no trained box format;
REC prompts ask for 0-1000 normalised coordinates.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import VLMModule, rec_template


class Mistral3Module(VLMModule):
    """Mistral 3: Pixtral tower plus the patch-merger projector."""

    name: ClassVar[str] = "mistral3"
    vision_prefixes: ClassVar[tuple[str, ...]] = ("model.vision_tower", "model.multi_modal_projector")
    # Pixtral's layers use the default names; the projector's MLP and the patch merger do not.
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("linear_1", "linear_2", "merging_layer")
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("coordinates normalised to 0-1000")}
    grouped_vision_inputs: ClassVar[frozenset[str]] = frozenset({"image_sizes"})

    def prepare_processor(self, processor: Any) -> Any:
        """The Pixtral processor, with its text returned as lists unless a call asks for tensors, and its image
        processor rounding to the merged patch (28 px) on its own.

        ``PixtralProcessor`` defaults ``return_tensors="pt"`` for text, so a batch of prompts of different lengths
        cannot come back unpadded, as TRL's GRPO asks for them; images keep their tensor default. It also passes
        ``patch_size * spatial_merge_size`` to its image processor on every call, while TRL's tool loop calls the
        image processor directly for tool images: with its own 14 px, their sizes would not match the tokens the
        processor writes for them. (A checkpoint saved by the trainer keeps that 28 px, which the processor
        would pass anyway.)
        """
        processor.text_kwargs = {k: v for k, v in processor.text_kwargs.items() if k != "return_tensors"}
        merged = processor.patch_size * processor.spatial_merge_size
        processor.image_processor.patch_size = {"height": merged, "width": merged}
        return super().prepare_processor(processor)

    def apply_image_limits(self, processor: Any) -> None:
        """Pixtral's budget is a longest edge, not a pixel area or a tile count: refuse what cannot apply."""
        given = [f"--{k}" for k, v in vars(self.limits).items() if v is not None]
        if given:
            edge = processor.image_processor.size["longest_edge"]
            raise ValueError(
                f"{', '.join(given)} cannot apply to Mistral 3: its processor fits each image's longest edge "
                f"into {edge} px (size.longest_edge in the checkpoint's preprocessor_config.json). Drop the option."
            )

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        expanded = processor._get_num_multimodal_tokens(image_sizes=[(height, width)]).num_image_tokens[0]
        return expanded + self.image_template_overhead(processor)

    # ----------------------------------------------------------------- group sharing (vlm_grpo.fastpath.sharing)
    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """One ``pixel_values`` row per image (padded to the batch's largest; the tower crops by ``image_sizes``)."""
        return mm.get("num_images") or None

    def group_vision_inputs(self, groups: list[Any], mm: dict[str, Any]) -> dict[str, Any]:
        inputs = super().group_vision_inputs(groups, mm)
        ranges = [g.image_range for g in groups if g.image_range is not None]
        if inputs and ranges:
            inputs["image_sizes"] = torch.cat([mm["image_sizes"][a:b] for a, b in ranges])
        return inputs

    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """One blank image of 2 x 2 merged tokens (the projector squeezes a single token's features away)."""
        side = 2 * backbone.config.vision_config.patch_size * backbone.config.spatial_merge_size
        channels = backbone.config.vision_config.num_channels
        return {
            "pixel_values": torch.zeros(1, channels, side, side, device=device),
            "image_sizes": torch.tensor([[side, side]], device=device),
        }
