"""Image features encoded once per step (``reuse_vision_features``): the log-prob passes take the generation's.

A generation batch from TRL's own ``_generate_and_score_completions`` (old and reference passes included), cut
into shuffled micro-batches of ragged rows as TRL's ``_prepare_inputs`` cuts it; every pass's log-probs, loss and
gradients equal those of the same pass encoding its images, and hooks on the vision tower count what it encodes.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from trl.trainer.utils import (
    shuffle_sequence_dict,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from test_group_sharing import MM_KEYS, G, make_trainer
from test_packed_ragged import loss_and_grads
from vlm_grpo.fastpath.vision_reuse import FEATURES_KEY
from vlm_grpo.fastpath.vision_sync import vision_backbone
from vlm_grpo.testing.tiny import FAMILIES
from vlm_grpo.utils import peft_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def two_images(tmp_path_factory):
    """Two prompts of different lengths, each with its own image of the same size (features can be swapped)."""
    root = tmp_path_factory.mktemp("reuse")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "a.png")
    Image.new("RGB", (64, 48), (30, 30, 200)).save(root / "b.png")
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Red?"}, {"from": "gpt", "value": "1"}]},
        {
            "image": "b.png",
            "conversations": [
                {"from": "human", "value": "<image>Which colour has this picture? Tell me, please."},
                {"from": "gpt", "value": "2"},
            ],
        },
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class TowerCounter:
    """Counts the vision tower's calls and the images (Qwen) or tiles (InternVL) it encodes."""

    def __init__(self, model):
        backbone = vision_backbone(model)
        tower = getattr(backbone, "visual", None) or backbone.vision_tower
        self.calls = self.units = 0
        self.handle = tower.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs):
        self.calls += 1
        grid = kwargs.get("grid_thw")
        self.units += (
            grid.size(0) if grid is not None else (kwargs.get("pixel_values", args[0] if args else None)).size(0)
        )

    def take(self) -> tuple[int, int]:
        counts = self.calls, self.units
        self.calls = self.units = 0
        return counts


def build(family, tiny_models, rows_file, tmp_path, variant, tools=None, trainer_kwargs_extra=None, **overrides):
    """``variant``: "frozen" (--freeze_vision_modules), "lora" (LoRA on the language model) or "trained"."""
    kwargs = {"freeze_vision_modules": True} if variant == "frozen" else {}
    kwargs |= trainer_kwargs_extra or {}
    if tools:
        kwargs["tools"] = tools
    trainer = make_trainer(
        tiny_models[family], rows_file, tmp_path, lora=variant == "lora", trainer_kwargs=kwargs,
        per_device_train_batch_size=G, steps_per_generation=2, beta=0.04, **overrides,
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # what the Trainer's loop sets before compute_loss
    return trainer, TowerCounter(trainer.model)


def generation_batch(trainer, counter, ragged=True):
    """TRL's generation output (old and reference log-probs computed), with ``ragged`` completions (two rows cut
    short); tower counts of the generation and of the old/reference passes."""
    trainer.model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions(batch)
    pad = trainer._tokenizer.pad_token_id
    for row, keep in ((1, 2), (4, 4)) if ragged else ():
        out["completion_mask"][row, keep:] = 0
        out["completion_ids"][row, keep:] = pad
    return out, counter.take()


def micro_batches(trainer, out, seed=1):
    """As TRL's ``_prepare_inputs`` buffers a generation: split per row, shuffled, cut, pixels joined again."""
    torch.manual_seed(seed)
    batch = shuffle_sequence_dict(split_pixel_values_by_grid(out))
    return [unsplit_pixel_values_by_grid(b) for b in split_tensor_dict(batch, trainer.args.steps_per_generation)]


def pass_logps(trainer, inputs, features=None):
    """The old-pass call as TRL makes it, on ``inputs`` (with ``features``: as a loss pass holding them)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    trainer._pass_rows = features
    try:
        with torch.no_grad():
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, inputs["completion_ids"].size(1), **{k: inputs.get(k) for k in MM_KEYS}
            )
    finally:
        trainer._pass_rows = None
    return logps * inputs["completion_mask"]


def assert_grads_close(ours, ref, tol=1e-5):
    assert ours.keys() == ref.keys() and ref
    for name, g in ref.items():
        if g.norm() < 1e-6 and ours[name].norm() < 1e-6:
            continue
        rel = (ours[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert rel <= tol, f"{name}: relative L2 {rel:.2e}"


@pytest.mark.parametrize(
    ("family", "variant"),
    [
        *((f, v) for f in FAMILIES for v in ("frozen", "lora")),
        ("glm4v", "frozen"),
        ("glm4v_moe", "frozen"),
        ("qwen3_vl_moe", "frozen"),
    ],
)
def test_passes_reuse_generation_features_at_parity(family, variant, tiny_models, two_images, tmp_path):
    trainer, counter = build(family, tiny_models, two_images, tmp_path, variant)
    out, (_, generation_units) = generation_batch(trainer, counter)
    # The generation prefill encodes each prompt's image (one tile each) once; the old and reference passes nothing.
    assert generation_units == 2
    assert trainer.last_vision_reuse == "reused"
    assert all(f is not None for f in out[FEATURES_KEY])
    ref = pass_logps(trainer, out)  # outside the generation: no kept features, the pass encodes
    assert counter.take()[0] > 0
    torch.testing.assert_close(out["old_per_token_logps"] * out["completion_mask"], ref, rtol=0, atol=1e-5)
    for micro in micro_batches(trainer, out):
        assert len({f[0] for f in micro[FEATURES_KEY]}) == 2  # a shuffled cut holds rows of both groups
        loss, grads = loss_and_grads(trainer, micro, reuse_vision_features=True)
        assert counter.take() == (0, 0) and trainer.last_vision_reuse == "reused"
        ref_loss, ref_grads = loss_and_grads(trainer, micro, reuse_vision_features=False)
        assert counter.take()[0] > 0
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_features_of_another_image_change_the_logps(share_prompt, tiny_models, two_images, tmp_path):
    """Control: the features really are what the decoder sees: another prompt's image's features handed to a row
    change its log-probs, in the packed pass and in TRL's per-row pass."""
    trainer, counter = build("qwen2_5_vl", tiny_models, two_images, tmp_path, "frozen", share_prompt=share_prompt)
    out, _ = generation_batch(trainer, counter)
    kept = out[FEATURES_KEY]
    assert pass_logps(trainer, out, kept).equal(out["old_per_token_logps"] * out["completion_mask"])
    assert counter.take() == (0, 0)
    first, last = kept[0], kept[-1]
    assert first[0] is not last[0]  # rows 0 and 5 are of the two prompts (G copies each, in order)
    swapped = [last if f is first else first if f is last else f for f in kept]
    changed = pass_logps(trainer, out, swapped)
    assert counter.take() == (0, 0)
    assert not torch.allclose(changed, out["old_per_token_logps"] * out["completion_mask"], atol=1e-4)


@pytest.mark.parametrize("family", ["qwen3_vl", "internvl"])
def test_trained_tower_encodes_in_the_loss_pass(family, tiny_models, two_images, tmp_path):
    """A trainable tower never reuses in the loss pass (gradients must reach it); the old pass still reuses (same
    weights as the generation), and the reference model's tower (the checkpoint's) is not the policy's to reuse."""
    trainer, counter = build(family, tiny_models, two_images, tmp_path, "trained")
    out, _ = generation_batch(trainer, counter)
    assert counter.take() is not None  # counted above: generation, old pass (reused), reference pass (encodes)
    for micro in micro_batches(trainer, out):
        _, grads = loss_and_grads(trainer, micro, reuse_vision_features=True)
        calls, units = counter.take()
        assert trainer.last_vision_reuse == "the vision tower (or its projector) is trained"
        assert calls > 0 and units == len({id(f[0]) for f in micro[FEATURES_KEY]})  # each distinct image once
        assert any(trainer.vlm_module.is_vision_parameter(n) for n in grads)


def test_old_pass_reuses_and_reference_encodes_with_a_trained_tower(tiny_models, two_images, tmp_path):
    trainer, counter = build("qwen2_vl", tiny_models, two_images, tmp_path, "trained")
    ref_counter = TowerCounter(trainer.ref_model)
    passes = []
    real = trainer._get_per_token_logps_and_entropies

    def spy(model, *args, **kwargs):
        counter.take()
        result = real(model, *args, **kwargs)
        images = counter.take()[1] + ref_counter.take()[1]
        passes.append((model is trainer.ref_model, trainer.last_vision_reuse, images))
        return result

    trainer._get_per_token_logps_and_entropies = spy
    generation_batch(trainer, counter)
    assert passes == [(False, "reused", 0), (True, "the vision tower (or its projector) is trained", 2)]


def test_lora_in_the_tower_reuses_only_in_the_old_pass(tiny_models, two_images, tmp_path):
    """LoRA on the tower (``lora_include_vision``): the old pass has the generation's adapters and reuses; PEFT's
    reference pass (adapters off) and the loss pass encode."""
    trainer, counter = build(
        "qwen2_5_vl", tiny_models, two_images, tmp_path, "lora", trainer_kwargs_extra={"lora_include_vision": True}
    )
    assert any("lora" in n for n, _ in trainer.model.named_parameters() if trainer.vlm_module.is_vision_parameter(n))
    seen = []
    real = trainer._get_per_token_logps_and_entropies

    def spy(model, *args, **kwargs):
        counter.take()
        result = real(model, *args, **kwargs)
        seen.append((trainer.last_vision_reuse, counter.take()[1]))
        return result

    trainer._get_per_token_logps_and_entropies = spy
    out, _ = generation_batch(trainer, counter)
    assert seen == [("reused", 0), ("the tower's LoRA adapter is switched for the reference pass", 2)]
    seen.clear()
    loss_and_grads(trainer, micro_batches(trainer, out)[0], reuse_vision_features=True)
    assert seen == [("the vision tower (or its projector) is trained", 2)]


def test_off_switch_encodes_every_pass(tiny_models, two_images, tmp_path):
    trainer, counter = build("qwen2_5_vl", tiny_models, two_images, tmp_path, "frozen", reuse_vision_features=False)
    out, (calls, _) = generation_batch(trainer, counter)
    assert FEATURES_KEY not in out and trainer.last_vision_reuse == "turned off"
    assert calls == 3  # generation prefill, old pass, reference pass


def test_separate_reference_model_with_other_tower_weights_encodes(tiny_models, two_images, tmp_path):
    """A reference tower that is not provably the policy's (here: changed weights) never gets the kept features."""
    trainer, counter = build("qwen2_5_vl", tiny_models, two_images, tmp_path, "frozen")
    ref = peft_base(trainer.ref_model)
    with torch.no_grad():
        next(p for n, p in ref.named_parameters() if trainer.vlm_module.is_vision_parameter(n)).add_(0.01)
    seen = []
    real = trainer._get_per_token_logps_and_entropies

    def spy(model, *args, **kwargs):
        result = real(model, *args, **kwargs)
        seen.append(trainer.last_vision_reuse)
        return result

    trainer._get_per_token_logps_and_entropies = spy
    generation_batch(trainer, counter)
    assert seen == ["reused", "the reference model's tower is not provably the policy's"]


# A box valid in each family's frame: Qwen2.5-VL writes resized-image pixels (>= 56 here), the others 0-1000.
BOX = {"qwen2_5_vl": [4, 4, 44, 44], "qwen2_vl": [100, 100, 800, 800], "qwen3_vl": [100, 100, 800, 800]}
BOX["internvl"] = BOX["qwen2_vl"]


def script_tool_calls(trainer, family):
    """Every first turn ends in a ``zoom_in`` call, every other row's with a bad box (an error text, no image)."""
    calls = [
        {"name": "zoom_in", "arguments": {"bbox_2d": BOX[family], "image_index": 0}},
        {"name": "zoom_in", "arguments": {"bbox_2d": [50, 50, 10, 10]}},
    ]
    texts = [f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>" for call in calls]
    real = trainer._generate_single_turn

    def scripted(prompt_ids, images, fields, num_generations, has_tool_images=False):
        if num_generations == 1:
            return real(prompt_ids, images, fields, num_generations, has_tool_images)
        config = trainer.generation_config
        budget, config.max_new_tokens = config.max_new_tokens, 3  # a few own tokens, then the call
        try:
            ids, _ = real(prompt_ids, images, fields, num_generations, has_tool_images)
        finally:
            config.max_new_tokens = budget
        eos = set(trainer.eos_token_ids)
        tok = trainer._tokenizer
        calls = [tok.encode(texts[i % 2], add_special_tokens=False) for i in range(len(ids))]
        return [[t for t in own if t not in eos] + call for own, call in zip(ids, calls, strict=True)], None

    trainer._generate_single_turn = scripted


@pytest.mark.parametrize(
    ("family", "held"), [*((f, True) for f in FAMILIES), ("qwen2_5_vl", False), ("internvl", False)]
)
def test_tool_images_are_encoded_once_and_reused(family, held, tiny_models, two_images, tmp_path, monkeypatch):
    """Tool rows: the tool turn's prefill encodes each tool image once (``held``: continuing each rollout's held
    cache; else prefilling whole histories); the old, reference and loss passes take the kept features of prompt and
    tool images, at parity with the passes that encode them."""
    if not held:
        monkeypatch.setattr("vlm_grpo.trainer.continue_turns", lambda *args: None)
    trainer, counter = build(
        family, tiny_models, two_images, tmp_path, "lora", max_completion_length=400, max_tool_calling_iterations=2,
        tools=["zoom_in"],
    )  # fmt: skip
    trainer.generation_config.max_new_tokens = 8
    script_tool_calls(trainer, family)
    out, (_, generation_units) = generation_batch(trainer, counter, ragged=False)  # rollouts differ in length
    assert out["completion_mask"].sum(1).unique().numel() > 1
    tool_rows = [f for f in out[FEATURES_KEY] if f is not None and len(f) > 1]
    assert len(tool_rows) == G  # every other rollout's call returned an image (3 of 6)
    if held:
        assert trainer.last_turn_stats.images_encoded == G
        assert generation_units == 2 + G  # the prompts' images once each, each tool image once; nothing more
    assert trainer.last_vision_reuse == "reused"
    ref = pass_logps(trainer, out)
    assert counter.take()[0] > 0
    torch.testing.assert_close(out["old_per_token_logps"] * out["completion_mask"], ref, rtol=0, atol=1e-5)
    for micro in micro_batches(trainer, out):
        loss, grads = loss_and_grads(trainer, micro, reuse_vision_features=True)
        assert (trainer.last_vision_reuse, counter.take()) == ("reused", (0, 0))
        ref_loss, ref_grads = loss_and_grads(trainer, micro, reuse_vision_features=False)
        assert counter.take()[0] > 0
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        assert_grads_close(grads, ref_grads)
