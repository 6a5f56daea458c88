"""Advantage estimators other than GRPO's, as EasyR1 / verl define them (``--advantage_estimator``).

* ``grpo`` (TRL's own): ``(r - mean of the group) / (std of the group)``, as ``scale_rewards`` says.
* ``rloo`` (RLOO, Ahmadian et al. 2024): ``r_i - mean of the other G - 1 rewards of the group`` (leave-one-out
  baseline), not scaled.
* ``reinforce_plus_plus`` (REINFORCE++, Hu 2025): no group baseline; the return of every completion token (the
  outcome reward: discount 1, no KL term in the reward) whitened over all completion tokens of the generation
  batch, across processes: ``(r - mean) / sqrt(var + 1e-8)`` with the token-weighted mean and the unbiased
  token-weighted variance (verl's ``masked_whiten``). A long completion weighs more in the mean.

GAE needs a value model (a critic), which GRPO-style training does not have: refused.

The estimator replaces the advantages of TRL's ``_generate_and_score_completions`` output from the rewards TRL
gathered (``_calculate_rewards``), so every generation path (TRL's, the shared-prefill speed path) and every loss
sees the same numbers. Completions no reward scored (all ``None``) get advantage 0 and stay out of baselines and
statistics, as TRL does for GRPO.
"""

from __future__ import annotations

from typing import Any

import torch

from vlm_grpo.fastpath.contract import PrivateName

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
REFUSED = {
    "gae": "GAE needs a value model (a critic) trained alongside the policy, which this trainer does not have; "
    "use grpo, rloo or reinforce_plus_plus",
    "remax": "ReMax (a greedy-rollout baseline) is not available; use rloo (a baseline from the other samples of "
    "the group) or grpo",
}

PRIVATE_NAMES = (
    PrivateName("trl:GRPOTrainer", "_generate_and_score_completions", ("inputs",), why="replacing advantages"),
    PrivateName(
        "trl:GRPOTrainer",
        "_calculate_rewards",
        ("inputs", "prompts", "completions", "completion_ids_list"),
        why="the gathered rewards the estimators read",
    ),
)


def check_estimator(name: str) -> None:
    """``ValueError`` for an estimator this trainer cannot run, saying why and what to use."""
    if name in REFUSED:
        raise ValueError(f"advantage_estimator {name}: {REFUSED[name]}")
    if name not in ESTIMATORS:
        raise ValueError(f"advantage_estimator {name}: unknown; use one of {', '.join(ESTIMATORS)}")


def rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``r_i - mean_{j != i} r_j`` within each group of ``num_generations`` consecutive rows; NaN rewards (unscored)
    are left out of the other rows' baselines and get 0. A row with no scored partner gets 0."""
    grouped = rewards.view(-1, num_generations)
    scored = ~torch.isnan(grouped)
    values = torch.where(scored, grouped, torch.zeros_like(grouped))
    total, count = values.sum(dim=1, keepdim=True), scored.sum(dim=1, keepdim=True)
    others = (count - scored.long()).clamp(min=1)
    baseline = (total - values) / others
    advantages = torch.where(scored & (count > 1), grouped - baseline, torch.zeros_like(grouped))
    return advantages.reshape(-1)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, lengths: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Each row's reward whitened over the batch's completion tokens (``lengths`` tokens per row), as verl's
    ``masked_whiten`` of the per-token returns: token-weighted mean, unbiased token-weighted variance."""
    scored = ~torch.isnan(rewards)
    weights = torch.where(scored, lengths.to(rewards.dtype), torch.zeros_like(rewards))
    values = torch.where(scored, rewards, torch.zeros_like(rewards))
    tokens = weights.sum()
    if tokens <= 1:
        return torch.zeros_like(rewards)
    mean = (weights * values).sum() / tokens
    var = (weights * (values - mean) ** 2).sum() / tokens * (tokens / (tokens - 1))
    return torch.where(scored, (values - mean) * torch.rsqrt(var + eps), torch.zeros_like(rewards))


class AdvantageEstimatorMixin:
    """Replaces GRPO's advantages with ``args.advantage_estimator``'s (a ``GRPOTrainer`` subclass mixin).

    Also keeps the rewards TRL gathered for the latest generation batch as ``_gathered_rewards`` (``[rows of all
    processes, reward functions]``), which dynamic sampling reads too.
    """

    _gathered_rewards: torch.Tensor | None = None

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._gathered_rewards = rewards
        return rewards

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        estimator = self.args.advantage_estimator
        if estimator == "grpo" or not self.model.training:
            return output
        rewards = self._gathered_rewards
        weighted = (rewards * self.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards).all(dim=1)] = torch.nan
        rows = output["completion_ids"].size(0)
        start = self.accelerator.process_index * rows
        if estimator == "rloo":
            advantages = rloo_advantages(weighted, self.num_generations)
        else:
            mask = output["completion_mask"]
            if output.get("tool_mask") is not None:
                mask = mask * output["tool_mask"]
            lengths = self.accelerator.gather(mask.sum(dim=1).to(weighted.device)).to(weighted.dtype)
            advantages = reinforce_plus_plus_advantages(weighted, lengths)
        output["advantages"] = advantages[start : start + rows].to(output["advantages"].device)
        return output
