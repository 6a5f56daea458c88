"""What a long run must not pile up from one step to the next."""

from __future__ import annotations

import pytest
import torch

import test_group_sharing
from test_group_sharing import make_trainer

rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_long_runs_do_not_pile_up_input_embedding_hooks(lora, tiny_models, rows_file, tmp_path, monkeypatch):
    """TRL toggles gradient checkpointing around every generation and transformers adds an input-embedding hook
    each time it comes back on, without removing the last one: the trainer keeps one, so a long run does not call
    thousands per embedding call. A user's own hook on the embeddings stays. Control: without the clean-up, 4 steps
    leave 9 hooks."""
    import vlm_grpo.trainer as trainer_module

    def train(**patch):
        for name, value in patch.items():
            monkeypatch.setattr(trainer_module, name, value)
        trainer = make_trainer(
            tiny_models["qwen2_5_vl"], rows_file, tmp_path / f"run{len(patch)}", lora=lora, gradient_checkpointing=True,
            max_steps=4, learning_rate=1e-2, logging_steps=1,
        )  # fmt: skip
        embed = trainer.model.get_input_embeddings()
        mine = embed.register_forward_hook(lambda module, args, output: None)  # a user's: must survive
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        after = dict(trainer.model.named_parameters())
        assert any(not torch.equal(before[n], after[n]) for n in before), "nothing trained"
        assert mine.id in embed._forward_hooks
        return len(embed._forward_hooks) - 1

    assert train() == 1  # the hook transformers holds, once
    assert train(drop_stacked_input_grad_hooks=lambda model: 0) > 4  # the control: two more every step
