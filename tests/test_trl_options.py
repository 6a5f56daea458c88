"""TRL's GRPO options through ``VLMGRPOTrainer`` with the speed features on (the defaults).

Each test trains 2 steps in-process on a tiny Qwen2.5-VL and asserts what TRL's own tests assert for that option
(a loss was logged, parameters changed, the option's metrics are there) plus that the option visibly acted (the
completions it allows, the path generation took). The loss variants also match TRL's per-row path step by step.
"""

from __future__ import annotations

import pytest
import torch

from test_group_sharing import G, make_trainer, rows_file  # noqa: F401  (rows_file is a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLAIN = {"share_prompt": False, "share_prefill": False, "fast_decode": False}
FAMILY = "qwen2_5_vl"


class Recorder:
    """A reward that depends on the text (so gradients are not zero) and remembers what it was shown."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, completions, completion_ids, prompts, **kwargs):
        self.calls.append({"completion_ids": [list(c) for c in completion_ids]})
        return [
            float(len(str(c)) % 3) + 0.1 * (sum(ids[:1]) % 7)
            for c, ids in zip(completions, completion_ids, strict=True)
        ]

    @property
    def completions(self) -> list[list[int]]:
        return [c for call in self.calls for c in call["completion_ids"]]


def _ragged(trainer) -> None:
    """Many end tokens: random tiny models would otherwise fill every completion to the limit, and loss types
    that differ only in how they normalise by length would give the same numbers."""
    eos = sorted({trainer._tokenizer.eos_token_id, *range(200, 520)})
    trainer.generation_config.eos_token_id = eos
    trainer.eos_token_ids = eos


def train(tiny_models, rows_file, tmp_path, reward=None, ragged=True, trainer_kwargs=None, **overrides):  # noqa: F811
    reward = reward or Recorder()
    args = {"max_steps": 2, "learning_rate": 0.1, "logging_steps": 1, "max_completion_length": 8, **overrides}
    trainer = make_trainer(
        tiny_models[FAMILY], rows_file, tmp_path, reward_funcs=[reward], trainer_kwargs=trainer_kwargs, **args
    )
    if ragged:
        _ragged(trainer)
    trainer.recorder = reward
    trainer.before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer


def assert_trl_checks(trainer) -> None:
    """What TRL's tests assert after training: a loss, and changed parameters (the language model's here)."""
    assert trainer.state.log_history[-1]["train_loss"] is not None
    changed = {n: not torch.equal(p, trainer.model.get_parameter(n)) for n, p in trainer.before.items()}
    text = {n: c for n, c in changed.items() if ".language_model." in n}
    assert text and all(text.values()), [n for n, c in text.items() if not c]


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "grad_norm" in entry]


# ----------------------------------------------------------------------------- loss variants (issue 15 item 7)
LOSS_VARIANTS = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "cispo": {"loss_type": "cispo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}
# Two iterations per generation: the second step is off-policy, so ratios, clipping and the sequence-level
# weights of each variant enter the loss (on-policy every ratio is 1).
OFF_POLICY = {"num_iterations": 2, "epsilon": 0.05}


@pytest.fixture(scope="module")
def grpo_fast_losses(tiny_models, rows_file, tmp_path_factory):  # noqa: F811
    trainer = train(tiny_models, rows_file, tmp_path_factory.mktemp("grpo"), **OFF_POLICY, loss_type="grpo")
    return [e[k] for e in step_logs(trainer) for k in ("loss", "grad_norm")]


@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_loss_variant_matches_the_per_row_path(variant, tiny_models, rows_file, tmp_path, grpo_fast_losses):  # noqa: F811
    options = {**OFF_POLICY, **LOSS_VARIANTS[variant]}
    fast = train(tiny_models, rows_file, tmp_path / "fast", **options)
    plain = train(tiny_models, rows_file, tmp_path / "plain", **options, **PLAIN)
    assert_trl_checks(fast)
    fast_logs, plain_logs = step_logs(fast), step_logs(plain)
    assert len(fast_logs) == 2
    assert fast.recorder.completions == plain.recorder.completions  # the same samples on both paths
    assert len({len(c) for c in fast.recorder.completions}) > 1, "completions should differ in length"
    for ours, theirs in zip(fast_logs, plain_logs, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours, theirs)
    assert all(e["grad_norm"] > 0 for e in fast_logs)
    if variant != "grpo":  # the option acted: the numbers are not plain GRPO's (TRL's default loss_type is dapo)
        ours = [e[k] for e in fast_logs for k in ("loss", "grad_norm")]
        assert ours != pytest.approx(grpo_fast_losses, rel=1e-4), (variant, ours, grpo_fast_losses)
