"""The packed log-prob pass on multi-turn tool rollouts: parity with TRL's per-row pass, every family.

Batches come from TRL's own tool loop (``_generate_and_score_completions``) with scripted turns: per group, rows
that answer at once, rows that call ``zoom_in`` once (a tool image in their completion) or twice, and a row whose
call fails (an error text, no image). So rows differ in turns and in images, and completions hold tool
observations with image tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from trl import GRPOTrainer

from test_group_sharing import G, MM_KEYS, assert_parity, make_trainer, rows_file  # noqa: F401
import vlm_grpo.fastpath.sharing as sharing
from vlm_grpo.testing.tiny import FAMILIES
from vlm_grpo.trainer import VLMGRPOTrainer

BOX = {"qwen2_5_vl": [4, 4, 40, 40], "qwen2_vl": [100, 100, 800, 800], "qwen3_vl": [100, 100, 800, 800]}
BOX["internvl"] = BOX["qwen2_vl"]
ANSWER = "<answer>1</answer><|im_end|>"


def _turn(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def scripted_turns(family):
    """``_generate_single_turn`` of a scripted policy: first turn by row (zoom, answer, bad call, zoom ...); in
    the next round every other rollout zooms again, the rest answer."""
    good = {"name": "zoom_in", "arguments": {"bbox_2d": BOX[family], "image_index": 0}}
    bad = {"name": "zoom_in", "arguments": {"bbox_2d": [50, 50, 10, 10]}}
    call = "<tool_call>\n{}\n</tool_call><|im_end|>"
    firsts = [call.format(json.dumps(good)), ANSWER, call.format(json.dumps(bad))]
    rounds = {"n": 0}

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations > 1:
            rounds["n"] = 0
            return [_turn(self._tokenizer, firsts[i % 3]) for i in range(len(prompt_ids))], None
        rounds["n"] += 1
        again = call.format(json.dumps(good)) if rounds["n"] == 1 else ANSWER
        return [_turn(self._tokenizer, again if i % 2 == 0 else ANSWER) for i in range(len(prompt_ids))], None

    return scripted


def tool_trainer(family, tiny_models, rows_file, tmp_path, **overrides):  # noqa: F811
    return make_trainer(
        tiny_models[family], rows_file, tmp_path, max_completion_length=600, max_tool_calling_iterations=3,
        trainer_kwargs={"tools": ["zoom_in"], "tool_kwargs": {"zoom_in": {"size": 56}}}, **overrides,
    )  # fmt: skip


def tool_batch(trainer, family, monkeypatch):
    trainer.model.eval()
    monkeypatch.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted_turns(family))
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._generate_and_score_completions(batch)


def describe(batch, trainer):
    """Turns (assistant runs) and completion images per row: the batch must mix both."""
    pad = trainer._tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>" if "pixel_values" in batch and
                                                   batch["pixel_values"].ndim == 4 else "<|image_pad|>")  # fmt: skip
    mask = batch["tool_mask"] * batch["completion_mask"]
    turns = [int((m[1:] > m[:-1]).sum() + m[0]) for m in mask]
    images = (batch["completion_ids"] == pad).any(-1)
    return turns, images


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_pass_matches_trl_on_multi_turn_rows(family, tiny_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    trainer = tool_trainer(family, tiny_models, rows_file, tmp_path)
    assert trainer.args.share_prompt
    batch = tool_batch(trainer, family, monkeypatch)
    turns, images = describe(batch, trainer)
    print(turns, images, batch["num_images"])
    packed = []
    real = sharing._packed_forward
    monkeypatch.setattr(sharing, "_packed_forward", lambda *a: packed.append(len(a[5])) or real(*a))
    assert_parity(trainer, batch)
    assert packed == [2]  # one packed forward over both groups
