"""VLM-module adapters on tiny checkpoints: lookup, freezing, LoRA targets, image tokens, box frames."""

from __future__ import annotations

import json
import re

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from vlm_grpo.modules import ImageLimits, get_vlm_module
from vlm_grpo.modules.internvl import InternVLModule
from vlm_grpo.modules.qwen2_5_vl import Qwen25VLModule
from vlm_grpo.modules.qwen2_vl import Qwen2VLModule
from vlm_grpo.modules.qwen3_vl import Qwen3VLModule
from vlm_grpo.registry import UnknownEntryError
from vlm_grpo.testing import FAMILIES

ADAPTERS = {
    "qwen2_vl": Qwen2VLModule,
    "qwen2_5_vl": Qwen25VLModule,
    "qwen3_vl": Qwen3VLModule,
    "internvl": InternVLModule,
}
# (width, height): square, landscape, portrait, tiny, larger than max_pixels, extreme aspect.
SIZES = [(56, 56), (64, 48), (48, 64), (20, 30), (200, 150), (300, 60)]


def _load(tiny_models, family, limits=None):
    path = str(tiny_models[family])
    module = get_vlm_module(path, limits=limits)
    return module, module.load_processor(path)


def _prompt_len_diff(processor, width, height, question="What is in the image?"):
    """Tokens the image adds: processed prompt with it minus tokenized prompt without the image item."""
    text_item = {"type": "text", "text": question}
    with_image = [{"role": "user", "content": [{"type": "image"}, text_item]}]
    without = [{"role": "user", "content": [text_item]}]
    render = processor.apply_chat_template
    full = processor(
        text=[render(with_image, tokenize=False, add_generation_prompt=True)],
        images=[Image.new("RGB", (width, height), (10, 200, 10))],
    )
    plain = processor.tokenizer(render(without, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    return len(full["input_ids"][0]) - len(plain["input_ids"]), full


@pytest.mark.parametrize("family", FAMILIES)
def test_get_vlm_module_picks_adapter_from_model_type(tiny_models, family):
    module = get_vlm_module(str(tiny_models[family]))
    assert type(module) is ADAPTERS[family]
    assert module.name == family
    limits = ImageLimits(max_pixels=1234)
    assert get_vlm_module(str(tiny_models[family]), limits=limits).limits is limits
    assert type(get_vlm_module("unused", vlm_module=family)) is ADAPTERS[family]


def test_unknown_model_type_lists_available_modules(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery_vl"}))
    with pytest.raises(UnknownEntryError) as exc:
        get_vlm_module(str(tmp_path))
    message = str(exc.value)
    assert "mystery_vl" in message
    assert "Available:" in message
    assert all(name in message for name in FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_freeze_vision_freezes_exactly_the_vision_params(tiny_models, family):
    module = get_vlm_module(str(tiny_models[family]))
    model = AutoModelForImageTextToText.from_pretrained(tiny_models[family])
    frozen = module.freeze_vision(model)
    params = dict(model.named_parameters())
    vision = {n for n in params if any(n.startswith(p + ".") for p in module.vision_prefixes)}
    assert vision, "vision_prefixes match no parameter"
    assert {n for n, p in params.items() if not p.requires_grad} == vision
    assert frozen == sum(params[n].numel() for n in vision)
    # Every prefix names a real submodule, and the language model stays trainable.
    modules = dict(model.named_modules())
    assert all(p in modules for p in module.vision_prefixes)
    language = [p for n, p in params.items() if n.startswith("model.language_model.")]
    assert language and all(p.requires_grad for p in language)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_only_language_model_linears(tiny_models, family):
    from peft import LoraConfig, get_peft_model

    module = get_vlm_module(str(tiny_models[family]))
    model = AutoModelForImageTextToText.from_pretrained(tiny_models[family])
    regex = module.lora_target_modules()
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    expected = {
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and name.startswith("model.language_model.")
        and name.rsplit(".", 1)[-1] in module.lora_targets
    }
    # The vision tower has same-named linears in some families, so the exclusion is doing work there.
    vision_same_names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and module.is_vision_parameter(name)
        and re.fullmatch(rf".*\.({'|'.join(module.lora_targets)})", name)
    ]
    if family in ("qwen2_5_vl", "internvl"):
        assert vision_same_names

    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=regex))
    wrapped = {
        name.removeprefix("base_model.model.")
        for name, m in peft_model.named_modules()
        if hasattr(m, "lora_A") and isinstance(m.lora_A, torch.nn.ModuleDict) and len(m.lora_A)
    }
    assert wrapped == expected
    assert expected and not any(module.is_vision_parameter(n) for n in wrapped)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    with_vision = module.lora_target_modules(include_vision=True)
    assert all(re.fullmatch(with_vision, n) for n in vision_same_names)
    # --lora_include_vision reaches every linear layer of the vision tower (the mergers' unnamed Sequential items
    # aside), and the language model's as before.
    reached = {name for name in linears if re.fullmatch(with_vision, name)}
    vision = {name for name in linears if module.is_vision_parameter(name)}
    assert {n for n in vision - reached if not n.rsplit(".", 1)[-1].isdigit()} == set()
    assert reached - vision == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_num_image_tokens_is_exact(tiny_models, family):
    module, processor = _load(tiny_models, family)
    for width, height in SIZES:
        diff, _ = _prompt_len_diff(processor, width, height)
        assert module.num_image_tokens(processor, width, height) == diff, (family, width, height)


def test_num_image_tokens_internvl_tiling(tiny_models):
    module, processor = _load(tiny_models, "internvl", ImageLimits(max_anyres_num=6))
    assert processor.image_processor.crop_to_patches and processor.image_processor.max_patches == 6
    counts = set()
    for width, height in [*SIZES, (168, 56), (112, 112), (250, 120)]:
        diff, _ = _prompt_len_diff(processor, width, height)
        assert module.num_image_tokens(processor, width, height) == diff, (width, height)
        counts.add(diff)
    tokens_per_tile = processor.image_seq_length
    # Tiling is really happening: 168x56 -> 3 tiles + a thumbnail.
    assert module.num_image_tokens(processor, 168, 56) - module.num_image_tokens(processor, 56, 56) == (
        3 * tokens_per_tile
    )
    assert len(counts) > 2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_qwen_pixel_limits(tiny_models, family):
    path = str(tiny_models[family])
    module = get_vlm_module(path)
    factor = module.load_processor(path).image_processor.patch_size * 2
    limits = ImageLimits(min_pixels=(2 * factor) ** 2, max_pixels=(3 * factor) ** 2)
    module, processor = _load(tiny_models, family, limits)
    size = processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (limits.min_pixels, limits.max_pixels)
    for width, height in [(400, 400), (20, 20), (90, 300)]:
        diff, full = _prompt_len_diff(processor, width, height)
        pads = int(full["image_grid_thw"][0].prod()) // 4
        assert 4 <= pads <= 9
        assert module.num_image_tokens(processor, width, height) == diff == pads + 2


def test_qwen2_5_vl_coord_size_is_the_resized_input(tiny_models):
    module, processor = _load(tiny_models, "qwen2_5_vl")
    patch = processor.image_processor.patch_size
    for width, height in SIZES:
        grid = processor.image_processor(images=[Image.new("RGB", (width, height))])["image_grid_thw"][0]
        _, grid_h, grid_w = (int(v) for v in grid)
        assert module.coord_size(processor, width, height) == (grid_w * patch, grid_h * patch)
    assert module.coord_size(processor, 64, 48) != (64, 48)  # resizing really happens
    assert "absolute pixel" in module.question_template("rec")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "internvl"])
def test_normalised_coordinate_families(tiny_models, family):
    module, processor = _load(tiny_models, family)
    assert module.coord_size(processor, 64, 48) == (1000, 1000)
    assert "0-1000" in module.question_template("rec")
    assert "{question}" in module.question_template("rec")
