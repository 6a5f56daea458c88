"""Advantage estimators other than GRPO's, as EasyR1 / verl define them (``--advantage_estimator``).

* ``grpo`` (TRL's own): ``(r - mean of the group) / (std of the group)``, as ``scale_rewards`` says.
* ``rloo`` (RLOO, Ahmadian et al. 2024): ``r_i - mean of the other G - 1 rewards of the group`` (leave-one-out
  baseline), not scaled.
* ``remax`` (ReMax, Li et al. 2023): ``r_i - r(greedy completion of the prompt)``, not scaled. Each prompt's
  greedy completion is generated once per generation batch through the same generation path as the samples
  (shared prefill / fast decode, or TRL's) with sampling off, and scored by the same rewards; its metrics, token
  counts and log columns are not logged. Needs whole groups per process (``per_device_train_batch_size x
  steps_per_generation`` a multiple of ``num_generations``) and generation in the training process (not vLLM).
* ``reinforce_plus_plus`` (REINFORCE++, Hu 2025): no group baseline; the return of every completion token (the
  outcome reward: discount 1, no KL term in the reward) whitened over all completion tokens of the generation
  batch, across processes: ``(r - mean) / sqrt(var + 1e-8)`` with the token-weighted mean and the unbiased
  token-weighted variance (verl's ``masked_whiten``). A long completion weighs more in the mean.

GAE needs a value model (a critic), which GRPO-style training does not have: refused.

EasyR1 / verl compute these from the same outcome rewards (``core_algos.py``: ``compute_rloo_outcome_advantage``,
``compute_remax_outcome_advantage``, ``compute_reinforce_plus_plus_outcome_advantage`` with ``gamma`` 1 and
``masked_whiten``); their KL-in-the-reward variant is not offered (KL is TRL's loss term, ``beta``).

The estimator replaces the advantages of TRL's ``_generate_and_score_completions`` output from the rewards TRL
gathered (``_calculate_rewards``), so every generation path (TRL's, the shared-prefill speed path) and every loss
sees the same numbers. Completions no reward scored (all ``None``) get advantage 0 and stay out of baselines and
statistics, as TRL does for GRPO.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

from vlm_grpo.fastpath.contract import PrivateName

ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "remax")
REFUSED = {
    "gae": "GAE needs a value model (a critic) trained alongside the policy, which this trainer does not have; "
    "use grpo, rloo, reinforce_plus_plus or remax",
}

PRIVATE_NAMES = (
    PrivateName("trl:GRPOTrainer", "_generate_and_score_completions", ("inputs",), why="replacing advantages"),
    PrivateName(
        "trl:GRPOTrainer",
        "_calculate_rewards",
        ("inputs", "prompts", "completions", "completion_ids_list"),
        why="the gathered rewards the estimators read; ReMax scores its greedy completions with it",
    ),
    PrivateName("trl:GRPOTrainer", "_generate", ("prompts",), why="ReMax's greedy completions"),
    PrivateName("trl:GRPOTrainer", "_metrics", source="trl:GRPOTrainer.__init__", why="kept clean of ReMax's pass"),
    PrivateName("trl:GRPOTrainer", "_pending_metrics", source="trl:GRPOTrainer.__init__", why="the same"),
    PrivateName("trl:GRPOTrainer", "_pending_extra_logs", source="trl:GRPOTrainer.__init__", why="the same"),
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


def remax_advantages(rewards: torch.Tensor, baselines: torch.Tensor) -> torch.Tensor:
    """``r_i - b_i``, ``b_i`` the reward of the greedy completion of row i's prompt; 0 where either is unscored."""
    advantages = rewards - baselines
    return torch.where(torch.isnan(advantages), torch.zeros_like(advantages), advantages)


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

    def _check_advantage_estimator(self) -> None:
        args = self.args
        if args.advantage_estimator != "remax":
            return
        if args.use_vllm:
            raise ValueError("advantage_estimator remax needs greedy generation in the training process, not vLLM")
        if (args.per_device_train_batch_size * args.steps_per_generation) % self.num_generations:
            raise ValueError(
                "advantage_estimator remax generates one greedy completion per group on the process holding it: "
                "per_device_train_batch_size x steps_per_generation must be a multiple of num_generations"
            )

    def _weighted(self, rewards: torch.Tensor) -> torch.Tensor:
        """The weighted reward sum per row (NaN where no reward scored it), as TRL sums it for GRPO."""
        weighted = (rewards * self.reward_weights.to(rewards.device).unsqueeze(0)).nansum(dim=1)
        weighted[torch.isnan(rewards).all(dim=1)] = torch.nan
        return weighted

    @contextlib.contextmanager
    def _unlogged_greedy(self) -> Iterator[None]:
        """Generation without sampling, and no trace of it in the logged metrics, token counts or log columns."""
        config = self.generation_config
        saved = (config.do_sample, copy.deepcopy(self._metrics), self.state.num_input_tokens_seen)
        pending = (copy.deepcopy(self._pending_metrics), copy.deepcopy(self._pending_extra_logs))
        config.do_sample = False
        try:
            yield
        finally:
            config.do_sample, self._metrics, self.state.num_input_tokens_seen = saved
            self._pending_metrics, self._pending_extra_logs = pending

    def _remax_baselines(self, inputs: list[dict[str, Any]]) -> torch.Tensor:
        """Per local row, the weighted reward of its prompt's greedy completion (one generation per group)."""
        from trl import GRPOTrainer
        from trl.data_utils import prepare_multimodal_messages

        G = self.num_generations
        leads = list(range(0, len(inputs), G))  # whole groups per process (checked at init)
        rows = [inputs[i] for i in leads]
        prompts = [copy.deepcopy(row["prompt"]) for row in rows]
        key = "images" if "images" in rows[0] else "image" if "image" in rows[0] else None
        if key is not None:  # TRL's own layout of a row's images in its messages
            images = [row.get(key) if key == "images" else [row[key]] if row.get(key) is not None else None
                      for row in rows]  # fmt: skip
            if not all(image_list == [] for image_list in images):
                prompts = [prepare_multimodal_messages(p, images=i) for p, i in zip(prompts, images, strict=True)]
        with self._unlogged_greedy():
            _, completion_ids, _, completions, *_ = self._generate(prompts)
            rewards = GRPOTrainer._calculate_rewards(self, rows, prompts, completions, completion_ids)
        start = self.accelerator.process_index * len(rows)
        greedy = self._weighted(rewards)[start : start + len(rows)]
        return greedy.repeat_interleave(G)

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        estimator = self.args.advantage_estimator
        training = self.model.training
        baselines = self._remax_baselines(inputs) if estimator == "remax" and training else None
        output = super()._generate_and_score_completions(inputs)
        if estimator == "grpo" or not training:
            return output
        weighted = self._weighted(self._gathered_rewards)
        rows = output["completion_ids"].size(0)
        start = self.accelerator.process_index * rows
        if estimator == "remax":
            local = remax_advantages(weighted[start : start + rows], baselines.to(weighted.device))
            output["advantages"] = local.to(output["advantages"].device)
            return output
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
