"""vlm-grpo-convert internvl-chat: an original-layout InternVL checkpoint becomes the -hf one, bit for bit.

The original layout is built offline from the tiny -hf model by the inverse key map (no remote code, no hub):
fused ``attn.qkv``, ``ls1``, ``mlp1.N``, ``language_model.model.*``, ``llm_config`` / ``vision_config``, and a
tokenizer without the -hf processor's extra attributes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from vlm_grpo.convert.cli import main as convert_main
from vlm_grpo.convert.internvl_chat import ConversionError, export_internvl_chat, internvl_config
from vlm_grpo.modules import UnknownEntryError, get_vlm_module


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_models, tmp_path_factory):
    """(tiny -hf folder, the same model in the internvl_chat layout)."""
    hf = tiny_models["internvl"]
    chat = tmp_path_factory.mktemp("internvl_chat") / "InternVL-tiny"
    export_internvl_chat(hf, chat)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config.pop("extra_special_tokens", None)  # the original tokenizers name no image-token attributes
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    (chat / "chat_template.jinja").unlink(missing_ok=True)
    return hf, chat


def _inputs(processor, text: str):
    image = Image.new("RGB", (56, 56), (200, 30, 30))
    image.paste((20, 20, 220), (0, 0, 28, 28))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[prompt], images=[image], return_tensors="pt")


def _load(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(str(path)).eval(), AutoProcessor.from_pretrained(str(path))


def test_the_built_checkpoint_has_the_original_layout(chat_checkpoint):
    _, chat = chat_checkpoint
    config = json.loads((chat / "config.json").read_text())
    assert config["model_type"] == "internvl_chat"
    assert config["llm_config"]["architectures"] == ["Qwen2ForCausalLM"]
    with safe_open(str(chat / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        qkv = f.get_slice("vision_model.encoder.layers.0.attn.qkv.weight").get_shape()
    assert {"vision_model.encoder.layers.1.ls2", "mlp1.3.weight", "language_model.model.norm.weight"} <= keys
    assert qkv == [3 * config["vision_config"]["hidden_size"], config["vision_config"]["hidden_size"]]
    assert not any("q_proj" in k for k in keys if k.startswith("vision_model"))


def test_training_an_internvl_chat_checkpoint_names_the_conversion_command(chat_checkpoint):
    _, chat = chat_checkpoint
    with pytest.raises(UnknownEntryError) as err:
        get_vlm_module(str(chat))
    assert f"vlm-grpo-convert internvl-chat {chat} {chat}-hf" in str(err.value)
    assert f"--model_name_or_path {chat}-hf" in str(err.value)


def test_conversion_gives_the_same_weights_and_logits(chat_checkpoint, tmp_path, capsys):
    hf, chat = chat_checkpoint
    out = tmp_path / "converted"
    assert convert_main(["internvl-chat", str(chat), str(out)]) == 0
    assert f"--model_name_or_path {out}" in capsys.readouterr().out
    assert get_vlm_module(str(out)).name == "internvl"

    reference, ref_processor = _load(hf)
    converted, processor = _load(out)
    ref_state, state = reference.state_dict(), converted.state_dict()
    assert ref_state.keys() == state.keys()
    for key, value in ref_state.items():
        assert torch.equal(value, state[key]), key
    with torch.no_grad():
        for text in ("What color is the square?", "How many boxes are there?"):
            ref_inputs, inputs = _inputs(ref_processor, text), _inputs(processor, text)
            assert torch.equal(ref_inputs["input_ids"], inputs["input_ids"])
            assert torch.equal(ref_inputs["pixel_values"], inputs["pixel_values"])
            ref_logits = reference(**ref_inputs).logits
            torch.testing.assert_close(converted(**inputs).logits, ref_logits, rtol=0, atol=1e-6)
            greedy = converted.generate(**inputs, max_new_tokens=6, do_sample=False)
            assert torch.equal(greedy, reference.generate(**ref_inputs, max_new_tokens=6, do_sample=False))

        # Negative control: q and v of one vision layer swapped (a wrong qkv split) changes the logits.
        attention = converted.model.vision_tower.encoder.layer[0].attention
        q, v = attention.q_proj.weight.clone(), attention.v_proj.weight.clone()
        attention.q_proj.weight.copy_(v)
        attention.v_proj.weight.copy_(q)
        inputs = _inputs(processor, "What color is the square?")
        assert not torch.allclose(converted(**inputs).logits, reference(**inputs).logits, atol=1e-4)

    # A trained checkpoint goes back to the layout it came from: the same tensors under the original names.
    back = tmp_path / "back"
    assert convert_main(["to-internvl-chat", str(out), str(back)]) == 0
    with safe_open(str(chat / "model.safetensors"), "pt") as a, safe_open(str(back / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_bad_sources_are_clear_errors(chat_checkpoint, tmp_path, capsys):
    hf, chat = chat_checkpoint
    assert convert_main(["internvl-chat", str(hf), str(tmp_path / "x")]) == 1
    assert "model_type 'internvl', not 'internvl_chat'" in capsys.readouterr().err
    original = json.loads((chat / "config.json").read_text())
    original["llm_config"]["architectures"] = ["InternLM2ForCausalLM"]
    with pytest.raises(ConversionError, match="InternLM2ForCausalLM' is not supported"):
        internvl_config(original, image_token_id=0)


def test_grpo_recipe_on_an_internvl_chat_checkpoint_prints_the_command(chat_checkpoint, tmp_path):
    _, chat = chat_checkpoint
    data = tmp_path / "x.jsonl"  # present: the cheap checks (data files first) pass, the model family does not
    data.write_text('{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "hi"}]}\n')
    argv = ["--model_name_or_path", str(chat), "--data_file_paths", str(data), "--output_dir", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "vlm_grpo.grpo_jsonl", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode != 0
    assert f"vlm-grpo-convert internvl-chat {chat} {chat}-hf" in result.stderr, result.stderr[-2000:]


# The original InternVL-chat names of one vision layer / one language-model layer and their transformers names,
# written out by hand from the two models' module trees (InternViT + mlp1 + a Qwen2 LM, and
# InternVLForConditionalGeneration); the fused ``attn.qkv`` is listed apart. Nothing here comes from the converter.
HAND_MAP_VISION_LAYER = {
    "attn.proj.weight": "attention.projection_layer.weight",
    "attn.proj.bias": "attention.projection_layer.bias",
    "attn.q_norm.weight": "attention.q_norm.weight",
    "attn.k_norm.weight": "attention.k_norm.weight",
    "ls1": "lambda_1",
    "ls2": "lambda_2",
    "norm1.weight": "layernorm_before.weight",
    "norm1.bias": "layernorm_before.bias",
    "norm2.weight": "layernorm_after.weight",
    "norm2.bias": "layernorm_after.bias",
    "mlp.fc1.weight": "mlp.fc1.weight",
    "mlp.fc1.bias": "mlp.fc1.bias",
    "mlp.fc2.weight": "mlp.fc2.weight",
    "mlp.fc2.bias": "mlp.fc2.bias",
}
HAND_MAP_LM_LAYER = [
    f"{part}.{kind}"
    for part, kinds in (
        ("self_attn.q_proj", ("weight", "bias")),
        ("self_attn.k_proj", ("weight", "bias")),
        ("self_attn.v_proj", ("weight", "bias")),
        ("self_attn.o_proj", ("weight",)),
        ("mlp.gate_proj", ("weight",)),
        ("mlp.up_proj", ("weight",)),
        ("mlp.down_proj", ("weight",)),
        ("input_layernorm", ("weight",)),
        ("post_attention_layernorm", ("weight",)),
    )
    for kind in kinds
]
HAND_MAP_OTHER = {
    "vision_model.embeddings.class_embedding": "model.vision_tower.embeddings.cls_token",
    "vision_model.embeddings.position_embedding": "model.vision_tower.embeddings.position_embeddings",
    "vision_model.embeddings.patch_embedding.weight": (
        "model.vision_tower.embeddings.patch_embeddings.projection.weight"
    ),
    "vision_model.embeddings.patch_embedding.bias": ("model.vision_tower.embeddings.patch_embeddings.projection.bias"),
    "mlp1.0.weight": "model.multi_modal_projector.layer_norm.weight",
    "mlp1.0.bias": "model.multi_modal_projector.layer_norm.bias",
    "mlp1.1.weight": "model.multi_modal_projector.linear_1.weight",
    "mlp1.1.bias": "model.multi_modal_projector.linear_1.bias",
    "mlp1.3.weight": "model.multi_modal_projector.linear_2.weight",
    "mlp1.3.bias": "model.multi_modal_projector.linear_2.bias",
    "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
    "language_model.model.norm.weight": "model.language_model.norm.weight",
    "language_model.lm_head.weight": "lm_head.weight",
}


@pytest.fixture(scope="module")
def hand_made():
    """(original state dict, the transformers state dict it must become, transformers' own key set): random
    tensors of the right shapes, two layers each side, qkv bias and q/k norms on; built by the hand map."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": [28, 28], "patch_size": [14, 14], "attention_bias": True, "use_qk_norm": True}  # fmt: skip
    text = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}  # fmt: skip
    config = InternVLConfig(vision_config=vision, text_config=text, image_token_id=127)
    shapes = {k: v.shape for k, v in InternVLForConditionalGeneration(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    original, expected = {}, {}

    def put(old: str, new: str) -> None:
        original[old] = expected[new] = torch.randn(shapes[new], generator=generator)

    for old, new in HAND_MAP_OTHER.items():
        put(old, new)
    for layer in range(config.vision_config.num_hidden_layers):
        old, new = f"vision_model.encoder.layers.{layer}.", f"model.vision_tower.encoder.layer.{layer}."
        for a, b in HAND_MAP_VISION_LAYER.items():
            put(old + a, new + b)
        for kind in ("weight", "bias"):  # qkv rows: q, then k, then v
            parts = [torch.randn(shapes[f"{new}attention.{p}_proj.{kind}"], generator=generator) for p in "qkv"]
            original[f"{old}attn.qkv.{kind}"] = torch.cat(parts)
            expected.update({f"{new}attention.{p}_proj.{kind}": t for p, t in zip("qkv", parts, strict=True)})
    for layer in range(config.text_config.num_hidden_layers):
        for name in HAND_MAP_LM_LAYER:
            put(f"language_model.model.layers.{layer}.{name}", f"model.language_model.layers.{layer}.{name}")
    return original, expected, set(shapes)


def test_the_key_map_matches_a_hand_written_one_tensor_for_tensor(hand_made):
    """Every original weight lands under the name the hand map gives it, with its own values (two same-shaped
    weights trading places, a wrong qkv split, a dropped key: each fails); the names are transformers' own."""
    from vlm_grpo.convert.internvl_chat import convert_state_dict

    original, expected, transformers_keys = hand_made
    assert set(expected) == transformers_keys  # the hand map covers the whole model
    converted = convert_state_dict(original)
    assert sorted(converted) == sorted(expected)
    wrong = [k for k in expected if not torch.equal(converted[k], expected[k])]
    assert wrong == [], wrong


def test_the_way_back_gives_the_original_names_and_tensors(hand_made):
    from vlm_grpo.convert.internvl_chat import to_internvl_chat_state_dict

    original, expected, _ = hand_made
    back = to_internvl_chat_state_dict(expected)
    assert sorted(back) == sorted(original)
    wrong = [k for k in original if not torch.equal(back[k], original[k])]
    assert wrong == [], wrong


def test_the_hand_map_check_catches_two_same_shaped_weights_trading_places(hand_made, monkeypatch):
    """Control: a converter that splits qkv as (k, q, v) gives same-shaped tensors under the wrong names."""
    import vlm_grpo.convert.internvl_chat as chat

    real = chat.convert_state_dict

    def split_kq(state):
        out = real(state)
        for q_key in [k for k in out if ".attention.q_proj." in k]:
            k_key = q_key.replace("q_proj", "k_proj")
            out[q_key], out[k_key] = out[k_key], out[q_key]
        return out

    monkeypatch.setattr(chat, "convert_state_dict", split_kq)
    with pytest.raises(AssertionError, match="q_proj"):
        test_the_key_map_matches_a_hand_written_one_tensor_for_tensor(hand_made)


def test_weights_outside_the_known_parts_are_named_both_ways(hand_made):
    from vlm_grpo.convert.internvl_chat import convert_state_dict, to_internvl_chat_state_dict

    original, expected, _ = hand_made
    with pytest.raises(ConversionError) as info:
        convert_state_dict({**original, "extra_head.weight": torch.zeros(1)})
    assert str(info.value) == "unexpected weight 'extra_head.weight': not a vision_model / mlp1 / language_model weight"
    with pytest.raises(ConversionError) as info:
        to_internvl_chat_state_dict({**expected, "model.extra.weight": torch.zeros(1)})
    assert str(info.value) == "unexpected weight 'model.extra.weight' in an InternVLForConditionalGeneration state dict"
