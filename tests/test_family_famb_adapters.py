"""Qwen3-VL-MoE, Gemma 3 and Mistral 3 adapters on their tiny checkpoints: lookup, image tokens as the processor
really expands them, freezing, LoRA targets (language and vision), image limits, box frames, the dummy image."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

import test_modules
from vlm_grpo.modules import ImageLimits, get_vlm_module
from vlm_grpo.modules.gemma3 import Gemma3Module
from vlm_grpo.modules.mistral3 import Mistral3Module
from vlm_grpo.modules.qwen3_vl_moe import Qwen3VLMoeModule

ADAPTERS = {"qwen3_vl_moe": Qwen3VLMoeModule, "gemma3": Gemma3Module, "mistral3": Mistral3Module}
FAMILIES = tuple(ADAPTERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_adapter_comes_from_model_type(tiny_models, family):
    module = get_vlm_module(str(tiny_models[family]))
    assert type(module) is ADAPTERS[family] and module.name == family


@pytest.mark.parametrize("family", FAMILIES)
def test_num_image_tokens_is_what_the_processor_expands_to(tiny_models, family):
    module, processor = test_modules._load(tiny_models, family)
    counts = set()
    for width, height in test_modules.SIZES:
        diff, _ = test_modules._prompt_len_diff(processor, width, height)
        assert module.num_image_tokens(processor, width, height) == diff, (family, width, height)
        counts.add(diff)
    assert (len(counts) == 1) == (family == "gemma3")  # Gemma 3: one fixed square; the others follow the size


def test_gemma3_image_is_boi_soft_tokens_eoi_with_token_types(tiny_models):
    _, processor = test_modules._load(tiny_models, "gemma3")
    _, full = test_modules._prompt_len_diff(processor, 300, 60)
    tokens = processor.tokenizer.convert_ids_to_tokens(full["input_ids"][0])
    n = processor.image_seq_length
    start = tokens.index("<start_of_image>")
    assert tokens[start + 1 : start + 2 + n] == ["<image_soft_token>"] * n + ["<end_of_image>"]
    assert tokens.count("<image_soft_token>") == n == 4
    # token_type_ids mark exactly the soft tokens (Gemma 3 attends bidirectionally within them).
    types = list(full["token_type_ids"][0])
    assert [i for i, t in enumerate(types) if t] == [i for i, t in enumerate(tokens) if t == "<image_soft_token>"]
    pixels = full["pixel_values"]  # every image becomes one square: no pan-and-scan crops
    assert len(pixels) == 1 and tuple(pixels[0].shape[-2:]) == (56, 56)


def test_mistral3_image_is_rows_of_img_tokens_with_breaks(tiny_models):
    module, processor = test_modules._load(tiny_models, "mistral3")
    _, full = test_modules._prompt_len_diff(processor, 300, 60)  # longest edge 300 -> 112: 112 x 23 -> 112 x 28
    tokens = processor.tokenizer.convert_ids_to_tokens(full["input_ids"][0])
    image = tokens[tokens.index("[IMG]") : tokens.index("[IMG_END]") + 1]
    assert image == ["[IMG]"] * 4 + ["[IMG_END]"]  # one row of 4 merged cells (28 px each)
    assert full["image_sizes"][0].tolist() == [28, 112]
    _, full = test_modules._prompt_len_diff(processor, 60, 90)  # 60 x 90 -> 84 x 112 px: 4 rows of 3
    tokens = processor.tokenizer.convert_ids_to_tokens(full["input_ids"][0])
    assert tokens.count("[IMG]") == 12 and tokens.count("[IMG_BREAK]") == 3 and tokens.count("[IMG_END]") == 1
    assert module.num_image_tokens(processor, 60, 90) == 16


@pytest.mark.parametrize("family", FAMILIES)
def test_freeze_vision_freezes_exactly_the_vision_tower_and_projector(tiny_models, family):
    test_modules.test_freeze_vision_freezes_exactly_the_vision_params(tiny_models, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_the_language_model_and_the_vision_tower_on_request(tiny_models, family):
    test_modules.test_lora_targets_only_language_model_linears(tiny_models, family)


def test_qwen3_vl_moe_lora_leaves_the_experts_and_router_alone(tiny_models):
    from peft import LoraConfig, get_peft_model

    module = get_vlm_module(str(tiny_models["qwen3_vl_moe"]))
    model = AutoModelForImageTextToText.from_pretrained(tiny_models["qwen3_vl_moe"])
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=module.lora_target_modules()))
    wrapped = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}
    assert {n.rsplit(".", 1)[-1] for n in wrapped} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(wrapped) == 4 * 2  # 2 layers
    assert not any(".mlp." in n for n in wrapped)


@pytest.mark.parametrize("family", ["gemma3", "mistral3"])
@pytest.mark.parametrize("limit", ["min_pixels", "max_pixels", "max_anyres_num"])
def test_image_limits_that_cannot_apply_are_refused(tiny_models, family, limit):
    path = str(tiny_models[family])
    module = get_vlm_module(path, limits=ImageLimits(**{limit: 4096}))
    with pytest.raises(ValueError, match=f"--{limit} cannot apply to"):
        module.load_processor(path)
    assert get_vlm_module(path).load_processor(path) is not None  # without it: fine


@pytest.mark.parametrize("family", FAMILIES)
def test_boxes_are_asked_for_in_the_frame_the_rewards_map_from(tiny_models, family):
    module, processor = test_modules._load(tiny_models, family)
    assert module.coord_size(processor, 300, 60) == (1000, 1000)
    assert "0-1000" in module.question_template("rec")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_dummy_image_reaches_every_vision_parameter(tiny_models, family):
    """Multi-process vision sync: a rank without images still runs the tower, so every vision weight gets a grad."""
    module = get_vlm_module(str(tiny_models[family]))
    model = AutoModelForImageTextToText.from_pretrained(tiny_models[family])
    module.dummy_vision_sum(model.model, "cpu").backward()
    vision = {n: p for n, p in model.named_parameters() if module.is_vision_parameter(n)}
    # Gemma 3's SigLIP post-layernorm feeds only the pooled head it does not use; the others are all reached.
    missing = [n for n, p in vision.items() if p.grad is None and "post_layernorm" not in n]
    assert vision and not missing


def test_mistral3_processor_returns_unpadded_prompt_ids(tiny_models):
    """TRL tokenizes a batch of prompts unpadded: Pixtral's tensor default would refuse different lengths."""
    _, processor = test_modules._load(tiny_models, "mistral3")
    texts = ["[INST][IMG]Hi[/INST]", "[INST][IMG]What is in this image, please?[/INST]"]
    out = processor(text=texts, images=[[Image.new("RGB", (30, 30))], [Image.new("RGB", (60, 40))]])
    assert isinstance(out["input_ids"], list) and len({len(r) for r in out["input_ids"]}) == 2
    assert isinstance(out["pixel_values"], torch.Tensor)


def test_real_shape_presets_keep_their_families_details():
    """The device benchmark's presets: MoE routing, Gemma's 5:1 local/global layers and 256 tokens per 896 px
    image, Pixtral's 1540 px longest edge."""
    from vlm_grpo.testing.tiny import build_config

    moe = build_config("qwen3_vl_30b_a3b")[0].text_config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    assert moe.output_router_logits is False and moe.router_aux_loss_coef == 0.001

    config, processor = build_config("gemma3_4b")
    layers = config.text_config.layer_types
    assert layers[:6] == ["sliding_attention"] * 5 + ["full_attention"] and layers.count("full_attention") == 5
    assert config.text_config.sliding_window == 1024 and config.mm_tokens_per_image == processor.image_seq_length == 256
    module = Gemma3Module()
    assert module.num_image_tokens(processor, 3000, 200) == module.num_image_tokens(processor, 20, 20) > 256

    config, processor = build_config("mistral3_24b")
    assert processor.image_processor.size["longest_edge"] == 1540 and config.vision_config.image_size == 1540
    assert Mistral3Module().num_image_tokens(processor, 3080, 3080) == 55 * 56  # 1540 px: 55 rows of 55 + a break
