"""The speed path at TRL's numbers where it is easiest to get wrong: positions in decoding, and images in grouping.

The models here are the tiny ones with a sharper language model (``init_std=0.15``): with the default init
(0.02), attention is nearly uniform and a decode position off by one moved the logits by ~3e-3 without changing a
single sampled token, so token equality could not see it. Each test compares the log-softmax of every decode step (the
distribution every generated token was drawn from) with ``generate``'s at 1e-5, and each has a negative control
that breaks the speed path on purpose and must fail.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from trl import GRPOTrainer

import vlm_grpo.fastpath.sharing as sharing
from test_group_sharing import (
    G,
    assert_parity,
    make_trainer,
    real_batch,
    rows_file,  # noqa: F401  (a fixture)
)
from vlm_grpo.data.deferred import decode_pending
from vlm_grpo.testing.tiny import FAMILIES, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5
INIT_STD = 0.15  # log-prob rounding gaps <= 5e-6; a decode position off by one moves them by ~6


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory):
    return sharp_model_getter(tmp_path_factory.mktemp("sharp"))


def sharp_model_getter(root):
    """``get(family)``: a tiny checkpoint with larger weights (greedy tokens that depend on the input), built under
    ``root`` on first use."""
    built: dict[str, object] = {}

    def get(family):
        if family not in built:
            built[family] = build_tiny_model(family, root / family, seed=0, init_std=INIT_STD)
        return built[family]

    return get


def _tokenized_batch(trainer):
    from trl.data_utils import prepare_multimodal_messages

    batch = decode_pending(next(iter(trainer.get_train_dataloader())), trainer._pending_transform)
    prompts = [prepare_multimodal_messages(x["prompt"], images=x["images"]) for x in batch]
    return trainer._tokenize_prompts(prompts)


def _decode_logps(trainer, generate, batch, seed):
    """(completion ids, log-softmax of each decode step ``(rows, steps, vocab)``) from one generation call.

    The LM head's outputs are recorded: calls over all rows are decode steps (the shared prefill runs over the
    unique prompts only), and a step's distribution is the head's output at the last position.
    """
    prompt_ids, images, fields = batch
    head = trainer.model.get_output_embeddings()
    outputs = []
    hook = head.register_forward_hook(lambda module, args, out: outputs.append(out.detach()))
    try:
        torch.manual_seed(seed)
        completions, _ = generate(prompt_ids, images, fields, G)
    finally:
        hook.remove()
    rows = len(prompt_ids)
    steps = [o.reshape(o.size(0), -1, o.size(-1))[:, -1] for o in outputs if o.size(0) == rows]
    width = max(len(c) for c in completions)
    return completions, torch.log_softmax(torch.stack(steps[:width], dim=1).float(), dim=-1)


def generation_gap(trainer, seed=0) -> tuple[bool, float]:
    """(same tokens, max |log-prob difference| over every generated step) between ours and TRL's generate."""
    batch = _tokenized_batch(trainer)
    ours, ours_logps = _decode_logps(trainer, trainer._generate_single_turn, batch, seed)
    plain, plain_logps = _decode_logps(trainer, lambda *a: GRPOTrainer._generate_single_turn(trainer, *a), batch, seed)
    if ours_logps.shape != plain_logps.shape:
        return ours == plain, float("inf")
    return ours == plain, float((ours_logps - plain_logps).abs().max())


def _full_length(trainer) -> None:
    config = trainer.generation_config
    config.min_new_tokens = config.max_new_tokens  # every row decodes every step: all steps compared


# ----------------------------------------------------------------------------- decode positions
@pytest.mark.parametrize("fast", [True, False], ids=["fast_decode", "generate"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generated_log_probs_match_generate(family, fast, sharp_models, rows_file, tmp_path):  # noqa: F811
    trainer = make_trainer(sharp_models(family), rows_file, tmp_path, fast_decode=fast)
    _full_length(trainer)
    same_tokens, gap = generation_gap(trainer)
    assert same_tokens and gap <= TOL, gap


@pytest.mark.parametrize("family", FAMILIES)
def test_the_parity_test_catches_a_decode_position_off_by_one(family, sharp_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    """Negative control: the decode steps' (m)rope position shifted by one must fail, by a wide margin."""
    trainer = make_trainer(sharp_models(family), rows_file, tmp_path)
    _full_length(trainer)
    real = sharing._next_positions
    monkeypatch.setattr(sharing, "_next_positions", lambda *a: None if real(*a) is None else real(*a) + 1)
    _, gap = generation_gap(trainer)
    assert gap > 1000 * TOL, gap  # the shift moves log-probs by far more than the tolerance


# ----------------------------------------------------------------------------- images in grouping
@pytest.fixture(scope="module")
def look_alike_rows(tmp_path_factory):
    """Same question with different images, and the same image with another question (same-size images, so the
    prompts of the first pair are the same tokens)."""
    root = tmp_path_factory.mktemp("look_alike")
    rng = np.random.default_rng(0)
    for name in ("p.png", "q.png"):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / name)

    def row(image, question):
        return {"image": image, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "1"}]}

    rows = [
        row("p.png", "<image>What colour is the large shape?"),
        row("q.png", "<image>What colour is the large shape?"),
        row("p.png", "<image>How many squares?"),
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _by_prompt_tokens_alone(real):
    def plan(prompt_ids, prompt_mask, pixel_values, num_images, units, *split):
        return real(prompt_ids, prompt_mask, None, num_images, units, *split)  # the pixels are never compared

    return plan


def _by_pixels_alone(real):
    def plan(prompt_ids, prompt_mask, pixel_values, num_images, units, *split):
        merged = []
        for group in real(prompt_ids, prompt_mask, pixel_values, num_images, units, *split):
            same = next(
                (m for m in merged if m.image_rows and group.image_rows
                 and torch.equal(pixel_values[slice(*m.image_rows)], pixel_values[slice(*group.image_rows)])),
                None,
            )  # fmt: skip
            if same is None:
                merged.append(group)
            else:
                same.rows.extend(group.rows)
                same.tool_rows.extend(group.tool_rows)
                same.tool_ranges.extend(group.tool_ranges)
        return merged

    return plan


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_that_differ_only_in_image_or_only_in_question_are_not_shared(family, sharp_models, look_alike_rows,
                                                                           tmp_path, monkeypatch):  # fmt: skip
    trainer = make_trainer(sharp_models(family), look_alike_rows, tmp_path, per_device_train_batch_size=3 * G)
    _full_length(trainer)
    inputs = real_batch(trainer)
    prompts = inputs["prompt_ids"].masked_fill(inputs["prompt_mask"] == 0, -1)
    assert len({tuple(p.tolist()) for p in prompts}) == 2, "two rows of different images share their tokens"
    groups = sharing.plan_groups(
        inputs["prompt_ids"], inputs["prompt_mask"], inputs["pixel_values"], inputs["num_images"],
        trainer.vlm_module.units_per_sample(inputs),
    )  # fmt: skip
    assert sorted(len(g.rows) for g in groups) == [G, G, G]
    assert_parity(trainer, inputs)
    same_tokens, gap = generation_gap(trainer)
    assert same_tokens and gap <= TOL, gap

    # Negative controls: grouping that ignores the pixels, or the question, must fail both comparisons.
    real = sharing.plan_groups
    for mutation in (_by_prompt_tokens_alone, _by_pixels_alone):
        monkeypatch.setattr(sharing, "plan_groups", mutation(real))
        with pytest.raises(AssertionError):
            assert_parity(trainer, inputs)
        _, gap = generation_gap(trainer)
        assert gap > 1000 * TOL, (mutation.__name__, gap)
        monkeypatch.setattr(sharing, "plan_groups", real)
