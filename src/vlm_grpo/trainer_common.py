"""What the GRPO and SFT trainers share: the adapter options and the checkpoint-reload fix."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel

from vlm_grpo.modules import VLMModule

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")


def as_vlm_config(args: Any, config_cls: type[ConfigT], model: Any, suffix: str) -> ConfigT:
    """The trainer's config as ``config_cls`` (``VLMGRPOConfig`` / ``VLMSFTConfig``), whose fields the trainer
    reads directly: their defaults live in that class alone.

    * an instance of ``config_cls``: used as it is;
    * None: ``config_cls`` with its defaults and ``output_dir="<model name>-<suffix>"`` (what TRL does);
    * a plain TRL config (``trl.GRPOConfig`` / ``trl.SFTConfig``): kept as the user built it -- every value it
      holds, already validated -- with the fields only ``config_cls`` has set to their documented defaults;
    * anything else: TypeError.
    """
    if isinstance(args, config_cls):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        return config_cls(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-{suffix}")
    base = next(c for c in config_cls.__mro__[1:] if dataclasses.is_dataclass(c))
    if not isinstance(args, base):
        raise TypeError(f"args must be a {config_cls.__name__} (or a trl.{base.__name__}), not {type(args).__name__}")
    converted = config_cls.__new__(config_cls)
    converted.__dict__.update(vars(args))
    added = []
    for f in dataclasses.fields(config_cls):
        if f.name not in converted.__dict__:
            has_factory = f.default_factory is not dataclasses.MISSING
            setattr(converted, f.name, f.default_factory() if has_factory else f.default)
            added.append(f.name)
    logger.info("A plain %s was given: %s's defaults apply to %s", base.__name__, config_cls.__name__, ", ".join(added))
    return converted


def prepare_vlm(
    model: str | torch.nn.Module,
    args: Any,
    vlm_module: VLMModule | str | None,
    processing_class: Any,
    peft_config: Any,
    *,
    freeze_vision_modules: bool = False,
    lora_include_vision: bool = False,
) -> tuple[VLMModule, torch.nn.Module, Any]:
    """(adapter, model, processor) for a trainer: the family's module, then its model and processor
    loaded the family's way when only a path was given, then the freeze/LoRA options applied."""
    from vlm_grpo.modules import get_vlm_module

    name_or_path = model if isinstance(model, str) else getattr(model.config, "_name_or_path", None)
    if not isinstance(vlm_module, VLMModule):
        fallback = None if isinstance(model, str) else model.config.model_type
        vlm_module = get_vlm_module(name_or_path, vlm_module or fallback)
    trust_remote_code = getattr(args, "trust_remote_code", False)
    if isinstance(model, str):
        init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        init_kwargs.setdefault("trust_remote_code", trust_remote_code)
        model = vlm_module.load_model(model, **init_kwargs)
        if args is not None:
            args.model_init_kwargs = None  # consumed here; TRL would warn that they are ignored
    if processing_class is None:
        processing_class = vlm_module.load_processor(name_or_path, trust_remote_code=trust_remote_code)
    apply_adapter_options(
        vlm_module,
        model,
        peft_config,
        freeze_vision_modules=freeze_vision_modules,
        lora_include_vision=lora_include_vision,
    )
    return vlm_module, model, processing_class


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
