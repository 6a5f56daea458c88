"""LLaVA-OneVision, Idefics3 and SmolVLM adapters: what a user of these families would notice.

Image token counts against the processor's real expansion (anyres tiles, unpadding, newlines; row/column tiles
and the global image), template overhead, freezing, LoRA targets (language and vision), coordinate frames,
refused rows and flags, and the speed path (packed log-prob pass, shared prefill, fast decode) against TRL's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from trl import GRPOTrainer

import vlm_grpo.fastpath.sharing as sharing
from test_group_sharing import G, _generate_both, assert_parity, make_trainer, real_batch
from vlm_grpo.cli_errors import UserError
from vlm_grpo.modules import ImageLimits, get_vlm_module

FAMILIES = ("llava_onevision", "idefics3", "smolvlm")
# Sizes around the tiny tiles (28 px LLaVA tiles, 56 px Idefics3 tiles and its 112 px longest edge), odd aspect
# ratios (unpadding, capped at anyres_max_4) and an image smaller than a tile.
SIZES = [(20, 20), (28, 28), (29, 28), (56, 56), (57, 55), (60, 30), (30, 90), (100, 37), (113, 57), (300, 20)]


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def one_image_rows(tmp_path_factory):
    """Prompts of different lengths; images of different sizes (different token counts); a text-only row."""
    root = tmp_path_factory.mktemp("one_image")
    noise(64, 48, 1).save(root / "a.png")
    noise(40, 90, 2).save(root / "b.png")
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Red?"}, {"from": "gpt", "value": "1"}]},
        {
            "image": "b.png",
            "conversations": [
                {"from": "human", "value": "Which colour is this one, please? <image>"},
                {"from": "gpt", "value": "2"},
            ],
        },
        {"conversations": [{"from": "human", "value": "Two plus two?"}, {"from": "gpt", "value": "4"}]},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def loaded(tiny_models, family):
    module = get_vlm_module(str(tiny_models[family]))
    return module, module.load_processor(str(tiny_models[family]))


def expanded_tokens(processor, image) -> int:
    """Prompt tokens the image adds, as the processor really expands it (with the chat template's own)."""
    question = {"type": "text", "text": "What is in the image?"}
    with_image = [{"role": "user", "content": [{"type": "image"}, question]}]
    without = [{"role": "user", "content": [question]}]
    text = processor.apply_chat_template(with_image, add_generation_prompt=True)
    plain = processor.apply_chat_template(without, add_generation_prompt=True)
    ids = processor(text=[text], images=[[image]], return_tensors="pt")["input_ids"]
    return ids.shape[1] - len(processor.tokenizer(plain, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_image_tokens_equal_what_the_processor_expands(family, tiny_models):
    module, processor = loaded(tiny_models, family)
    counts = {}
    for width, height in SIZES:
        counts[width, height] = module.num_image_tokens(processor, width, height)
        assert counts[width, height] == expanded_tokens(processor, noise(width, height)), (width, height)
    assert len(set(counts.values())) >= 3, counts  # the count really depends on the size here


def test_llava_onevision_template_overhead_is_the_newline_after_the_placeholder(tiny_models):
    """LLaVA-OneVision's turns put ``<image>`` on a line of its own: one token besides the expansion."""
    module, processor = loaded(tiny_models, "llava_onevision")
    assert module.image_template_overhead(processor) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_consumes_exactly_the_counted_tokens(family, tiny_models):
    """A forward over a batch of different sizes runs (features == placeholders) and images change the logits."""
    module, processor = loaded(tiny_models, family)
    model = module.load_model(str(tiny_models[family]), dtype=torch.float32)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    images = [[noise(60, 30, 1)], [noise(30, 90, 2)]]
    batch = processor(text=[text, text], images=images, padding=True, return_tensors="pt")
    other = processor(
        text=[text, text], images=[[noise(60, 30, 3)], [noise(30, 90, 4)]], padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        a, b = model(**batch).logits[:, -1], model(**other).logits[:, -1]
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_freezing_the_vision_side_leaves_the_language_model_trainable(family, tiny_models):
    module, _ = loaded(tiny_models, family)
    model = module.load_model(str(tiny_models[family]), dtype=torch.float32)
    frozen = module.freeze_vision(model)
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    language = ".language_model." if family == "llava_onevision" else ".text_model."
    assert trainable and all(language in n or n.startswith("lm_head") for n in trainable), trainable
    tower = "vision_tower" if family == "llava_onevision" else "vision_model"
    projector = "multi_modal_projector" if family == "llava_onevision" else "connector"
    assert any(tower in n for n in names) and any(projector in n for n in names)
    if family == "llava_onevision":
        assert "model.image_newline" in names  # the row separator is learned with the projector


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("include_vision", [False, True])
def test_lora_targets_the_language_model_and_optionally_the_vision_side(family, include_vision, tiny_models):
    from peft import LoraConfig, get_peft_model

    module, _ = loaded(tiny_models, family)
    model = module.load_model(str(tiny_models[family]), dtype=torch.float32)
    regex = module.lora_target_modules(include_vision=include_vision)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=regex))
    wrapped = {n.removesuffix(".lora_A.default") for n, _ in peft_model.named_modules() if n.endswith("lora_A.default")}
    language = {n for n in wrapped if (".language_model." if family == "llava_onevision" else ".text_model.") in n}
    vision = {n for n in wrapped if module.is_vision_parameter(n + ".weight")}
    assert language and {n.rsplit(".", 1)[-1] for n in language} == set(module.lora_targets)
    if not include_vision:
        assert not vision
        return
    kinds = {n.rsplit(".", 1)[-1] for n in vision}
    assert {"q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"} <= kinds  # the whole tower's attention and MLP
    projector = "linear_1" if family == "llava_onevision" else "proj"
    assert projector in kinds


@pytest.mark.parametrize(("family", "frame"), [("llava_onevision", (1, 1)), ("idefics3", (1000, 1000))])
def test_coordinate_frame_and_rec_prompt(family, frame, tiny_models):
    module, processor = loaded(tiny_models, family)
    assert module.coord_size(processor, 640, 480) == frame
    assert ("0 to 1" if frame == (1, 1) else "0-1000") in module.question_template("rec")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_rows_image_tokens_equal_what_the_processor_expands_with_several_images(family, tiny_models):
    """LLaVA-OneVision leaves images that share a sample untiled (one tile and a newline each)."""
    module, processor = loaded(tiny_models, family)
    sizes = [(60, 30), (30, 90)]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is larger?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    plain = processor.apply_chat_template([{"role": "user", "content": content[2:]}], add_generation_prompt=True)
    images = [[noise(w, h, i) for i, (w, h) in enumerate(sizes)]]
    ids = processor(text=[text], images=images, return_tensors="pt")["input_ids"]
    expanded = ids.shape[1] - len(processor.tokenizer(plain, add_special_tokens=False)["input_ids"])
    assert module.row_image_tokens(processor, sizes) == expanded
    assert module.row_image_tokens(processor, sizes[:1]) == module.num_image_tokens(processor, *sizes[0])
    if family == "llava_onevision":  # untiled: less than the two images tiled
        assert expanded < sum(module.num_image_tokens(processor, w, h) for w, h in sizes)


def test_trls_pass_gives_llava_onevision_the_image_count_of_each_sample(tiny_models, one_image_rows, tmp_path):
    """TRL's per-row pass (in chunks of one row) on a two-image sample next to one-image and text-only ones gives the
    model's own log-probs on each sample's processor output (which carries batch_num_images); without the trainer's
    hook the model tiles the two images and fails."""
    from vlm_grpo.trainer import rows_forward_kwargs

    trainer = make_trainer(tiny_models["llava_onevision"], one_image_rows, tmp_path)
    processor, model = trainer.processing_class, trainer.model.eval()

    def prompt(n):
        content = [{"type": "image"}] * n + [{"type": "text", "text": "Hi?"}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    texts, images = [prompt(2), prompt(1), prompt(0)], [[noise(60, 30, 1), noise(30, 90, 2)], [noise(40, 40, 3)], []]
    rows = []
    for text, imgs in zip(texts, images, strict=True):
        batch = processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt")
        with torch.no_grad():
            logps = model(**batch).logits[0, -4:-1].log_softmax(-1)
        rows.append((batch["input_ids"][0], logps.gather(-1, batch["input_ids"][0, -3:, None])[:, 0]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.stack([torch.nn.functional.pad(ids, (width - len(ids), 0)) for ids, _ in rows])
    mask = torch.stack([torch.nn.functional.pad(torch.ones_like(ids), (width - len(ids), 0)) for ids, _ in rows])
    full = processor(text=texts, images=[i for i in images if i], padding=True, return_tensors="pt")
    mm = {"pixel_values": full["pixel_values"], "image_sizes": full["image_sizes"], "num_images": [2, 1, 0]}
    trl_pass = GRPOTrainer._get_per_token_logps_and_entropies
    with torch.no_grad(), rows_forward_kwargs(model, trainer.vlm_module, mm):
        logps, _, _ = trl_pass(trainer, model, input_ids, mask, 3, batch_size=1, **mm)
    torch.testing.assert_close(logps, torch.stack([lp for _, lp in rows]), rtol=0, atol=1e-5)
    with torch.no_grad(), pytest.raises((ValueError, RuntimeError)):
        trl_pass(trainer, model, input_ids, mask, 3, batch_size=1, **mm)


def test_trls_pass_cuts_idefics3_pixels_per_sample(tiny_models, one_image_rows, tmp_path):
    """As many images as rows (two images, one, none): TRL would cut the per-sample pixel rows per image (the
    one-image row would get the text-only row's padding); with the adapter's ``num_tiles`` a pass in chunks of one
    row equals one pass over the batch."""
    from vlm_grpo.trainer import rows_forward_kwargs

    trainer = make_trainer(tiny_models["idefics3"], one_image_rows, tmp_path)
    processor, model = trainer.processing_class, trainer.model.eval()

    def prompt(n):
        content = [{"type": "image"}] * n + [{"type": "text", "text": "Hi?"}]
        return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)

    texts, images = [prompt(2), prompt(1), prompt(0)], [[noise(60, 30, 1), noise(30, 90, 2)], [noise(40, 40, 3)], []]
    full = processor(text=texts, images=images, padding=True, return_tensors="pt")
    mm = {k: full[k] for k in ("pixel_values", "pixel_attention_mask")} | {"num_images": [2, 1, 0]}
    mm |= trainer.vlm_module.trl_pixel_fields(mm)
    assert mm["num_tiles"] == [1, 1, 1]
    ids = torch.cat([full["input_ids"], full["input_ids"][:, -3:]], dim=1)  # three "completion" tokens
    mask = torch.cat([full["attention_mask"], torch.ones_like(full["input_ids"][:, -3:])], dim=1)
    trl_pass = GRPOTrainer._get_per_token_logps_and_entropies
    with torch.no_grad():
        whole, _, _ = trl_pass(trainer, model, ids, mask, 3, batch_size=3, **mm)
        with rows_forward_kwargs(model, trainer.vlm_module, mm):
            chunked, _, _ = trl_pass(trainer, model, ids, mask, 3, batch_size=1, **mm)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    del mm["num_tiles"]  # the control: TRL's own cut hands the one-image row the text-only row's padding
    with torch.no_grad(), pytest.raises((ValueError, RuntimeError)), rows_forward_kwargs(model, trainer.vlm_module, mm):
        trl_pass(trainer, model, ids, mask, 3, batch_size=1, **mm)


def test_idefics3_tool_images_regrouped_per_row(tiny_models):
    """TRL's tool loop runs the image processor on the batch's images as one sample's: one row per batch row again,
    each with its own tiles (counted from its <image> tokens), and num_tiles of one row each."""
    module, processor = loaded(tiny_models, "idefics3")
    images = [noise(60, 30, 1), noise(30, 90, 2), noise(40, 40, 3)]
    flat = processor.image_processor(images=images, return_tensors="pt")
    assert flat["pixel_values"].size(0) == 1  # the layout the adapter must undo
    per_image = [processor.image_processor(images=[[image]], return_tensors="pt") for image in images]
    tiles = [p["pixel_values"].size(1) for p in per_image]
    seq = processor.image_seq_len
    token = processor.image_token_id
    rows = [[token] * seq * (tiles[0] + tiles[1]), [], [token] * seq * tiles[2]]  # two images, none, one
    width = max(len(r) for r in rows) + 2
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    out = module.tool_pixel_fields(processor, dict(flat), input_ids)
    assert out["num_tiles"] == [1, 1, 1] and out["pixel_values"].shape[:2] == (3, tiles[0] + tiles[1])
    torch.testing.assert_close(out["pixel_values"][0, : tiles[0]], per_image[0]["pixel_values"][0])
    torch.testing.assert_close(out["pixel_values"][0, tiles[0] : tiles[0] + tiles[1]], per_image[1]["pixel_values"][0])
    assert not out["pixel_values"][1].any()  # the text-only row: padding, which the model drops
    torch.testing.assert_close(out["pixel_values"][2, : tiles[2]], per_image[2]["pixel_values"][0])
    bad = input_ids.clone()
    bad[2, -seq:] = 0  # a tile short: the counts do not match the pixels, left to TRL (which then fails loudly)
    assert module.tool_pixel_fields(processor, dict(flat), bad) == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_image_limit_flags_the_family_cannot_honour_are_errors(family, tiny_models):
    module = get_vlm_module(str(tiny_models[family]), limits=ImageLimits(max_pixels=100_000))
    with pytest.raises(UserError, match=r"--max_pixels: the '\w+' family has no such limit"):
        module.load_processor(str(tiny_models[family]))


# ----------------------------------------------------------------------------- the speed path against TRL's
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_pass_matches_trl(family, tiny_models, one_image_rows, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_models[family], one_image_rows, tmp_path, per_device_train_batch_size=3 * G)
    inputs = real_batch(trainer)
    assert inputs["num_images"].count(0) == G and inputs["prompt_mask"].sum(1).unique().numel() == 3
    packed = []
    real = sharing._packed_forward
    monkeypatch.setattr(sharing, "_packed_forward", lambda *a, **k: packed.append(1) or real(*a, **k))
    assert_parity(trainer, inputs)
    assert packed == [1]


def test_the_packed_parity_test_catches_images_given_the_wrong_sizes(tiny_models, one_image_rows, tmp_path):
    """Negative control: LLaVA-OneVision leaders' ``image_sizes`` swapped (tiles unpadded to the other image's
    aspect ratio) must fail the parity test."""
    trainer = make_trainer(tiny_models["llava_onevision"], one_image_rows, tmp_path, per_device_train_batch_size=3 * G)
    inputs = real_batch(trainer)
    real = type(trainer.vlm_module).group_vision_inputs

    def swapped(self, groups, mm):
        out = real(self, groups, mm)
        out["image_sizes"] = out["image_sizes"].flip(0)
        return out

    trainer.vlm_module.group_vision_inputs = swapped.__get__(trainer.vlm_module)
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        assert_parity(trainer, inputs)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefill_and_fast_decode_give_generates_greedy_tokens(family, tiny_models, one_image_rows, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    trainer = make_trainer(tiny_models[family], one_image_rows, tmp_path, per_device_train_batch_size=3 * G)
    config = trainer.generation_config
    config.do_sample, config.repetition_penalty = False, 5.0
    config.min_new_tokens = config.max_new_tokens
    calls = []
    tower = dict(trainer.model.named_modules())[trainer.vlm_module.vision_prefixes[0]]
    hook = tower.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        ours, plain, used = _generate_both(trainer, monkeypatch)
    finally:
        hook.remove()
    assert used == ["fast"] and ours == plain
    assert all(len(set(c)) > 2 for c in ours)
    assert len(calls) == 2  # ours: one vision pass over the unique images; TRL's: one more
