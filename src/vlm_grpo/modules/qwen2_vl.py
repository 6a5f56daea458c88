"""Qwen2-VL adapter; also the base of the Qwen2.5-VL and Qwen3-VL adapters.

Qwen image processors resize every image with ``smart_resize`` to a multiple of
``patch_size * merge_size`` whose area lies in ``[min_pixels, max_pixels]`` (stored as
``size["shortest_edge"]`` / ``size["longest_edge"]`` in transformers 5), then emit one
``<|image_pad|>`` per ``merge_size x merge_size`` patches. Every number is read from the processor,
so the same code serves patch 14 (Qwen2/2.5) and patch 16 (Qwen3). Qwen2-VL writes boxes in a
0-1000 normalised frame.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import VLMModule, rec_template


def resized_size(processor: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) the processor resizes a ``width x height`` image to before patching."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    ip = processor.image_processor
    size = ip.size
    h, w = smart_resize(
        height,
        width,
        factor=ip.patch_size * ip.merge_size,
        min_pixels=size["shortest_edge"],
        max_pixels=size["longest_edge"],
    )
    return w, h


class Qwen2VLModule(VLMModule):
    """Qwen2-VL: vision tower and merger both live under ``model.visual``."""

    name: ClassVar[str] = "qwen2_vl"
    vision_prefixes: ClassVar[tuple[str, ...]] = ("model.visual",)
    reuses_image_features: ClassVar[bool] = True
    varlen_vision: ClassVar[bool] = True  # also Qwen2.5-VL (windows) and Qwen3-VL: same attention dispatch
    # Vision blocks' attention and MLP: fc1/fc2 (Qwen2-VL), gated MLP (Qwen2.5-VL), linear_fc1/2 (Qwen3-VL).
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("qkv", "proj", "fc1", "fc2", "linear_fc1", "linear_fc2")
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("coordinates normalised to 0-1000")}

    def apply_image_limits(self, processor: Any) -> None:
        """``--min_pixels`` / ``--max_pixels`` become ``size`` shortest/longest edge (pixel areas)."""
        ip = processor.image_processor
        limits = {"shortest_edge": self.limits.min_pixels, "longest_edge": self.limits.max_pixels}
        if all(v is None for v in limits.values()):
            return
        size = copy.copy(ip.size)  # a dict or a transformers SizeDict; both take item assignment
        for key, value in limits.items():
            if value is not None:
                size[key] = value
        ip.size = size
        # Older transformers kept separate attributes too.
        for attr, value in (("min_pixels", self.limits.min_pixels), ("max_pixels", self.limits.max_pixels)):
            if value is not None and getattr(ip, attr, None) is not None:
                setattr(ip, attr, value)

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        w, h = resized_size(processor, width, height)
        ip = processor.image_processor
        pads = (w // ip.patch_size) * (h // ip.patch_size) // ip.merge_size**2
        return pads + self.image_template_overhead(processor)

    def image_grid(self, processor: Any, width: int, height: int) -> tuple[int, int, int]:
        w, h = resized_size(processor, width, height)
        patch = processor.image_processor.patch_size
        return (1, h // patch, w // patch)

    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """One ``merge x merge`` grid of blank patches (the smallest image the merger accepts)."""
        visual = backbone.visual
        embed = visual.patch_embed
        merge = visual.spatial_merge_size
        width = embed.in_channels * embed.temporal_patch_size * embed.patch_size**2
        return {
            "pixel_values": torch.zeros(merge * merge, width, device=device),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=device),
        }

    # ----------------------------------------------------------------- group sharing (vlm_grpo.fastpath.sharing)
    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        grid, num_images = mm.get("image_grid_thw"), mm.get("num_images")
        if grid is None or not num_images:
            return None
        return [int(s.sum()) for s in grid.prod(dim=-1).split(num_images)]

    def image_units(self, model: Any, placeholders: int) -> int | None:
        """Patches: each placeholder is one ``merge x merge`` group of them."""
        return placeholders * model.config.vision_config.spatial_merge_size**2

    def group_vision_inputs(self, groups: list[Any], mm: dict[str, Any]) -> dict[str, Any]:
        inputs = super().group_vision_inputs(groups, mm)
        ranges = self.vision_spans(groups, pixels=False)
        if inputs and ranges:
            inputs["image_grid_thw"] = torch.cat([mm["image_grid_thw"][a:b] for a, b in ranges])
        return inputs

    def packed_position_ids(
        self, model: Any, group: Any, mm: dict[str, Any], completions: list[torch.Tensor]
    ) -> torch.Tensor:
        """mrope positions ``(3, 1, length)``: the prompt's from ``get_rope_index``; a completion continues from the
        last prompt position + 1 as its own sequence would (``get_rope_index`` over its tokens and tool images,
        shifted: text after an image starts past the image's extent, as in the row's whole sequence)."""
        prompt = group.prompt[None]
        device = prompt.device
        if group.image_range is None:
            prompt_pos = torch.arange(prompt.size(1), device=device).expand(3, 1, -1)
        else:
            leader = group.rows[0]
            mm_types = mm["mm_token_type_ids"][leader, group.pad_offset : group.pad_offset + prompt.size(1)]
            a, b = group.image_range
            prompt_pos, _ = model.model.get_rope_index(
                prompt,
                mm_token_type_ids=mm_types[None],
                image_grid_thw=mm["image_grid_thw"][a:b],
                attention_mask=torch.ones_like(prompt),
            )
        last = prompt_pos[:, :, -1:]
        start = group.pad_offset + prompt.size(1)  # where the completions start in the batch's rows
        longest = max(ids.numel() for ids in completions)
        text = torch.arange(longest, device=device).view(1, 1, -1).expand(3, 1, -1)
        parts = [prompt_pos[:, :, :-1]]
        for row, tools, ids in zip(group.rows, group.tool_ranges, completions, strict=True):
            relative = text[:, :, : ids.numel()]
            if tools is not None:
                relative, _ = model.model.get_rope_index(
                    ids[None],
                    mm_token_type_ids=mm["mm_token_type_ids"][row, start : start + ids.numel()][None],
                    image_grid_thw=mm["image_grid_thw"][tools[0] : tools[1]],
                )
            parts += [last, last + 1 + relative]
        return torch.cat(parts, dim=-1)
