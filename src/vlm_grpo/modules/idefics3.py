"""Idefics3 and SmolVLM adapter (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``).

The image processor resizes an image so its longest edge is ``size["longest_edge"]``, then (with
``do_image_splitting``) cuts it into rows x columns of ``max_image_size`` tiles and appends the whole image resized
to one tile. Each tile becomes ``image_seq_len`` ``<image>`` tokens (the connector's pixel shuffle by
``scale_factor``): ``<fake_token_around_image><row_i_col_j>`` before a tile, a newline after each row, and
``<fake_token_around_image><global-img>`` before the global image. ``pixel_values`` hold one row per sample (its
tiles padded to the batch's largest count, with ``pixel_attention_mask``); the model drops tiles that are all
zeros as padding. Boxes are written in a 0-1000 normalised frame (these checkpoints have no grounding format of
their own).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import VLMModule, rec_template


@functools.lru_cache(maxsize=256)
def _prompt_tokens(processor: Any, rows: int, cols: int) -> int:
    """Tokens of the string the processor writes for one ``rows x cols`` image (with its global image).

    The string starts and ends with ``<fake_token_around_image>``, so it tokenizes the same in any context.
    """
    text = processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
    return len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])


class Idefics3Module(VLMModule):
    """Idefics3 / SmolVLM: SigLIP-style tower plus the pixel-shuffle connector."""

    name: ClassVar[str] = "idefics3"
    vision_prefixes: ClassVar[tuple[str, ...]] = ("model.vision_model", "model.connector")
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("out_proj", "fc1", "fc2", "proj")
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("coordinates normalised to 0-1000")}
    grouped_vision_inputs: ClassVar[frozenset[str]] = frozenset({"pixel_attention_mask"})

    def apply_image_limits(self, processor: Any) -> None:
        self.refuse_image_limits(
            "set size.longest_edge (resize) and max_image_size.longest_edge (tile) in preprocessor_config.json"
        )

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        _, rows, cols = processor.image_processor.get_number_of_image_patches(height, width, {})
        return _prompt_tokens(processor, rows, cols) + self.image_template_overhead(processor)

    def row_image_tokens(self, processor: Any, sizes: list[tuple[int, int]]) -> int:
        """The template's own tokens for images (``User:`` instead of ``User: `` when the turn opens with one)
        come once per turn, not once per image."""
        overhead = self.image_template_overhead(processor)
        return sum(self.num_image_tokens(processor, w, h) - overhead for w, h in sizes) + (overhead if sizes else 0)

    def rows_forward_kwargs(
        self, mm: dict[str, Any], start: int, end: int, tool_images: bool = False
    ) -> dict[str, Any]:
        """No pixels for rows without images: their padding tiles alone leave the vision tower an empty batch."""
        if mm.get("pixel_values") is None or not mm.get("num_images") or sum(mm["num_images"][start:end]):
            return {}
        return {"pixel_values": None, "pixel_attention_mask": None}

    def tool_pixel_fields(self, processor: Any, mm: dict[str, Any], input_ids: torch.Tensor) -> dict[str, Any]:
        """One row per sample from TRL's tool loop's layout: it runs the image processor on the flat list of the
        batch's images, which Idefics3's takes for ONE sample's (one row of every tile, in row order). Each row's
        tiles are counted from its ``<image>`` tokens (``image_seq_len`` a tile)."""
        pixels, mask = mm.get("pixel_values"), mm.get("pixel_attention_mask")
        rows = input_ids.size(0)
        if pixels is None or pixels.size(0) != 1 or rows == 1:
            return {}
        tiles = ((input_ids == processor.image_token_id).sum(-1) // processor.image_seq_len).tolist()
        if sum(tiles) != pixels.size(1) or not max(tiles):
            return {}
        most = max(tiles)

        def per_row(tensor: torch.Tensor) -> torch.Tensor:
            parts = torch.split(tensor[0], tiles)
            out = tensor.new_zeros(rows, most, *tensor.shape[2:])
            for i, part in enumerate(parts):
                out[i, : part.size(0)] = part
            return out

        fields = {"pixel_values": per_row(pixels), "num_tiles": [1] * rows}
        if mask is not None:
            fields["pixel_attention_mask"] = per_row(mask)
        return fields

    def trl_pixel_fields(self, mm: dict[str, Any]) -> dict[str, Any]:
        """``num_tiles`` of one row per sample: TRL otherwise takes these per-sample rows for one row per image
        whenever a batch holds as many images as rows (a two-image sample next to a text-only one), and hands a
        sample another's pixels when it splits, shuffles or cuts the batch."""
        pixels, num_images = mm.get("pixel_values"), mm.get("num_images")
        if pixels is None or not num_images or mm.get("num_tiles") is not None or pixels.size(0) != len(num_images):
            return {}
        return {"num_tiles": [1] * len(num_images)}

    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """One ``pixel_values`` row per sample (its tiles along the second axis), images or not."""
        num_images = mm.get("num_images")
        return [1] * len(num_images) if num_images else None

    def group_vision_inputs(self, groups: list[Any], mm: dict[str, Any]) -> dict[str, Any]:
        inputs = super().group_vision_inputs(groups, mm)
        mask = mm.get("pixel_attention_mask")
        if inputs and mask is not None:
            inputs["pixel_attention_mask"] = torch.cat(
                [mask[a:b] for a, b in (g.image_rows for g in groups if g.image_rows)]
            )
        return inputs

    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """One tile of ones (a tile of zeros is taken for padding and dropped)."""
        vision = backbone.config.vision_config
        size = vision.image_size
        return {"pixel_values": torch.ones(1, 1, vision.num_channels, size, size, device=device)}


class SmolVLMModule(Idefics3Module):
    """SmolVLM: Idefics3's layout (its processor adds video frames as images with timestamps)."""

    name: ClassVar[str] = "smolvlm"
