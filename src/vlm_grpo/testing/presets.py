"""Size presets for :func:`vlm_grpo.testing.tiny.build_model`: real architectures, random weights.

A randomly initialised model with a real checkpoint's configuration costs exactly as much to train
as the real checkpoint (speed and memory do not depend on weight values), so these presets let the
trainer be measured at real model size on machines without hub access. Each preset copies the
real ``config.json`` shapes (text and vision towers, projector, tying, rope layout), the real
processor's default image limits and the real generation token ids; the tokenizer is the offline
BPE extended to exactly ``vocab_size`` entries, so every id the model can sample decodes.

``tiny_<family>`` presets are the tiny checkpoints of :func:`~vlm_grpo.testing.tiny.build_tiny_model`.
Fields are overrides on top of the tiny settings of the preset's family (see ``tiny.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from vlm_grpo.testing.presets_gemma3 import GEMMA3_4B
from vlm_grpo.testing.presets_glm4v import GLM4V_9B, GLM4V_MOE_106B
from vlm_grpo.testing.presets_idefics3 import SMOLVLM_2B
from vlm_grpo.testing.presets_llava_onevision import LLAVA_ONEVISION_7B
from vlm_grpo.testing.presets_mistral3 import MISTRAL3_24B
from vlm_grpo.testing.presets_qwen3_vl_moe import QWEN3_VL_30B_A3B

#: The families every per-feature test runs on.
FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")
#: Further families with a tiny offline build (each in ``tiny_<family>.py``), covered by the family matrix.
MORE_FAMILIES: tuple[str, ...] = (
    "glm4v",
    "glm4v_moe",
    "qwen3_vl_moe",
    "gemma3",
    "mistral3",
    "llava_onevision",
    "idefics3",
    "smolvlm",
)
#: Every family ``python -m vlm_grpo.testing.tiny --family`` can build.
TINY_FAMILIES: tuple[str, ...] = FAMILIES + MORE_FAMILIES


def _frozen(d: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(d or {}))


@dataclass(frozen=True)
class Preset:
    """One model shape: the family plus overrides of that family's tiny configuration.

    ``text`` / ``vision`` override the text and vision sub-configs, ``model`` the top-level config
    (``tie_word_embeddings``, ``image_seq_length`` ...), ``processor`` the image/video processor knobs
    (Qwen: ``min_pixels``, ``max_pixels``, ``video_min_pixels``, ``video_max_pixels``,
    ``image_mean``, ``image_std``; InternVL: ``tile``, ``max_patches``), ``generation`` the saved
    ``generation_config``. ``vocab_size`` is the tokenizer and embedding size (``None``: the tiny
    BPE's own size). ``params`` is the real checkpoint's parameter count, for reference.
    """

    family: str
    reference: str = ""
    vocab_size: int | None = None
    text: Mapping[str, Any] = field(default_factory=_frozen)
    vision: Mapping[str, Any] = field(default_factory=_frozen)
    model: Mapping[str, Any] = field(default_factory=_frozen)
    processor: Mapping[str, Any] = field(default_factory=_frozen)
    generation: Mapping[str, Any] = field(default_factory=_frozen)
    params: float | None = None

    def __post_init__(self) -> None:
        if self.family not in TINY_FAMILIES:
            raise ValueError(f"Unknown model family '{self.family}'. Available: {', '.join(TINY_FAMILIES)}")
        for name in ("text", "vision", "model", "processor", "generation"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def is_tiny(self) -> bool:
        return self.vocab_size is None


# ----------------------------------------------------------------------------- shared pieces
QWEN_VOCAB = 151936  # Qwen2 / Qwen2.5 (<= 3B) / Qwen3 embedding rows (the tokenizer has 151665)
QWEN_7B_VOCAB = 152064  # Qwen2.5-7B pads its embedding further
INTERNVL_VOCAB = 151674  # InternVL3 (-hf): Qwen2.5's tokenizer plus <img>, </img>, <IMG_CONTEXT>, ...

# The processors' real defaults (preprocessor_config.json of the hub checkpoints).
QWEN2_PIXELS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384}  # 3136 .. 12845056
QWEN3_PIXELS = {
    "min_pixels": 256 * 256,  # 65536
    "max_pixels": 4096 * 4096,  # 16777216
    "video_min_pixels": 64 * 64,  # 4096 (video_preprocessor_config.json)
    "video_max_pixels": 24 * 1024 * 1024,  # 25165824
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
INTERNVL_PROCESSOR = {"tile": 448, "max_patches": 12}

# generation_config.json token ids of the Instruct checkpoints (<|im_end|> and <|endoftext|> stop).
# Their sampling knobs (near-greedy top_k=1 / top_p=0.001 for Qwen2/2.5-VL) are left out on purpose:
# RL trainers pass their own temperature / top_p / top_k.
QWEN_GENERATION = {"eos": ["<|im_end|>", "<|endoftext|>"], "pad": "<|endoftext|>", "bos": "<|endoftext|>"}
INTERNVL_GENERATION = {"eos": ["<|im_end|>"], "pad": "<|endoftext|>", "bos": "<|endoftext|>"}


def _qwen2_text(
    hidden: int, layers: int, heads: int, kv: int, intermediate: int, vocab: int, max_pos: int
) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
    }


def _qwen2_5_vision(out_hidden: int) -> dict[str, Any]:
    return {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": out_hidden,
        "hidden_act": "silu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    }


# InternViT-300M-448px (InternVL3-1B/2B): its qkv projection has a bias, unlike the config default.
INTERNVIT_300M = {
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "image_size": 448,
    "patch_size": 14,
    "attention_bias": True,
    "use_qk_norm": False,
    "norm_type": "layer_norm",
    "layer_norm_eps": 1e-6,
    "hidden_act": "gelu",
    "layer_scale_init_value": 0.1,
    "use_mean_pooling": True,
}
QWEN2_ROPE = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}

# ----------------------------------------------------------------------------- the presets
PRESETS: dict[str, Preset] = {f"tiny_{family}": Preset(family=family, reference="tiny") for family in TINY_FAMILIES}

PRESETS["qwen2_vl_2b"] = Preset(
    family="qwen2_vl",
    reference="Qwen/Qwen2-VL-2B-Instruct",
    vocab_size=QWEN_VOCAB,
    text={**_qwen2_text(1536, 28, 12, 2, 8960, QWEN_VOCAB, 32768), "rope_parameters": QWEN2_ROPE},
    vision={
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1536,
        "num_heads": 16,
        "mlp_ratio": 4,
        "hidden_act": "quick_gelu",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    model={"tie_word_embeddings": True},
    processor=QWEN2_PIXELS,
    generation=QWEN_GENERATION,
    params=2.21e9,
)
PRESETS["qwen2_5_vl_3b"] = Preset(
    family="qwen2_5_vl",
    reference="Qwen/Qwen2.5-VL-3B-Instruct",
    vocab_size=QWEN_VOCAB,
    text={**_qwen2_text(2048, 36, 16, 2, 11008, QWEN_VOCAB, 128000), "rope_parameters": QWEN2_ROPE},
    vision=_qwen2_5_vision(2048),
    model={"tie_word_embeddings": True},
    processor=QWEN2_PIXELS,
    generation=QWEN_GENERATION,
    params=3.75e9,
)
PRESETS["qwen2_5_vl_7b"] = Preset(
    family="qwen2_5_vl",
    reference="Qwen/Qwen2.5-VL-7B-Instruct",
    vocab_size=QWEN_7B_VOCAB,
    text={**_qwen2_text(3584, 28, 28, 4, 18944, QWEN_7B_VOCAB, 128000), "rope_parameters": QWEN2_ROPE},
    vision=_qwen2_5_vision(3584),
    model={"tie_word_embeddings": False},
    processor=QWEN2_PIXELS,
    generation=QWEN_GENERATION,
    params=8.29e9,
)
PRESETS["qwen3_vl_2b"] = Preset(
    family="qwen3_vl",
    reference="Qwen/Qwen3-VL-2B-Instruct",
    vocab_size=QWEN_VOCAB,
    text={
        **_qwen2_text(2048, 28, 16, 8, 6144, QWEN_VOCAB, 262144),
        "head_dim": 128,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
            "rope_theta": 5e6,
        },
    },
    vision={
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "hidden_act": "gelu_pytorch_tanh",
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 2304,  # a 48x48 grid
        "deepstack_visual_indexes": [5, 11, 17],
    },
    model={"tie_word_embeddings": True},
    processor=QWEN3_PIXELS,
    generation=QWEN_GENERATION,
    params=2.13e9,
)
# InternVL3 (-hf) unties the language model's embeddings (lm_head is its own 151674 x hidden matrix).
PRESETS["internvl3_1b"] = Preset(
    family="internvl",
    reference="OpenGVLab/InternVL3-1B-hf",
    vocab_size=INTERNVL_VOCAB,
    text={
        **_qwen2_text(896, 24, 14, 2, 4864, INTERNVL_VOCAB, 32768),
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
    },
    vision=INTERNVIT_300M,
    model={"tie_word_embeddings": False, "image_seq_length": 256, "downsample_ratio": 0.5},
    processor=INTERNVL_PROCESSOR,
    generation=INTERNVL_GENERATION,
    params=0.94e9,
)
PRESETS["internvl3_2b"] = Preset(
    family="internvl",
    reference="OpenGVLab/InternVL3-2B-hf",
    vocab_size=INTERNVL_VOCAB,
    text={
        **_qwen2_text(1536, 28, 12, 2, 8960, INTERNVL_VOCAB, 32768),
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
    },
    vision=INTERNVIT_300M,
    model={"tie_word_embeddings": False, "image_seq_length": 256, "downsample_ratio": 0.5},
    processor=INTERNVL_PROCESSOR,
    generation=INTERNVL_GENERATION,
    params=2.09e9,
)
PRESETS["glm4v_9b"] = Preset(family="glm4v", **GLM4V_9B)
PRESETS["glm4v_moe_106b"] = Preset(family="glm4v_moe", **GLM4V_MOE_106B)

PRESETS["qwen3_vl_30b_a3b"] = Preset(**QWEN3_VL_30B_A3B, processor=QWEN3_PIXELS, generation=QWEN_GENERATION)
PRESETS["gemma3_4b"] = Preset(**GEMMA3_4B)
PRESETS["mistral3_24b"] = Preset(**MISTRAL3_24B)

PRESETS["llava_onevision_7b"] = Preset(**LLAVA_ONEVISION_7B)
PRESETS["smolvlm_2b"] = Preset(**SMOLVLM_2B)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset '{name}'. Available: {', '.join(PRESETS)}")
    return PRESETS[name]
