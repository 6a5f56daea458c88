"""Tiny Gemma 3 (``Gemma3ForConditionalGeneration``): SigLIP tower, pooled to ``mm_tokens_per_image`` tokens.

The real processor resizes every image to 896 x 896 (SigLIP, patch 14: 64 x 64 patches) and pools them to
256 ``<image_soft_token>``; each ``<start_of_image>`` the template writes becomes ``\\n\\n<start_of_image>``,
256 soft tokens, ``<end_of_image>\\n\\n``. Here: 56 x 56 px, 4 x 4 patches pooled to 4 tokens. The language
model alternates a sliding-window layer and a global one (the real ones: 5 local, 1 global), with Gemma's
``query_pre_attn_scalar`` and embedding scaling. The chat template is TRL's training copy of the real one
(``{% generation %}`` markers around the model's turns); like the real one it renders no tools.
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.testing.presets import Preset
from vlm_grpo.testing.tiny_parts import TinyFamily, merged, text_config

SPECIALS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
# Gemma3Processor reads these as tokenizer attributes (the real tokenizer_config.json's extra special tokens).
EXTRA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TILE = 56  # px: patch 14 gives 4 x 4 patches, pooled 2 x 2 into 4 image tokens
IMAGE_TOKENS = 4


def _chat_template() -> str:
    from trl.chat_template_utils import gemma3_training_chat_template

    return gemma3_training_chat_template


def build(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Gemma3Config, Gemma3ImageProcessor, Gemma3Processor

    ids = tokenizer.convert_tokens_to_ids
    tokenizer.bos_token = "<bos>"  # the template starts with it, as the real one does
    text = text_config(
        tokenizer,
        SPEC,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=32,  # shorter than most test prompts: the local layer really is local
        layer_types=["sliding_attention", "full_attention"],
        hidden_activation="gelu_pytorch_tanh",
    )
    tile = preset.processor.get("tile", TILE)
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": tile,
        "patch_size": 14,
        "vision_use_head": False,
    }
    top = {
        "mm_tokens_per_image": IMAGE_TOKENS,
        "boi_token_index": ids("<start_of_image>"),
        "eoi_token_index": ids("<end_of_image>"),
        "image_token_index": ids("<image_soft_token>"),
        # Untied here (the real checkpoints tie): Gemma scales the input embedding by sqrt(hidden), and at 64 wide a
        # tied head then mostly predicts the token it was given, whatever the context.
        "tie_word_embeddings": False,
    }
    config = Gemma3Config(
        text_config=merged(text, preset.text),
        vision_config=merged(vision, preset.vision),
        **merged(top, preset.model),
    )
    image = Gemma3ImageProcessor(
        size={"height": tile, "width": tile},
        do_pan_and_scan=False,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        resample=2,  # bilinear, as the real preprocessor_config.json
        rescale_factor=1 / 255,
    )
    processor = Gemma3Processor(
        image, tokenizer, chat_template=SPEC.chat_template, image_seq_length=config.mm_tokens_per_image
    )
    return config, processor


def init_weights(model: Any) -> None:
    """The projector's input projection: transformers initialises it to zeros, which would blank every image."""
    import torch

    weight = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        weight.normal_(0.0, weight.size(0) ** -0.5)


SPEC = TinyFamily(
    build,
    _chat_template(),
    SPECIALS,
    EXTRA_TOKENS,
    eos="<end_of_turn>",
    pad="<pad>",
    bos="<bos>",
    init_weights=init_weights,
)
