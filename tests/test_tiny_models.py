"""The offline tiny-checkpoint builder: every family builds, reloads, runs, and is deterministic."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText, AutoProcessor

from vlm_grpo.testing import FAMILIES, build_tiny_model
from vlm_grpo.testing.tiny import build_tokenizer, main

PLACEHOLDER = {"internvl": "<IMG_CONTEXT>\n"}
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _image(size: tuple[int, int], color=(200, 30, 30)) -> Image.Image:
    return Image.new("RGB", size, color)


def _chat() -> list[dict]:
    return [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "How many red circles? Also see"},
                {"type": "image"},
            ],
        },
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_build_reload_forward_generate(tiny_models, family):
    path = tiny_models[family]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == family
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    tok = processor.tokenizer
    assert 1000 <= len(tok) <= 2000
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert tok.padding_side == "left"
    image_token_id = model.config.image_token_id
    assert tok.convert_ids_to_tokens(image_token_id) == processor.image_token

    text = processor.apply_chat_template(_chat(), tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image((64, 48)), _image((56, 56), (0, 0, 255))], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape
    assert logits.shape[-1] == len(tok)
    assert torch.isfinite(logits).all()

    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_batched_left_padded_generate(tiny_models):
    path = tiny_models["qwen2_5_vl"]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path).eval()
    short = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in (short, _chat()[1:])]
    images = [_image((64, 48)), _image((64, 48)), _image((56, 56))]
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
    assert inputs["attention_mask"][0, 0] == 0  # padded on the left
    out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
    assert out.shape == (2, inputs["input_ids"].shape[1] + 2)


@pytest.mark.parametrize("family", ["qwen2_vl", "internvl"])
def test_chat_template(family):
    tok = build_tokenizer(family)
    image = PLACEHOLDER.get(family, QWEN_IMAGE)
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"}]},
        {"role": "assistant", "content": "<answer>2</answer>"},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n"
        f"<|im_start|>user\nA{image}B<|im_end|>\n"
        "<|im_start|>assistant\n<answer>2</answer><|im_end|>\n"
        f"<|im_start|>user\n{image}{image}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(messages[:2], tokenize=False).endswith("assistant\n")

    out = tok.apply_chat_template(messages[:3], return_dict=True, return_assistant_tokens_mask=True)
    kept = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(kept) == "<answer>2</answer><|im_end|>"


def test_tokenizer_handles_task_text():
    tok = build_tokenizer("qwen2_5_vl")
    text = "<think> 3 red circles, 2 blue squares. </think><answer>[12, 345, 67, 890]</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were learned
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]  # digits split like Qwen2's tokenizer


def test_default_image_limits_are_small(tiny_models):
    for family in ("qwen2_vl", "qwen3_vl"):
        processor = AutoProcessor.from_pretrained(tiny_models[family])
        grid = processor.image_processor(images=[_image((128, 128))], return_tensors="pt")["image_grid_thw"]
        assert int(grid.prod()) // processor.image_processor.merge_size**2 <= 16
    processor = AutoProcessor.from_pretrained(tiny_models["internvl"])
    ids = processor(text=["<IMG_CONTEXT>"], images=[_image((128, 96))])["input_ids"][0]
    assert len(ids) == 2 + processor.image_seq_length  # a single 56x56 tile


def test_same_seed_same_weights(tmp_path):
    for family in FAMILIES:
        a = build_tiny_model(family, tmp_path / f"{family}-a", seed=0)
        b = build_tiny_model(family, tmp_path / f"{family}-b", seed=0)
        c = build_tiny_model(family, tmp_path / f"{family}-c", seed=1)
        wa, wb, wc = (load_file(p / "model.safetensors") for p in (a, b, c))
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), family
        assert any(not torch.equal(wa[k], wc[k]) for k in wa), family
        assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model("qwen2_vl", tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_family(tmp_path):
    with pytest.raises(ValueError, match="Available: qwen2_vl"):
        build_tiny_model("llava", tmp_path)


def test_cli(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "--family" in capsys.readouterr().out
    main(["--family", "all", "--out", str(tmp_path)])
    for family in FAMILIES:
        assert json.loads((tmp_path / family / "config.json").read_text())["model_type"] == family
    main(["--family", "qwen3_vl", "--out", str(tmp_path / "one"), "--seed", "3"])
    assert (tmp_path / "one" / "model.safetensors").is_file()
