"""GLM-4.1V / GLM-4.5V adapter quirks: image tokens as the processor expands them (its two-frame pixel budget), the
template's image wrapper, the box frame, LoRA off GLM-4.5V's fused experts, and the router's auxiliary loss."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from PIL import Image

from e2e_utils import base_args, make_dataset
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.modules import ImageLimits, get_vlm_module

GLM = pytest.mark.parametrize("family", ["glm4v", "glm4v_moe"])
SIZES = [(48, 56), (64, 64), (200, 90), (30, 300), (500, 500)]


def _prompt_tokens(processor, image=None) -> int:
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": "What is it?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], images=[image] if image else None, return_tensors="pt")["input_ids"].shape[1]


@GLM
@pytest.mark.parametrize("max_pixels", [None, 2 * 84 * 84])
def test_image_tokens_are_what_the_processor_expands(family, max_pixels, tiny_models):
    module = get_vlm_module(str(tiny_models[family]), limits=ImageLimits(max_pixels=max_pixels))
    processor = module.load_processor(str(tiny_models[family]))
    assert module.image_template_overhead(processor) == 2  # <|begin_of_image|> ... <|end_of_image|>
    counts = set()
    for width, height in SIZES:
        image = Image.new("RGB", (width, height), (90, 20, 200))
        expanded = _prompt_tokens(processor, image) - _prompt_tokens(processor)
        assert module.num_image_tokens(processor, width, height) == expanded, (width, height)
        grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
        assert list(module.image_grid(processor, width, height)) == grid
        counts.add(expanded)
    # The budget counts two frames: 2 * 84 * 84 allows 84x84 px (9 tokens), not 118x118 (16).
    assert max(counts) == (9 + 2 if max_pixels else 16 + 2)


@GLM
def test_boxes_are_in_the_0_1000_frame(family, tiny_models):
    module = get_vlm_module(str(tiny_models[family]))
    processor = module.load_processor(str(tiny_models[family]))
    assert module.coord_size(processor, 640, 480) == (1000, 1000)
    assert "0-1000" in module.question_template("rec")


def _lora_layers(model, regex, dropout):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=regex, lora_dropout=dropout))
    return {n.removeprefix("base_model.model."): type(m).__name__ for n, m in peft_model.named_modules()
            if hasattr(m, "lora_A") and len(m.lora_A)}  # fmt: skip


def test_lora_keeps_off_glm45v_experts_and_reaches_the_vision_tower(tiny_models):
    from transformers import AutoModelForImageTextToText

    path = tiny_models["glm4v_moe"]
    module = get_vlm_module(str(path))
    layers = _lora_layers(
        AutoModelForImageTextToText.from_pretrained(path), module.lora_target_modules(include_vision=True), 0.05
    )
    assert set(layers.values()) <= {"Linear", "Conv3d"} and not any(".experts" in n for n in layers)
    language = {n for n in layers if n.startswith("model.language_model.")}
    assert {n.rsplit(".", 1)[-1] for n in language} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert any(n.startswith("model.visual.blocks.") and n.endswith(".attn.qkv") for n in layers)
    # Control: the gate/up/down names put LoRA on the fused experts (as parameters), which the defaults avoid.
    wide = _lora_layers(
        AutoModelForImageTextToText.from_pretrained(path), r".*\.(q_proj|gate_proj|up_proj|down_proj)", 0.0
    )
    assert any(".experts" in n for n in wide)


def test_glm41v_lora_reaches_the_fused_mlp(tiny_models):
    from transformers import AutoModelForImageTextToText

    path = tiny_models["glm4v"]
    module = get_vlm_module(str(path))
    layers = _lora_layers(AutoModelForImageTextToText.from_pretrained(path), module.lora_target_modules(), 0.05)
    assert any(re.fullmatch(r"model\.language_model\.layers\.\d+\.mlp\.gate_up_proj", n) for n in layers)
    assert not any(module.is_vision_parameter(n) for n in layers)


def test_glm45v_trains_with_trls_router_auxiliary_loss(tiny_models, tmp_path, caplog):
    """The config's router_aux_loss_coef (GLM-4.5V: 1e-4) turns TRL's auxiliary loss on; the training pass then goes
    through TRL's per-row pass, and says so."""
    caplog.set_level(logging.INFO, logger="vlm_grpo")
    monkey = pytest.MonkeyPatch()
    monkey.setattr("vlm_grpo.utils._warned", set())
    data, plugin = make_dataset(tmp_path / "data", kinds=("single",), n=1)
    try:
        trainer = main(*parse_args(base_args(tiny_models["glm4v_moe"], data, plugin, tmp_path / "out", steps=1)))
    finally:
        monkey.undo()
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == pytest.approx(1e-4)
    aux = [entry["aux_loss"] for entry in trainer.state.log_history if "aux_loss" in entry]
    assert aux and all(torch.isfinite(torch.tensor(a)) and a > 0 for a in aux)
    assert any("router's auxiliary loss" in r.getMessage() for r in caplog.records)


def test_tool_runs_read_and_write_glm45s_call_format(tiny_models):
    """A GLM checkpoint whose template renders no tools (GLM-4.1V-Thinking's) gets GLM's turns with GLM-4.5's tool
    format, and TRL's parser of that format reads a call back."""
    from transformers import AutoProcessor
    from trl.chat_template_utils import glm4moe_template, parse_response

    from vlm_grpo.tools.rollouts import prepare_for_tools
    from vlm_grpo.tools.templates import glm_tool_template

    processor = AutoProcessor.from_pretrained(tiny_models["glm4v"])
    plain = "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}<|assistant|>"
    processor.chat_template = processor.tokenizer.chat_template = plain
    prepare_for_tools(None, processor)
    assert processor.chat_template == glm_tool_template()
    assert processor.tokenizer.response_template == glm4moe_template
    turn = "\n<tool_call>zoom_in\n<arg_key>bbox_2d</arg_key>\n<arg_value>[1, 2, 30, 40]</arg_value>\n</tool_call>"
    tokenizer = processor.tokenizer
    ids = tokenizer.encode(turn + "<|endoftext|>", add_special_tokens=False)
    prefix = tokenizer.encode("[gMASK]<sop><|user|>\nZoom in.<|assistant|>", add_special_tokens=False)
    call = parse_response(tokenizer, ids, prefix=prefix)["tool_calls"][0]["function"]
    assert call["name"] == "zoom_in" and json.loads(str(call["arguments"]["bbox_2d"])) == [1, 2, 30, 40]
