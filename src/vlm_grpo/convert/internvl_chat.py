"""Original InternVL / Vintern checkpoints (``model_type: internvl_chat``) to the transformers ``internvl`` layout.

``OpenGVLab/InternVL3-1B``, ``5CD-AI/Vintern-*`` and their fine-tunes ship as remote code: one
``InternVLChatModel`` made of ``vision_model`` (InternViT) + ``mlp1`` (the pixel-shuffle projector) +
``language_model`` (a Qwen2 / Qwen3 / Llama causal LM), with ``llm_config`` / ``vision_config`` in
``config.json`` and a tokenizer that has ``<IMG_CONTEXT>``. :class:`InternVLForConditionalGeneration` is the
same network under other names (fused ``qkv`` split into ``q/k/v_proj``; ``ls1`` -> ``lambda_1``; ...), so the
conversion is a rename: weights are copied bit for bit and greedy outputs do not change.

The key map follows transformers' ``models/internvl/convert_internvl_weights_to_hf.py``, which the transformers
wheel does not ship (so it cannot be imported). InternLM2-based checkpoints (``InternLM2ForCausalLM``, e.g.
InternVL2.5-2B/8B) are refused: their tokenizer needs remote code and their fused ``wqkv`` needs that script.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

# Original name -> transformers name, applied in order (vision keys, after the fused qkv is split).
VISION_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"^vision_model\.", "model.vision_tower."),
    (r"\.encoder\.layers\.", ".encoder.layer."),
    (r"\.embeddings\.class_embedding$", ".embeddings.cls_token"),
    (r"\.embeddings\.patch_embedding\.", ".embeddings.patch_embeddings.projection."),
    (r"\.embeddings\.position_embedding$", ".embeddings.position_embeddings"),
    (r"\.ls(\d)$", r".lambda_\1"),
    (r"\.attn\.proj\.", ".attention.projection_layer."),
    (r"\.attn\.", ".attention."),
    (r"\.norm1\.", ".layernorm_before."),
    (r"\.norm2\.", ".layernorm_after."),
)
# The transformers side of VISION_KEY_MAP, for the way back.
VISION_KEY_MAP_BACK: tuple[tuple[str, str], ...] = (
    (r"^model\.vision_tower\.", "vision_model."),
    (r"\.encoder\.layer\.", ".encoder.layers."),
    (r"\.embeddings\.cls_token$", ".embeddings.class_embedding"),
    (r"\.embeddings\.patch_embeddings\.projection\.", ".embeddings.patch_embedding."),
    (r"\.embeddings\.position_embeddings$", ".embeddings.position_embedding"),
    (r"\.lambda_(\d)$", r".ls\1"),
    (r"\.attention\.projection_layer\.", ".attn.proj."),
    (r"\.attention\.", ".attn."),
    (r"\.layernorm_before\.", ".norm1."),
    (r"\.layernorm_after\.", ".norm2."),
)
# Projector and language model: prefix renames, the same both ways.
PREFIX_MAP: tuple[tuple[str, str], ...] = (
    ("mlp1.0.", "model.multi_modal_projector.layer_norm."),
    ("mlp1.1.", "model.multi_modal_projector.linear_1."),
    ("mlp1.3.", "model.multi_modal_projector.linear_2."),
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
)
SUPPORTED_LLMS = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama"}
# Remote-code bookkeeping that transformers' configs do not know (or must not inherit, like flash attention).
DROPPED_CONFIG_KEYS = {
    "_name_or_path", "_attn_implementation_autoset", "_attn_implementation", "attn_implementation", "auto_map",
    "use_bfloat16", "use_flash_attn", "torch_dtype", "dtype", "drop_path_rate", "transformers_version",
}  # fmt: skip
IMAGE_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
# ChatML as the official -hf conversions write it (no default system prompt), with {% generation %} markers
# so SFT can ask for the assistant-token mask.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item['type'] == 'image' -%}{{- '<IMG_CONTEXT>\\n' -}}"
    "{%- elif item['type'] == 'video' -%}{{- '<video>\\n' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- render(message['content']) + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


class ConversionError(ValueError):
    """A checkpoint this converter cannot read; the message says what and how to fix it."""


def _rename(key: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, replacement in rules:
        key = re.sub(pattern, replacement, key)
    return key


def _swap_prefix(key: str, pairs: tuple[tuple[str, str], ...]) -> str | None:
    for old, new in pairs:
        if key.startswith(old):
            return new + key[len(old) :]
    return None


def convert_state_dict(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original ``InternVLChatModel`` weights -> ``InternVLForConditionalGeneration`` weights (same tensors)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in original.items():
        if key.startswith("vision_model."):
            if ".attn.qkv." in key:
                for name, part in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0), strict=True):
                    out[_rename(key.replace(".attn.qkv.", f".attn.{name}."), VISION_KEY_MAP)] = part.contiguous()
            else:
                out[_rename(key, VISION_KEY_MAP)] = tensor
        else:
            new = _swap_prefix(key, PREFIX_MAP)
            if new is None:
                raise ConversionError(f"unexpected weight '{key}': not a vision_model / mlp1 / language_model weight")
            out[new] = tensor
    return out


def to_internvl_chat_state_dict(converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`convert_state_dict` (``q/k/v_proj`` fused back into ``qkv``)."""
    vision = "model.vision_tower."
    back = {(_rename(k, VISION_KEY_MAP_BACK) if k.startswith(vision) else k): v for k, v in converted.items()}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in back.items():
        if key.startswith("vision_model."):
            if ".attn.q_proj." in key:
                parts = [back[key.replace(".q_proj.", f".{n}.")] for n in ("q_proj", "k_proj", "v_proj")]
                out[key.replace(".q_proj.", ".qkv.")] = torch.cat(parts, dim=0)
            elif ".attn.k_proj." not in key and ".attn.v_proj." not in key:
                out[key] = tensor
            continue
        original = _swap_prefix(key, tuple((new, old) for old, new in PREFIX_MAP))
        if original is None:
            raise ConversionError(f"unexpected weight '{key}' in an InternVLForConditionalGeneration state dict")
        out[original] = tensor
    return out


def _read_weights(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if files:
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            weights.update(load_file(str(file)))
        return weights
    bins = sorted(src.glob("pytorch_model*.bin"))
    if bins:
        weights = {}
        for file in bins:
            weights.update(torch.load(file, map_location="cpu", weights_only=True))
        return weights
    raise ConversionError(f"{src} holds no *.safetensors or pytorch_model*.bin weights")


def internvl_config(original: dict[str, Any], image_token_id: int) -> Any:
    """An ``InternVLConfig`` from an ``internvl_chat`` ``config.json`` (read as JSON: no remote code runs)."""
    from transformers import InternVLConfig

    llm = {k: v for k, v in original["llm_config"].items() if k not in DROPPED_CONFIG_KEYS}
    arch = (llm.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_LLMS:
        raise ConversionError(
            f"language model '{arch}' is not supported (supported: {', '.join(SUPPORTED_LLMS)}); InternLM2-based "
            "checkpoints need transformers' models/internvl/convert_internvl_weights_to_hf.py from its source tree"
        )
    llm["model_type"] = SUPPORTED_LLMS[arch]
    vision = {k: v for k, v in original["vision_config"].items() if k not in DROPPED_CONFIG_KEYS}
    renamed = {"qkv_bias": "attention_bias", "qk_normalization": "use_qk_norm"}
    vision = {renamed.get(k, k): v for k, v in vision.items() if k not in ("architectures", "model_type")}
    vision["use_absolute_position_embeddings"] = True
    if original.get("ps_version", "v2") != "v2":
        raise ConversionError("ps_version 'v1' (the old pixel shuffle) has no transformers equivalent; need 'v2'")
    if original.get("select_layer", -1) != -1:
        raise ConversionError(f"select_layer {original['select_layer']} is not supported (transformers: -1)")
    image_size = original.get("force_image_size") or vision["image_size"]
    patch = vision["patch_size"]
    ratio = original.get("downsample_ratio", 0.5)
    return InternVLConfig(
        vision_config=vision,
        text_config=llm,
        image_token_id=image_token_id,
        image_seq_length=int((image_size // patch) ** 2 * ratio**2),
        downsample_ratio=ratio,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=bool(llm.get("tie_word_embeddings", False)),
    )


def _tokenizer(src: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src), extra_special_tokens=IMAGE_TOKENS)
    except Exception as exc:  # a tokenizer class that needs remote code, a missing file, ...
        raise ConversionError(f"cannot load the tokenizer of {src} without remote code: {exc}") from exc
    vocab = tokenizer.get_vocab()
    missing = [t for t in ("<img>", "</img>", "<IMG_CONTEXT>") if t not in vocab]
    if missing:
        raise ConversionError(f"the tokenizer of {src} lacks {', '.join(missing)}: not an InternVL chat tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _processor(tokenizer: Any, original: dict[str, Any], image_seq_length: int) -> Any:
    """InternVL's dynamic tiling as the original ``config.json`` sets it (tile size, 1..max_dynamic_patch)."""
    from transformers import GotOcr2ImageProcessor, InternVLProcessor, InternVLVideoProcessor

    size = original.get("force_image_size") or original["vision_config"]["image_size"]
    tile = {"height": size, "width": size}
    dynamic = original.get("dynamic_image_size", True)
    image = GotOcr2ImageProcessor(
        size=tile,
        crop_to_patches=dynamic,
        min_patches=original.get("min_dynamic_patch", 1),
        max_patches=original.get("max_dynamic_patch", 12) if dynamic else 1,
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )
    video = InternVLVideoProcessor(size=tile, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    return InternVLProcessor(image, tokenizer, video, image_seq_length=image_seq_length, chat_template=CHAT_TEMPLATE)


def convert_internvl_chat(src: str | Path, dst: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``dst``: a transformers ``internvl`` checkpoint (weights, config, processor, generation config)."""
    from transformers import GenerationConfig, InternVLForConditionalGeneration

    src, dst = Path(src), Path(dst)
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ConversionError(f"{config_path} not found: pass a local checkpoint folder (download it first)")
    original = json.loads(config_path.read_text())
    if original.get("model_type") != "internvl_chat":
        raise ConversionError(
            f"{config_path} has model_type '{original.get('model_type')}', not 'internvl_chat': nothing to convert"
        )
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ConversionError(f"refusing to write into non-empty {dst} (pass -y / --yes to overwrite)")

    tokenizer = _tokenizer(src)
    config = internvl_config(original, tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"))
    processor = _processor(tokenizer, original, config.image_seq_length)
    state_dict = convert_state_dict(_read_weights(src))
    embed = state_dict["model.language_model.embed_tokens.weight"]
    head = state_dict.get("lm_head.weight")
    if config.tie_word_embeddings and head is not None and not torch.equal(head, embed):
        # a separate output head was saved: keep it, do not tie it away
        config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
    dtype = embed.dtype
    with torch.device("meta"):
        model = InternVLForConditionalGeneration(config)
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ConversionError(
            f"{src}: weights do not match the config (missing {missing[:5]}, unexpected {result.unexpected_keys[:5]})"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model.config.dtype = dtype
    dst.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dst)
    processor.save_pretrained(dst)
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tokenizer.get_vocab() else []
    llm_eos = original["llm_config"].get("eos_token_id")
    eos += [e for e in (llm_eos if isinstance(llm_eos, list) else [llm_eos]) if e is not None and e not in eos]
    GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id).save_pretrained(dst)
    for extra in ("README.md", "LICENSE"):
        if (src / extra).is_file():
            shutil.copyfile(src / extra, dst / extra)
    return dst


def internvl_chat_config(config: Any) -> dict[str, Any]:
    """The ``internvl_chat`` ``config.json`` of an ``InternVLConfig`` (the inverse of :func:`internvl_config`)."""
    vision = config.vision_config.to_dict()
    renamed = {"attention_bias": "qkv_bias", "use_qk_norm": "qk_normalization"}
    vision = {renamed.get(k, k): v for k, v in vision.items() if k not in DROPPED_CONFIG_KEYS}
    vision.update(image_size=vision["image_size"][0], patch_size=vision["patch_size"][0], model_type="intern_vit_6b")
    vision["architectures"] = ["InternVisionModel"]
    llm = {k: v for k, v in config.text_config.to_dict().items() if k not in DROPPED_CONFIG_KEYS}
    by_type = {v: k for k, v in SUPPORTED_LLMS.items()}
    llm["architectures"] = [by_type[llm["model_type"]]]
    llm["tie_word_embeddings"] = bool(config.tie_word_embeddings)
    return {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "vision_config": vision,
        "llm_config": llm,
        "downsample_ratio": config.downsample_ratio,
        "force_image_size": vision["image_size"],
        "select_layer": -1,
        "ps_version": "v2",
        "template": "internvl2_5",
        "dynamic_image_size": True,
        "use_thumbnail": True,
        "min_dynamic_patch": 1,
        "max_dynamic_patch": 12,
        "torch_dtype": str(config.dtype or "float32").replace("torch.", ""),
    }


def export_internvl_chat(
    hf_dir: str | Path, dst: str | Path, *, code_from: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Write a trained transformers ``internvl`` checkpoint back in the original ``internvl_chat`` layout.

    The original layout only loads with its remote code (``modeling_internvl_chat.py`` ...): ``code_from`` is
    the original checkpoint folder whose ``*.py`` files (and ``auto_map``) are copied along.
    """
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, InternVLForConditionalGeneration

    hf_dir, dst = Path(hf_dir), Path(dst)
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise ConversionError(f"refusing to write into non-empty {dst} (pass -y / --yes to overwrite)")
    model = InternVLForConditionalGeneration.from_pretrained(str(hf_dir))
    weights = to_internvl_chat_state_dict(model.state_dict())
    if model.config.tie_word_embeddings:
        weights.pop("language_model.lm_head.weight", None)
    config = internvl_chat_config(model.config)
    dst.mkdir(parents=True, exist_ok=True)
    if code_from is not None:
        code_from = Path(code_from)
        original = json.loads((code_from / "config.json").read_text())
        config.update({k: original[k] for k in ("auto_map", "template") if k in original})
        for file in code_from.glob("*.py"):
            shutil.copyfile(file, dst / file.name)
    weights = {k: v.contiguous() for k, v in weights.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    tokenizer.save_pretrained(dst)
    if (hf_dir / "generation_config.json").is_file():
        shutil.copyfile(hf_dir / "generation_config.json", dst / "generation_config.json")
    return dst
