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
