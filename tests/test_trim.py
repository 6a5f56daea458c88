"""trim_completion_padding: a micro-batch cut to its own longest completion trains exactly as the padded one."""

from __future__ import annotations

import logging

import pytest
import torch
from trl import GRPOTrainer

import vlm_grpo.fastpath.trim as trim
from test_group_sharing import make_trainer, real_batch, rows_file  # noqa: F401  (rows_file: a fixture)
from vlm_grpo.fastpath.trim import trim_completion_padding
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _batch(lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return {
        "prompt_ids": torch.ones(len(lengths), width, dtype=torch.long),  # a prompt as wide as the completions
        "completion_ids": torch.arange(len(lengths) * width).reshape(len(lengths), width) * mask,
        "completion_mask": mask,
        "old_per_token_logps": -torch.rand(len(lengths), width),
        "advantages": torch.randn(len(lengths)),
    }


def test_the_cut_keeps_the_last_column_any_row_uses():
    batch = _batch([3, 5, 2], width=9)
    out = trim_completion_padding(batch)
    assert out["completion_ids"].shape == out["completion_mask"].shape == out["old_per_token_logps"].shape == (3, 5)
    assert torch.equal(out["completion_ids"], batch["completion_ids"][:, :5])
    assert out["prompt_ids"] is batch["prompt_ids"] and out["advantages"] is batch["advantages"]
    whole = trim_completion_padding({**batch, "mm_token_type_ids": torch.ones(3, 9 + 9)})  # prompt + completion
    assert whole["mm_token_type_ids"].shape == (3, 9 + 5)
    assert trim_completion_padding(_batch([3, 8, 2], width=9))["completion_mask"].size(1) == 8  # one under the width
    full = _batch([3, 9, 2], width=9)
    assert trim_completion_padding(full) is full  # a row uses the last column: nothing to cut


def test_an_unknown_tensor_of_the_completions_width_keeps_the_batch_whole(caplog):
    batch = {**_batch([3, 5, 2], width=9), "my_per_token_weights": torch.ones(3, 9)}
    with caplog.at_level(logging.INFO, logger=trim.__name__):
        assert trim_completion_padding(batch) is batch
        sequence = {**_batch([3, 5, 2], width=9), "my_positions": torch.ones(3, 18)}  # over prompt + completion
        assert trim_completion_padding(sequence) is sequence
    assert "my_per_token_weights has the completions' width" in caplog.text and "my_positions has" in caplog.text


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("share_prompt", [True, False])
def test_a_cut_micro_batch_has_the_padded_ones_loss_and_gradients(share_prompt, tiny_models, rows_file, tmp_path):  # noqa: F811
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, share_prompt=share_prompt, beta=0.1)
    inputs = real_batch(trainer)
    width = inputs["completion_ids"].size(1)
    inputs["completion_mask"][:, width - 2 :] = 0  # no row uses the last two columns: a micro-batch of short rows
    inputs["ref_per_token_logps"] = inputs.get("old_per_token_logps", torch.zeros(inputs["completion_mask"].shape))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    padded, padded_grads = _loss_and_grads(trainer, inputs)
    cut = trim_completion_padding(inputs)
    assert cut["completion_ids"].size(1) == width - 2
    ours, our_grads = _loss_and_grads(trainer, cut)
    torch.testing.assert_close(ours, padded, rtol=1e-5, atol=1e-6)
    for name, g in padded_grads.items():
        assert (our_grads[name] - g).norm() <= 1e-5 * g.norm().clamp_min(1e-12), name

    # Negative control: a cut one column too far drops a real token, and the loss moves.
    one_more = {k: v[:, :-1] if v is not inputs[k] else v for k, v in cut.items()}  # every cut tensor, one column more
    assert one_more["completion_ids"].size(1) == width - 3 and one_more["completion_mask"][:, -1].any()
    wrong, _ = _loss_and_grads(trainer, one_more)
    assert not torch.allclose(wrong, padded, rtol=1e-5, atol=1e-6)


def test_the_trainer_cuts_the_micro_batches_trl_prepares(tiny_models, rows_file, tmp_path, monkeypatch):  # noqa: F811
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    monkeypatch.setattr(GRPOTrainer, "_prepare_inputs", lambda self, batch: _batch([3, 5, 2], width=9))
    assert VLMGRPOTrainer._prepare_inputs(trainer, None)["completion_mask"].size(1) == 5
    trainer.args.trim_completion_padding = False
    assert VLMGRPOTrainer._prepare_inputs(trainer, None)["completion_mask"].size(1) == 9
