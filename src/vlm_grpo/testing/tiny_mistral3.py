"""Tiny Mistral 3 (``Mistral3ForConditionalGeneration``, Mistral-Small-3.1/3.2): Pixtral tower and a Mistral LM.

The Pixtral processor scales an image down (never up) so its longest edge fits ``longest_edge``, rounds each
side up to ``patch_size * spatial_merge_size`` (28 px), and writes one ``[IMG]`` per 28 x 28 cell, an
``[IMG_BREAK]`` after each row and ``[IMG_END]`` in place of the last break. The patch merger folds 2 x 2
patches of 14 px into one token. Here ``longest_edge`` is 112 px: at most 4 x 4 image tokens plus the breaks.
The chat template is the real checkpoints' format (``[SYSTEM_PROMPT]``, ``[INST] ... [/INST]``, the answer
closed by ``</s>``), with ``{% generation %}`` markers around assistant turns; like Mistral-Small-3.1's it renders
no tools, so tool runs render with Mistral's own tool format (``tools.templates.mistral_tool_template``), whose
tokens the tokenizer has as special tokens, as the v11+ tokenizers do.
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.testing.presets import Preset
from vlm_grpo.testing.tiny_parts import TinyFamily, merged, text_config

SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "<pad>",
    # Mistral's tool tokens (mistral-common's v11+ tokenizers: Mistral-Small-3.2, Ministral 3)
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[TOOL_RESULTS]",
    "[TOOL_CONTENT]",
    "[/TOOL_RESULTS]",
)
LONGEST_EDGE = 112
PATCH = 14
MERGE = 2
PIXTRAL_MEAN = [0.48145466, 0.4578275, 0.40821073]
PIXTRAL_STD = [0.26862954, 0.26130258, 0.27577711]

# Mistral-Small-3.1's template (without its long default system prompt): list content renders text and
# [IMG] in order; every assistant turn ends with </s>, and there is no generation prompt (the answer
# follows [/INST] directly).
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}{{- '[IMG]' -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- '[SYSTEM_PROMPT]' + render(message['content']) + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST]' + render(message['content']) + '[/INST]' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- raise_exception('Only user, system and assistant roles are supported!') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Mistral3Config, PixtralImageProcessor, PixtralProcessor

    tokenizer.bos_token = "<s>"  # the template starts with it, as the real one does
    longest = preset.processor.get("longest_edge", LONGEST_EDGE)
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": longest,
        "patch_size": PATCH,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    top = {
        "image_token_index": tokenizer.convert_tokens_to_ids("[IMG]"),
        "spatial_merge_size": MERGE,
        "vision_feature_layer": -1,
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "tie_word_embeddings": False,
    }
    text = text_config(tokenizer, SPEC, model_type="mistral", head_dim=16, sliding_window=None)
    config = Mistral3Config(
        text_config=merged(text, preset.text),
        vision_config=merged(vision, preset.vision),
        **merged(top, preset.model),
    )
    image = PixtralImageProcessor(
        size={"longest_edge": longest},
        patch_size={"height": PATCH, "width": PATCH},
        image_mean=PIXTRAL_MEAN,
        image_std=PIXTRAL_STD,
    )
    processor = PixtralProcessor(
        image, tokenizer, patch_size=PATCH, spatial_merge_size=MERGE, chat_template=CHAT_TEMPLATE
    )
    return config, processor


SPEC = TinyFamily(build, CHAT_TEMPLATE, SPECIALS, eos="</s>", pad="<pad>", bos="<s>")
