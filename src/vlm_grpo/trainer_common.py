"""What the GRPO and SFT trainers share: the adapter options and the checkpoint-reload fix."""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import PreTrainedModel

from vlm_grpo.modules import VLMModule

logger = logging.getLogger(__name__)


def apply_adapter_options(
    module: VLMModule,
    model: torch.nn.Module,
    peft_config: Any = None,
    *,
    freeze_vision_modules: bool = False,
    lora_include_vision: bool = False,
) -> None:
    """Freeze the vision tower on request and point LoRA at the family's language-model layers."""
    if freeze_vision_modules:
        frozen = module.freeze_vision(model)
        logger.info("Froze %d vision parameters (%s)", frozen, ", ".join(module.vision_prefixes))
    if peft_config is None:
        return
    targets = getattr(peft_config, "target_modules", None)
    if targets in (None, "all-linear"):
        peft_config.target_modules = module.lora_target_modules(include_vision=lora_include_vision)
    elif isinstance(targets, (list, set)):
        peft_config.target_modules = module.lora_target_modules(sorted(targets), include_vision=lora_include_vision)


class CheckpointReloadMixin:
    """Restore full-model weights through ``from_pretrained`` so the family's key conversion applies.

    ``save_pretrained`` writes VLM checkpoints in their original key layout (``visual.*``,
    ``model.layers.*``) while ``Trainer`` reloads them key-for-key into the renamed modules
    (``model.visual.*``, ``model.language_model.*``): every weight is silently skipped and the
    resumed run starts from the base model (transformers#43701). DeepSpeed, FSDP and PEFT
    checkpoints keep their own, already consistent, paths.
    """

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        model = self.model if model is None else model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not isinstance(model, PreTrainedModel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        reloaded = type(model).from_pretrained(resume_from_checkpoint, dtype=model.dtype)
        model.load_state_dict(reloaded.state_dict(), strict=True)
        del reloaded
        return None
