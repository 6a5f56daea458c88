"""The private TRL / transformers / torch names the speed path relies on exist in the installed versions."""

from __future__ import annotations

import pytest
import transformers
import trl

from vlm_grpo.fastpath import contract


@pytest.mark.parametrize("entry", contract.PRIVATE_NAMES, ids=lambda e: f"{e.owner}.{e.name}")
def test_private_name_still_exists(entry: contract.PrivateName) -> None:
    assert contract.check(entry) is None, contract.check(entry)


def test_every_overridden_trl_hook_is_listed() -> None:
    """A private GRPOTrainer / SFTTrainer method that our trainers or their mixins override must be listed."""
    from vlm_grpo.sft_trainer import VLMSFTTrainer
    from vlm_grpo.trainer import VLMGRPOTrainer

    overridden = {
        name
        for ours, theirs in ((VLMGRPOTrainer, trl.GRPOTrainer), (VLMSFTTrainer, trl.SFTTrainer))
        for cls in ours.__mro__
        if cls.__module__.startswith("vlm_grpo")
        for name in vars(cls)
        if name.startswith("_") and not name.startswith("__") and hasattr(theirs, name)
    }
    listed = {e.name for e in contract.PRIVATE_NAMES if e.owner in ("trl:GRPOTrainer", "transformers:Trainer")}
    assert overridden <= listed, f"not in fastpath.contract.PRIVATE_NAMES: {sorted(overridden - listed)}"


def test_a_removed_hook_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: drop one hook from TRL and the check names it."""
    monkeypatch.delattr(trl.GRPOTrainer, "_generate_single_turn")
    assert contract.missing() == ["trl.GRPOTrainer._generate_single_turn: missing"]


def test_a_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def renamed(self, prompts_ids, images, multimodal_fields, num_generations):  # 'prompt_ids' renamed
        raise AssertionError

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_single_turn", renamed)
    problems = contract.missing()
    assert problems == ["trl.GRPOTrainer._generate_single_turn: signature changed, no parameter(s) prompt_ids"]


def test_a_runtime_attribute_no_longer_set_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def prepare(self, generation_config, kwargs_has_attention_mask=None, device=None):
        """Sets nothing we read."""

    monkeypatch.setattr(transformers.generation.utils.GenerationMixin, "_prepare_special_tokens", prepare)
    problems = contract.missing()
    assert any("_pad_token_tensor" in p for p in problems), problems
    assert any("_eos_token_tensor" in p for p in problems), problems
