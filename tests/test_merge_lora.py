"""merge_lora: base + adapter -> a plain model folder with the adapter model's greedy outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlm_grpo.merge_lora import main as merge_main
from vlm_grpo.modules import get_vlm_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_adapter(model_dir: Path, out: Path, with_processor: bool = True) -> Path:
    """A LoRA adapter with random (non-zero) weights on the language model, saved like training saves it."""
    from peft import LoraConfig, get_peft_model

    module = get_vlm_module(str(model_dir))
    model = module.load_model(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=module.lora_target_modules(), init_lora_weights=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out)
    if with_processor:
        module.load_processor(str(model_dir)).save_pretrained(out)
    return out


def greedy_tokens(model, processor, prompts) -> list[list[int]]:
    outputs = []
    for text, images in prompts:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        inputs = processor(text=[chat], images=images or None, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=12, do_sample=False, temperature=None, top_p=None, top_k=None)
        outputs.append(out[0, inputs["input_ids"].shape[1] :].tolist())
    return outputs


def test_merged_model_gives_the_adapter_models_greedy_tokens(tiny_models, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = tiny_models["qwen2_5_vl"]
    adapter = make_adapter(base, tmp_path / "adapter")
    merged_dir = tmp_path / "merged"
    assert merge_main(["--adapter", str(adapter), "--output_dir", str(merged_dir)]) == 0

    # a plain Hugging Face folder: weights, config, generation config and processor, no adapter
    for name in ("config.json", "generation_config.json", "model.safetensors", "chat_template.jinja"):
        assert (merged_dir / name).is_file(), name
    assert not (merged_dir / "adapter_config.json").exists()
    assert json.loads((merged_dir / "generation_config.json").read_text()) == json.loads(
        (base / "generation_config.json").read_text()
    )

    processor = AutoProcessor.from_pretrained(merged_dir)
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir, dtype=torch.float32).eval()
    module = get_vlm_module(str(base))
    with_adapter = PeftModel.from_pretrained(module.load_model(str(base), dtype=torch.float32), adapter).eval()
    plain = module.load_model(str(base), dtype=torch.float32).eval()

    red = Image.new("RGB", (64, 48), (220, 30, 30))
    blue = Image.new("RGB", (48, 64), (30, 30, 220))
    prompts = [
        ("What colour is the square?", [red]),
        ("Compare the two images. Which is red?", [red, blue]),
        ("What is 3 + 4?", []),
        ("How many circles are there in the image?", [blue]),
    ]
    expected = greedy_tokens(with_adapter, processor, prompts)
    assert greedy_tokens(merged, processor, prompts) == expected
    assert greedy_tokens(plain, processor, prompts) != expected  # the adapter does change the model


def test_merge_reads_the_base_from_the_adapter_and_refuses_to_overwrite(tiny_models, tmp_path, capsys):
    base = tiny_models["qwen2_5_vl"]
    adapter = make_adapter(base, tmp_path / "adapter", with_processor=False)  # processor comes from the base
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert merge_main(["--adapter", str(adapter), "--output_dir", str(out)]) == 2
    assert "Refusing to write into non-empty" in capsys.readouterr().err
    assert merge_main(["--adapter", str(adapter), "--output_dir", str(out), "-y"]) == 0
    assert (out / "config.json").is_file() and (out / "processor_config.json").is_file()
    assert get_vlm_module(str(out)).name == "qwen2_5_vl"  # GRPO / SFT / eval accept it as --model_name_or_path


def test_merge_refuses_a_folder_without_an_adapter(tiny_models, tmp_path, capsys):
    assert merge_main(["--adapter", str(tiny_models["qwen2_5_vl"]), "--output_dir", str(tmp_path / "o")]) == 2
    assert "not a LoRA adapter folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--help"])
def test_merge_help(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        merge_main([flag])
    assert exc.value.code == 0
    assert "--adapter" in capsys.readouterr().out
