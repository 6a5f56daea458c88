"""VLM-module registry: one adapter per model family, picked from ``config.json``'s ``model_type``.

Entries are named after the ``model_type`` they serve, so lookup never guesses from a path.
Register a new family with ``@register_vlm_module("my_model_type")`` on a :class:`VLMModule`
subclass, or from another package through the ``vlm_grpo.modules`` entry-point group.
"""

from __future__ import annotations

from pathlib import Path

from vlm_grpo.modules.base import ImageLimits, VLMModule
from vlm_grpo.registry import Registry, UnknownEntryError

VLM_MODULES: Registry[type[VLMModule]] = Registry("VLM module", entry_point_group="vlm_grpo.modules")


def register_vlm_module(name: str):
    return VLM_MODULES.register(name)


VLM_MODULES.register("qwen2_vl", "vlm_grpo.modules.qwen2_vl:Qwen2VLModule")
VLM_MODULES.register("qwen2_5_vl", "vlm_grpo.modules.qwen2_5_vl:Qwen25VLModule")
VLM_MODULES.register("qwen3_vl", "vlm_grpo.modules.qwen3_vl:Qwen3VLModule")
VLM_MODULES.register("internvl", "vlm_grpo.modules.internvl:InternVLModule")
VLM_MODULES.register("glm4v", "vlm_grpo.modules.glm4v:Glm4vModule")
VLM_MODULES.register("glm4v_moe", "vlm_grpo.modules.glm4v:Glm4vMoeModule")
VLM_MODULES.register("qwen3_vl_moe", "vlm_grpo.modules.qwen3_vl_moe:Qwen3VLMoeModule")
VLM_MODULES.register("gemma3", "vlm_grpo.modules.gemma3:Gemma3Module")
VLM_MODULES.register("mistral3", "vlm_grpo.modules.mistral3:Mistral3Module")
VLM_MODULES.register("llava_onevision", "vlm_grpo.modules.llava_onevision:LlavaOnevisionModule")
VLM_MODULES.register("idefics3", "vlm_grpo.modules.idefics3:Idefics3Module")
VLM_MODULES.register("smolvlm", "vlm_grpo.modules.idefics3:SmolVLMModule")


def read_model_type(model_name_or_path: str, revision: str | None = None) -> str:
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(model_name_or_path, revision=revision)
    model_type = config.get("model_type")
    if not model_type:
        raise ValueError(f"{model_name_or_path}/config.json has no 'model_type'; pass --vlm_module NAME")
    return model_type


def internvl_chat_hint(model_name_or_path: str) -> str:
    """The one command that makes an original InternVL / Vintern checkpoint trainable here."""
    src = model_name_or_path.rstrip("/")
    fetch = ""
    if not Path(src).is_dir():  # a hub id: the converter reads a local folder
        fetch, src = f"hf download {src} --local-dir {src.split('/')[-1]} && ", src.split("/")[-1]
    return (
        f"'{model_name_or_path}' is an original InternVL checkpoint (model_type 'internvl_chat', remote code); "
        f"convert it once with: {fetch}vlm-grpo-convert internvl-chat {src} {src}-hf  "
        f"then pass --model_name_or_path {src}-hf"
    )


def get_vlm_module(
    model_name_or_path: str,
    vlm_module: str | None = None,
    limits: ImageLimits | None = None,
    revision: str | None = None,
) -> VLMModule:
    """The adapter for this checkpoint: ``vlm_module`` if given, else by ``config.json``'s ``model_type``."""
    if vlm_module:
        cls = VLM_MODULES.get(vlm_module)
    else:
        model_type = read_model_type(model_name_or_path, revision)
        try:
            cls = VLM_MODULES.get(model_type)
        except UnknownEntryError:
            if model_type == "internvl_chat":  # original InternVL / Vintern remote-code layout
                raise UnknownEntryError(internvl_chat_hint(model_name_or_path)) from None
            raise UnknownEntryError(
                f"Unknown model_type '{model_type}' in the config.json of '{model_name_or_path}': no VLM module is "
                f"registered for it. Available: {', '.join(VLM_MODULES.names())}. Pass --vlm_module NAME to use one "
                "of them, or register an adapter for this family."
            ) from None
    return cls(limits)


__all__ = ["VLM_MODULES", "ImageLimits", "VLMModule", "get_vlm_module", "read_model_type", "register_vlm_module"]
