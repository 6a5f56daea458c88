"""The MoE router's load-balancing loss is in the training loss as TRL 1.16 puts it there.

TRL's ``GRPOTrainer`` turns it on when the text config has ``output_router_logits`` and a non-zero
``router_aux_loss_coef`` (the config's, or ``--router_aux_loss_coef``): its log-prob pass asks the model for
``aux_loss`` and ``compute_loss`` adds ``coef * aux_loss`` (divided by the gradient accumulation steps in training).
The packed pass cannot give every row's router logits, so it steps aside for that pass
(``fastpath.sharing.packed_pass_reason``). On one real batch of each tiny MoE build (Qwen3-VL-MoE, GLM-4.5V), the
loss equals TRL's own, and it differs from the loss without the router term by exactly ``coef * aux_loss``.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
from trl import GRPOTrainer

import vlm_grpo.utils
from test_group_sharing import MM_KEYS, make_trainer, real_batch, rows_file  # noqa: F401
from vlm_grpo.fastpath import route
from vlm_grpo.trainer import rows_forward_kwargs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COEF = {"qwen3_vl_moe": 1e-3, "glm4v_moe": 1e-4}  # the real checkpoints' config.json values


@pytest.fixture(autouse=True)
def fresh_log_once(monkeypatch):
    monkeypatch.setattr(vlm_grpo.utils, "_warned", set())
    monkeypatch.setattr(route, "_logged", set())


def loss_and_aux(trainer, inputs) -> tuple[float, float | None]:
    aux = trainer._metrics["train"]["aux_loss"]
    before = len(aux)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, inputs).item()
    return loss, (aux[-1] if len(aux) > before else None)


@pytest.mark.parametrize("family", ["qwen3_vl_moe", "glm4v_moe"])
def test_the_loss_holds_trls_router_term(family, tiny_models, rows_file, tmp_path, monkeypatch, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="vlm_grpo")
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == pytest.approx(COEF[family])
    inputs = real_batch(trainer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # the training divisor, as the Trainer sets it for a step
    ours, aux = loss_and_aux(trainer, inputs)
    assert aux is not None and aux > 0
    assert caplog.text.count("router's auxiliary loss") == 1  # the packed pass stepped aside, and said so
    with monkeypatch.context() as mp:  # TRL's own log-prob pass (and the family inputs it leaves out)
        mp.setattr(trainer, "_get_per_token_logps_and_entropies",
                   types.MethodType(GRPOTrainer._get_per_token_logps_and_entropies, trainer))  # fmt: skip
        with rows_forward_kwargs(trainer.model, trainer.vlm_module, {k: inputs.get(k) for k in MM_KEYS}):
            trl, trl_aux = loss_and_aux(trainer, inputs)
    assert ours == pytest.approx(trl, abs=1e-6) and aux == pytest.approx(trl_aux, rel=1e-6)
    # The control: without the router term the loss is smaller by coef * aux / accumulation steps.
    trainer.aux_loss_enabled = False
    policy, no_aux = loss_and_aux(trainer, inputs)
    assert no_aux is None
    assert ours - policy == pytest.approx(COEF[family] * aux / 2, rel=1e-3)
