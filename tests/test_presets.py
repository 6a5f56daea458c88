"""Real-size presets, checked cheaply: configs and meta-device models (no weights), tokenizer, processors."""

from __future__ import annotations

import functools
import json
import random
import time

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from vlm_grpo.modules import VLM_MODULES
from vlm_grpo.testing import tiny
from vlm_grpo.testing.presets import PRESETS, Preset, get_preset
from vlm_grpo.testing.tiny import build_config, build_model, build_tokenizer, main, num_parameters

# Parameter counts of the real hub checkpoints (their model cards / safetensors metadata).
REAL_PARAMS = {
    "qwen2_vl_2b": 2.21e9,
    "qwen2_5_vl_3b": 3.75e9,
    "qwen2_5_vl_7b": 8.29e9,
    "qwen3_vl_2b": 2.13e9,
    "internvl3_1b": 0.94e9,
    "internvl3_2b": 2.09e9,
    "glm4v_9b": 10.3e9,
    "glm4v_moe_106b": 108e9,
    "qwen3_vl_30b_a3b": 31.07e9,
    "gemma3_4b": 4.30e9,
    "mistral3_24b": 24.01e9,
    "llava_onevision_7b": 8.03e9,
    "smolvlm_2b": 2.25e9,
}
REAL = list(REAL_PARAMS)
# (family, text: hidden, layers, heads, kv heads, intermediate, vocab, tied)
TEXT_SHAPES = {
    "qwen2_vl_2b": ("qwen2_vl", 1536, 28, 12, 2, 8960, 151936, True),
    "qwen2_5_vl_3b": ("qwen2_5_vl", 2048, 36, 16, 2, 11008, 151936, True),
    "qwen2_5_vl_7b": ("qwen2_5_vl", 3584, 28, 28, 4, 18944, 152064, False),
    "qwen3_vl_2b": ("qwen3_vl", 2048, 28, 16, 8, 6144, 151936, True),
    "internvl3_1b": ("internvl", 896, 24, 14, 2, 4864, 151674, False),
    "internvl3_2b": ("internvl", 1536, 28, 12, 2, 8960, 151674, False),
    "glm4v_9b": ("glm4v", 4096, 40, 32, 2, 13696, 151552, False),
    "glm4v_moe_106b": ("glm4v_moe", 4096, 46, 96, 8, 10944, 151552, False),
    "qwen3_vl_30b_a3b": ("qwen3_vl_moe", 2048, 48, 32, 4, 6144, 151936, False),
    "gemma3_4b": ("gemma3", 2560, 34, 8, 4, 10240, 262208, True),
    "mistral3_24b": ("mistral3", 5120, 40, 32, 8, 32768, 131072, False),
    "llava_onevision_7b": ("llava_onevision", 3584, 28, 28, 4, 18944, 152128, False),
    "smolvlm_2b": ("idefics3", 2048, 24, 32, 32, 8192, 49155, False),
}


@functools.cache
def _config(name: str):
    return build_config(name)


@functools.cache
def _meta_model(name: str):
    config, _ = _config(name)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


def _image(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (200, 30, 30))


def test_full_vocab_tokenizer_builds_fast_and_decodes_every_id():
    tiny._full_vocab_backend.cache_clear()
    tiny._trained_bpe_json.cache_clear()
    start = time.perf_counter()
    tok = build_tokenizer("qwen2_5_vl", vocab_size=151936)
    elapsed = time.perf_counter() - start
    assert elapsed < 20, f"full-vocab tokenizer took {elapsed:.1f}s"
    assert len(tok) == 151936
    # Every id the model can sample decodes; the special tokens sit at the top of the range.
    ids = list(range(len(tok)))
    assert all(t is not None for t in tok.convert_ids_to_tokens(ids))
    assert len(tok.decode(ids)) > len(tok)
    sampled = random.Random(0).sample(ids, 2000)
    assert all(isinstance(tok.decode([i]), str) for i in sampled)
    assert tok.convert_tokens_to_ids("<|video_pad|>") == len(tok) - 1
    assert tok.convert_tokens_to_ids("<|endoftext|>") == len(tok) - 7
    # Normal text still round-trips, compresses, and splits digits one by one.
    text = "<|im_start|>user\nHow many red circles? <think> 3 red, 2 blue. </think><answer>[12, 345]</answer><|im_end|>"
    enc = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(enc) == text and len(enc) < len(text) // 2
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]
    # Deterministic: an uncached rebuild gives the same vocabulary and merges.
    assert tiny._extended_bpe(151929).to_str() == tiny._extended_bpe(151929).to_str()
    with pytest.raises(ValueError, match="below the trained BPE"):
        build_tokenizer("qwen2_vl", vocab_size=100)


def test_preset_table():
    assert set(REAL) | {f"tiny_{f}" for f in tiny.TINY_FAMILIES} == set(PRESETS)
    assert all(p.params for name, p in PRESETS.items() if not p.is_tiny)
    for name in REAL:
        assert not PRESETS[name].is_tiny and PRESETS[name].params == REAL_PARAMS[name]
    assert all(PRESETS[f"tiny_{f}"].is_tiny for f in tiny.TINY_FAMILIES)
    with pytest.raises(ValueError, match="Available: tiny_qwen2_vl"):
        get_preset("qwen9_vl_1t")
    with pytest.raises(ValueError, match="Unknown model family"):
        Preset(family="llava")
    with pytest.raises(TypeError):
        PRESETS["qwen2_5_vl_3b"].text["hidden_size"] = 1  # overrides are read-only


@pytest.mark.parametrize("name", REAL)
def test_real_shapes_and_parameter_count(name):
    family, hidden, layers, heads, kv, intermediate, vocab, tied = TEXT_SHAPES[name]
    config, processor = _config(name)
    text = config.get_text_config()
    assert config.model_type == family
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (hidden, layers, heads)
    assert (text.num_key_value_heads, text.intermediate_size, text.vocab_size) == (kv, intermediate, vocab)
    assert config.tie_word_embeddings is tied
    assert len(processor.tokenizer) == vocab

    model = _meta_model(name)
    embed = model.get_input_embeddings().weight
    assert tuple(embed.shape) == (vocab, hidden)
    assert tuple(model.lm_head.weight.shape) == (vocab, hidden)
    assert (model.lm_head.weight is embed) is tied
    n = num_parameters(model)
    assert n == pytest.approx(REAL_PARAMS[name], rel=0.03), f"{name}: {n / 1e9:.3f}B"


def test_vision_and_rope_details():
    q25 = _config("qwen2_5_vl_3b")[0]
    v = q25.vision_config
    assert (v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size) == (32, 1280, 3420, 16, 2048)
    assert (v.patch_size, v.spatial_merge_size, v.temporal_patch_size, v.window_size) == (14, 2, 2, 112)
    assert list(v.fullatt_block_indexes) == [7, 15, 23, 31]
    assert _config("qwen2_5_vl_7b")[0].vision_config.out_hidden_size == 3584
    rope = q25.text_config.rope_parameters
    assert list(rope["mrope_section"]) == [16, 24, 24] and rope["rope_theta"] == 1e6

    v2 = _config("qwen2_vl_2b")[0].vision_config
    assert (v2.depth, v2.embed_dim, v2.hidden_size, v2.num_heads, v2.mlp_ratio) == (32, 1280, 1536, 16, 4)

    q3 = _config("qwen3_vl_2b")[0]
    v3 = q3.vision_config
    assert (v3.depth, v3.hidden_size, v3.intermediate_size, v3.num_heads) == (24, 1024, 4096, 16)
    assert v3.out_hidden_size == 2048
    assert (v3.patch_size, v3.num_position_embeddings, list(v3.deepstack_visual_indexes)) == (16, 2304, [5, 11, 17])
    assert q3.text_config.head_dim == 128
    rope3 = q3.text_config.rope_parameters
    assert list(rope3["mrope_section"]) == [24, 20, 20] and rope3["mrope_interleaved"] and rope3["rope_theta"] == 5e6

    ivl = _config("internvl3_1b")[0]
    vi = ivl.vision_config
    assert (vi.hidden_size, vi.num_hidden_layers, vi.num_attention_heads, vi.intermediate_size) == (1024, 24, 16, 4096)
    assert list(vi.image_size) == [448, 448] and list(vi.patch_size) == [14, 14] and vi.attention_bias
    assert (ivl.downsample_ratio, ivl.image_seq_length) == (0.5, 256)
    # InternViT-300M: 24 blocks of 12.6M plus embeddings (the tower alone is ~0.30B).
    tower = sum(p.numel() for k, p in _meta_model("internvl3_1b").named_parameters() if "vision_tower" in k)
    assert tower == pytest.approx(0.304e9, rel=0.01)


def _image_tokens(name: str, width: int, height: int) -> tuple[int, int]:
    """(image tokens the processor puts in the prompt, what the family's VLM adapter predicts)."""
    _, processor = _config(name)
    family = get_preset(name).family
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = processor(text=[text], images=[_image(width, height)])["input_ids"][0]
    plain = processor.tokenizer(
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "What is it?"}]}],
            tokenize=False,
            add_generation_prompt=True,
        ),
        add_special_tokens=False,
    )["input_ids"]
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    adapter = VLM_MODULES.get(family)(None)
    assert len(ids) - len(plain) == adapter.num_image_tokens(processor, width, height)
    return sum(i == image_token_id for i in ids), len(ids) - len(plain)


def test_real_processors_image_tokens_and_limits():
    for name in ("qwen2_vl_2b", "qwen2_5_vl_3b"):
        ip = _config(name)[1].image_processor
        assert (ip.size["shortest_edge"], ip.size["longest_edge"], ip.patch_size) == (3136, 12845056, 14)
        assert _image_tokens(name, 448, 448)[0] == 256  # (448 / 28)^2
    q3 = _config("qwen3_vl_2b")[1]
    assert (q3.image_processor.size["shortest_edge"], q3.image_processor.size["longest_edge"]) == (65536, 16777216)
    assert q3.image_processor.patch_size == 16 and list(q3.image_processor.image_mean) == [0.5, 0.5, 0.5]
    assert (q3.video_processor.size["shortest_edge"], q3.video_processor.size["longest_edge"]) == (4096, 25165824)
    assert _image_tokens("qwen3_vl_2b", 448, 448)[0] == 196  # (448 / 32)^2
    assert _image_tokens("qwen3_vl_2b", 64, 64)[0] == 64  # raised to min_pixels 256x256

    ivl = _config("internvl3_1b")[1]
    assert ivl.image_processor.max_patches == 12 and ivl.image_seq_length == 256
    assert _image_tokens("internvl3_1b", 448, 448) == (256, 256 + 2 + 1)  # <img> 256 </img>, "\n"
    # A 2:1 image: 2 tiles plus the thumbnail.
    assert _image_tokens("internvl3_1b", 896, 448)[0] == 3 * 256


def test_build_model_on_meta_device():
    # The real build path (seeding, dtype, generation config) without allocating weights.
    model, processor = build_model("qwen2_5_vl_7b", device="meta")
    assert num_parameters(model) == num_parameters(_meta_model("qwen2_5_vl_7b"))
    assert model.dtype == torch.bfloat16 and model.device.type == "meta"
    tok = processor.tokenizer
    gen = model.generation_config
    assert gen.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    assert gen.pad_token_id == tok.pad_token_id
    ivl, _ = build_model("internvl3_2b", device="meta", dtype=torch.float16)
    assert ivl.dtype == torch.float16 and ivl.config.image_token_id == ivl.config.get_text_config().vocab_size - 2


def test_saved_preset_config_and_processor_reload(tmp_path):
    config, processor = _config("internvl3_1b")
    config.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    reloaded = AutoProcessor.from_pretrained(tmp_path)
    assert len(reloaded.tokenizer) == 151674 and reloaded.image_processor.max_patches == 12
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "internvl"
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tmp_path))
    assert num_parameters(model) == num_parameters(_meta_model("internvl3_1b"))


def test_cli(tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "qwen2_5_vl_3b" in capsys.readouterr().out
    for bad in (["--out", str(tmp_path)], ["--preset", "qwen2_vl_2b", "--family", "qwen2_vl", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit):
            main(bad)

    calls = []

    def fake_build_model(name, out_dir=None, seed=0, dtype=None, device="cpu"):
        calls.append((name, out_dir, seed, dtype, device))
        return _meta_model(name), None

    monkeypatch.setattr(tiny, "build_model", fake_build_model)
    main(["--preset", "qwen2_5_vl_3b", "--out", str(tmp_path / "m"), "--device", "cuda", "--seed", "2"])
    assert calls == [("qwen2_5_vl_3b", tmp_path / "m", 2, torch.bfloat16, "cuda")]
    assert "3.75B" in capsys.readouterr().out
    main(["--preset", "internvl3_1b", "--out", str(tmp_path / "i"), "--dtype", "float32"])
    assert calls[-1][3] == torch.float32
    main(["--preset", "tiny", "--family", "qwen2_vl", "--out", str(tmp_path / "t")])
    assert calls[-1] == ("tiny_qwen2_vl", tmp_path / "t", 0, torch.float32, "cpu")


def test_real_llava_onevision_and_smolvlm_processors():
    # One 384 px tile: the base image (27 x 27) plus its one anyres tile unpadded, each row ending in a newline.
    assert _image_tokens("llava_onevision_7b", 384, 384)[0] == 729 + 27 * 27 + 27
    # SmolVLM resizes to a 1536 px longest edge: 4 x 4 tiles and the global image, 81 tokens each.
    ip = _config("smolvlm_2b")[1].image_processor
    assert (ip.size["longest_edge"], ip.max_image_size["longest_edge"]) == (1536, 384)
    assert _image_tokens("smolvlm_2b", 384, 384)[0] == 17 * 81
