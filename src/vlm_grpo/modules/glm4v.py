"""GLM-4.1V (``glm4v``) and GLM-4.5V (``glm4v_moe``) adapter.

The vision side works like Qwen2-VL's: patch 14, one ``<|image|>`` token per 2x2 patches, 3-D rope positions from
the model's ``get_rope_index`` (same arguments as Qwen's, so the packed pass reuses the Qwen2-VL hook). The
chat template writes ``<|begin_of_image|><|image|><|end_of_image|>`` per image. Two differences: the processor's
``smart_resize`` budgets ``t * h * w`` with ``t = 2`` (an image is two identical frames), so ``--min_pixels`` /
``--max_pixels`` count twice the area of the resized image; and the language model is GLM-4's (fused
``gate_up_proj``, extra norms, partial rotary). GLM-4.1V and GLM-4.5V write boxes as ``[x1, y1, x2, y2]`` in a
0-1000 normalised frame (inside ``<|begin_of_box|>`` ... ``<|end_of_box|>``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import rec_template
from vlm_grpo.modules.qwen2_vl import Qwen2VLModule


def resized_size(processor: Any, width: int, height: int) -> tuple[int, int]:
    """(width, height) the GLM image processor resizes a ``width x height`` image to before patching."""
    from transformers.models.glm4v.image_processing_glm4v import smart_resize

    ip = processor.image_processor
    h, w = smart_resize(
        num_frames=ip.temporal_patch_size,
        height=height,
        width=width,
        temporal_factor=ip.temporal_patch_size,
        factor=ip.patch_size * ip.merge_size,
        min_pixels=ip.size["shortest_edge"],
        max_pixels=ip.size["longest_edge"],
    )
    return w, h


class Glm4vModule(Qwen2VLModule):
    """GLM-4.1V: vision tower and merger under ``model.visual``."""

    name: ClassVar[str] = "glm4v"
    # GLM-4's MLPs fuse gate and up into one projection.
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")
    # Vision blocks (attn.qkv / attn.proj, a gated MLP) and the merger (proj, gate/up/down_proj).
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("coordinates normalised to 0-1000")}

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        w, h = resized_size(processor, width, height)
        ip = processor.image_processor
        return (w // ip.patch_size) * (h // ip.patch_size) // ip.merge_size**2 + self.image_template_overhead(processor)

    def image_grid(self, processor: Any, width: int, height: int) -> tuple[int, int, int]:
        w, h = resized_size(processor, width, height)
        patch = processor.image_processor.patch_size
        return (1, h // patch, w // patch)


class Glm4vMoeModule(Glm4vModule):
    """GLM-4.5V: GLM-4.1V's adapter, with LoRA kept off the routed experts.

    The routed experts are fused 3-D parameters (``experts.gate_up_proj`` / ``experts.down_proj``). PEFT maps the
    names ``gate_proj`` / ``up_proj`` / ``down_proj`` anywhere in a ``glm4v_moe`` model onto them (their transformers
    4 names), wrapping them as parameters (no dropout, no merge), so the default targets leave those names out:
    LoRA reaches the language model's attention and the vision blocks' attention. ``--lora_target_modules`` names
    more (PEFT's expert LoRA then needs ``--lora_dropout 0``).
    """

    name: ClassVar[str] = "glm4v_moe"
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("qkv", "proj")

    def prepare_model(self, model: torch.nn.Module) -> None:
        """GLM-4.5V names its expert count ``n_routed_experts``; TRL's router auxiliary loss (on while the text
        config's ``router_aux_loss_coef`` is non-zero, as in GLM-4.5V's config) reads ``num_experts``, so the
        model's config carries both."""
        text = model.config.get_text_config()
        if getattr(text, "n_routed_experts", None) is not None and "num_experts" not in text.to_dict():
            text.num_experts = text.n_routed_experts
