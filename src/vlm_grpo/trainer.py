"""``VLMGRPOTrainer``: TRL's GRPOTrainer plus the model-family adapter layer.

TRL already trains VLMs; what it lacks is knowing *which* family it trains. The adapter loads
model and processor with the family's image limits, keeps LoRA off the vision tower, freezes
the tower on request, and lets rewards be given by registered name. Everything else (losses,
generation, logging, DeepSpeed, resume) is TRL's, unmodified.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel
from trl import GRPOTrainer

from vlm_grpo.modules import VLMModule, get_vlm_module
from vlm_grpo.rewards import build_reward_funcs
from vlm_grpo.sharing import packed_logps

logger = logging.getLogger(__name__)


class VLMGRPOTrainer(GRPOTrainer):
    """GRPO for vision-language models.

    Args beyond ``trl.GRPOTrainer``:
        vlm_module: adapter instance or registered name; default: from the checkpoint's ``model_type``.
        freeze_vision_modules: freeze the vision tower and its projector before training.
        lora_include_vision: put LoRA on vision layers too (default: language model only).
        rewards_from_vlm_module: the adapter's own reward variants replace registered ones of the same name.
        reward_funcs: callables as in TRL, or registered reward names / ``file.py:fn`` plugins.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: str | Callable | Sequence[str | Callable],
        args: Any = None,
        *,
        vlm_module: VLMModule | str | None = None,
        freeze_vision_modules: bool = False,
        lora_include_vision: bool = False,
        rewards_from_vlm_module: bool = False,
        processing_class: Any = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        name_or_path = model if isinstance(model, str) else getattr(model.config, "_name_or_path", None)
        if not isinstance(vlm_module, VLMModule):
            if isinstance(model, str) or vlm_module is not None:
                vlm_module = get_vlm_module(name_or_path, vlm_module)
            else:
                vlm_module = get_vlm_module(name_or_path, model.config.model_type)
        self.vlm_module = vlm_module

        if isinstance(model, str):
            init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
            init_kwargs.setdefault("trust_remote_code", getattr(args, "trust_remote_code", False))
            model = vlm_module.load_model(model, **init_kwargs)
            if args is not None:
                args.model_init_kwargs = None  # consumed here; TRL would warn that they are ignored
        if processing_class is None:
            processing_class = vlm_module.load_processor(
                name_or_path, trust_remote_code=getattr(args, "trust_remote_code", False)
            )

        if freeze_vision_modules:
            frozen = vlm_module.freeze_vision(model)
            logger.info("Froze %d vision parameters (%s)", frozen, ", ".join(vlm_module.vision_prefixes))
        if peft_config is not None and getattr(peft_config, "target_modules", None) in (None, "all-linear"):
            peft_config.target_modules = vlm_module.lora_target_modules(include_vision=lora_include_vision)
        elif peft_config is not None and isinstance(peft_config.target_modules, (list, set)):
            peft_config.target_modules = vlm_module.lora_target_modules(
                sorted(peft_config.target_modules), include_vision=lora_include_vision
            )

        if isinstance(reward_funcs, (str, Callable)):
            reward_funcs = [reward_funcs]
        overrides = vlm_module.reward_overrides if rewards_from_vlm_module else None
        reward_funcs = [build_reward_funcs([f], overrides)[0] if isinstance(f, str) else f for f in reward_funcs]

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            processing_class=processing_class,
            peft_config=peft_config,
            **kwargs,
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        """Restore full-model weights through ``from_pretrained`` so the family's key conversion applies.

        ``save_pretrained`` writes VLM checkpoints in their original key layout (``visual.*``,
        ``model.layers.*``) while ``Trainer`` reloads them key-for-key into the renamed modules
        (``model.visual.*``, ``model.language_model.*``): every weight is silently skipped and the
        resumed run starts from the base model (transformers#43701). DeepSpeed, FSDP and PEFT
        checkpoints keep their own, already consistent, paths.
        """
        model = self.model if model is None else model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not isinstance(model, PreTrainedModel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        reloaded = type(model).from_pretrained(resume_from_checkpoint, dtype=model.dtype)
        model.load_state_dict(reloaded.state_dict(), strict=True)
        del reloaded
        return None

    # Multimodal kwargs the packed path understands; anything else goes to TRL's per-row pass.
    _SHARED_MM_KEYS = frozenset({"pixel_values", "image_grid_thw", "num_images", "num_tiles", "mm_token_type_ids"})

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **mm: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows that share a prompt share one forward (``share_prompt``); see :mod:`vlm_grpo.sharing`."""
        extra = {k for k, v in mm.items() if v is not None} - self._SHARED_MM_KEYS
        if getattr(self.args, "share_prompt", False) and not compute_aux_loss and not extra:
            result = packed_logps(
                self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, mm, batch_size
            )
            if result is not None:
                return (*result, None)
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **mm
        )

    def _tokenize_prompts(self, prompts: list) -> tuple:
        """Text-only prompts get ``[]`` rather than ``None`` images, so mixed batches reach the processor whole.

        TRL marks a text-only prompt's images as ``None``; when the same batch also holds image prompts,
        the processor receives ``[[img], None]`` and fails. An empty list is what processors expect.
        """
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        if images is not None:
            images = [image_list or [] for image_list in images]
        return prompt_ids, images, multimodal_fields
