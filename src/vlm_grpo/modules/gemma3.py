"""Gemma 3 adapter (``Gemma3ForConditionalGeneration``: Gemma 3 4B / 12B / 27B).

The processor resizes every image to one square (896 x 896 px in the real checkpoints, SigLIP patch 14)
and the projector average-pools its patches to ``mm_tokens_per_image`` (256) ``<image_soft_token>``. The
template writes ``<start_of_image>``; the processor expands it into ``\\n\\n<start_of_image>``, the soft
tokens, ``<end_of_image>\\n\\n``. So an image costs the same tokens whatever its size, and there are no pixel
budgets to set. Pan-and-scan (extra crops of wide images) is off: ``Gemma3Processor`` passes
``do_pan_and_scan=False`` on every call, overriding the image processor's own setting.

The processor returns ``token_type_ids`` (1 on image soft tokens): Gemma 3 attends bidirectionally within
an image, and TRL's GRPO passes them to the model in generation and in the log-prob passes. The packed
log-prob pass and the shared prefill do not build them, and the language model alternates sliding-window
and global layers, so the speed path steps aside for Gemma 3 (one info line) and TRL's path runs.

Gemma 3 has no trained box format; REC prompts ask for 0-1000 normalised coordinates.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch

from vlm_grpo.modules.base import VLMModule, rec_template

# processor -> (chat template, tokens one image adds to a prompt)
_IMAGE_TOKENS: weakref.WeakKeyDictionary[Any, tuple[Any, int]] = weakref.WeakKeyDictionary()


def expanded_image_tokens(processor: Any, expansion: str) -> int:
    """Tokens one image item adds to a rendered prompt once the processor replaces its placeholder by
    ``expansion``: measured on the tokenizer (the expansion's newlines may merge with their neighbours)."""
    template = getattr(processor, "chat_template", None)
    cached = _IMAGE_TOKENS.get(processor)
    if cached is not None and cached[0] == template:
        return cached[1]
    question = {"type": "text", "text": "What is in the image?"}
    tokenizer = processor.tokenizer

    def length(content: list[dict[str, Any]], image: bool) -> int:
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        if image:
            text = text.replace(processor.image_token, expansion, 1)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    count = length([{"type": "image"}, question], True) - length([question], False)
    _IMAGE_TOKENS[processor] = (template, count)
    return count


class Gemma3Module(VLMModule):
    """Gemma 3: SigLIP tower and the pooling projector; every image is one fixed-size square."""

    name: ClassVar[str] = "gemma3"
    vision_prefixes: ClassVar[tuple[str, ...]] = ("model.vision_tower", "model.multi_modal_projector")
    # SigLIP's attention output and MLP (q/k/v_proj are among the default names); the projector has no linear layer.
    vision_lora_targets: ClassVar[tuple[str, ...]] = ("out_proj", "fc1", "fc2")
    templates: ClassVar[dict[str, str]] = {"rec": rec_template("coordinates normalised to 0-1000")}

    def apply_image_limits(self, processor: Any) -> None:
        """Gemma 3 resizes every image to one square: pixel budgets and tiling cannot be honoured."""
        given = [f"--{k}" for k, v in vars(self.limits).items() if v is not None]
        if given:
            size = processor.image_processor.size
            raise ValueError(
                f"{', '.join(given)} cannot apply to Gemma 3: its processor resizes every image to "
                f"{size['height']}x{size['width']} px ({processor.image_seq_length} image tokens). Drop the option."
            )

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        return expanded_image_tokens(processor, processor.full_image_sequence)

    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """One ``pixel_values`` row per image (pan-and-scan, which would add crops, is off)."""
        return mm.get("num_images") or None

    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """One blank image at the vision tower's input size."""
        vision = backbone.config.vision_config
        side = vision.image_size
        return {"pixel_values": torch.zeros(1, vision.num_channels, side, side, device=device)}
