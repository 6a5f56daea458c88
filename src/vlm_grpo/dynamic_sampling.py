"""DAPO dynamic sampling (EasyR1's ``online_filtering``): train only on groups whose rewards differ.

A group whose G completions all earn the same reward (all right or all wrong) has zero advantage and
teaches nothing, yet it fills a slot of the batch. With ``dynamic_sampling`` the trainer drops such groups
(or, with ``filter_key``, groups whose mean of that reward, or of that key of the dicts a batch reward returns,
lies outside ``(filter_low, filter_high)``), then
generates groups for further prompts until every rank's generation batch is full again, at most
``max_sampling_rounds`` generation rounds per batch. When the rounds run out, the remaining slots are filled
with dropped groups (zero advantage: they add no policy-gradient signal), and a warning says so.

It wraps TRL's ``_generate_and_score_completions``: each round is TRL's own generation, scoring and
advantage computation; the mixin only keeps whole groups and concatenates rounds (re-padding prompts left and
completions right). Group advantages are per group, so keeping a subset of groups leaves them unchanged
(with ``scale_rewards="batch"`` or ``advantage_estimator="reinforce_plus_plus"`` the batch statistics are those
of the round). ``num_items_in_batch`` is recomputed over the kept rows, so the loss is the one the kept groups
alone give.

Further prompts come from a second seeded pass over the training set, split across ranks as TRL's sampler
splits the first; its position is saved with each checkpoint (``dynamic_sampling.json``) and restored on
resume. Ranks decide on their own groups from the gathered rewards and run the same number of rounds (they
agree on "anyone still short" every round), so collective calls stay in step.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

from vlm_grpo.fastpath.contract import PrivateName
from vlm_grpo.fastpath.vision_reuse import FEATURES_KEY

logger = logging.getLogger(__name__)

#: the private TRL / transformers names this module and ``rollout_log`` override or read (checked by a test)
PRIVATE_NAMES = (
    PrivateName("trl:GRPOTrainer", "_generate_and_score_completions", ("inputs",), why="dynamic sampling rounds"),
    PrivateName("trl:GRPOTrainer", "_metrics", source="trl:GRPOTrainer.__init__", why="dynamic_sampling/* metrics"),
    PrivateName("trl:GRPOTrainer", "_save_checkpoint", ("model", "trial"), why="the further-prompt position"),
    PrivateName("trl:GRPOTrainer", "_load_optimizer_and_scheduler", ("checkpoint",), why="restoring it"),
    PrivateName("transformers:Trainer", "_get_output_dir", ("trial",), why="the checkpoint folder"),
)

STATE_FILE = "dynamic_sampling.json"
#: names under which ``filter_key`` means the weighted sum of all rewards (EasyR1 calls it ``overall``)
TOTAL_REWARD_KEYS = ("reward", "overall")

# How each field of TRL's generation output is laid out, for concatenating rounds with different widths.
_LEFT_PADDED = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT_PADDED = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 0.0,
    "tool_mask": 1,
}
_PROMPT_AND_COMPLETION = ("token_type_ids", "mm_token_type_ids")  # [B, P + C]
_PER_ROW_TENSOR_LISTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "spatial_shapes",
    "image_sizes",
    "image_position_ids",
)
_PER_ROW_INTS = ("num_images", "num_tiles")


def keep_groups(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    num_generations: int,
    names: list[str],
    filter_key: str | None = None,
    low: float = 0.01,
    high: float = 0.99,
    column: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which groups to keep (bool per group) from the gathered ``[rows, reward funcs]`` rewards.

    Default (DAPO): the weighted reward sum must vary within the group. With ``filter_key`` (a reward name,
    or ``reward`` / ``overall`` for the weighted sum, or a key of the dicts a reward returns, whose per-row values
    are given as ``column``): the group's mean of it must lie in ``(low, high)``.
    """
    if column is not None:
        values = column.to(rewards_per_func.device, rewards_per_func.dtype)
    elif filter_key is None or filter_key in TOTAL_REWARD_KEYS:
        values = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        values[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # no reward applied: no signal
    else:
        values = rewards_per_func[:, names.index(filter_key)]
    grouped = values.view(-1, num_generations)
    if filter_key is None:
        top = torch.where(torch.isnan(grouped), -torch.inf, grouped).max(dim=1).values
        bottom = torch.where(torch.isnan(grouped), torch.inf, grouped).min(dim=1).values
        return (top - bottom) > 1e-6
    mean = torch.nanmean(grouped, dim=1)
    return (mean > low) & (mean < high)


def _rows(value: Any, index: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[index]
    return [value[i] for i in index]


def _pad_cat(parts: list[torch.Tensor], value: float | int, left: bool) -> torch.Tensor:
    width = max(p.size(1) for p in parts)
    padded = []
    for part in parts:
        extra = width - part.size(1)
        if extra:
            fill = part.new_full((part.size(0), extra, *part.shape[2:]), value)
            part = torch.cat([fill, part] if left else [part, fill], dim=1)
        padded.append(part)
    return torch.cat(padded, dim=0)


def merge_batches(parts: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Concatenate row subsets of TRL generation outputs (``split_pixel_values_by_grid`` layout) made in
    different rounds: prompts re-padded on the left, completions on the right, per-row image tensors joined.
    ``num_items_in_batch`` is left to the caller."""
    # TRL's order (prompt_ids first): split_tensor_dict sizes the batch by its first tensor
    keys = [k for k in dict.fromkeys(k for part in parts for k in part) if k != "num_items_in_batch"]
    sizes = [len(part["advantages"]) for part in parts]
    merged: dict[str, Any] = {}
    for key in keys:
        values = [part.get(key) for part in parts]
        if key in _LEFT_PADDED or key in _RIGHT_PADDED:
            fill = (_LEFT_PADDED | _RIGHT_PADDED)[key]
            fill = pad_token_id if fill == "pad" else fill
            if any(v is None for v in values):
                raise ValueError(f"dynamic_sampling: field '{key}' is missing in some generation rounds")
            merged[key] = _pad_cat(values, fill, left=key in _LEFT_PADDED)
        elif key in _PROMPT_AND_COMPLETION:
            prompts, completions = [], []
            for part, value in zip(parts, values, strict=True):
                width = part["prompt_ids"].size(1)
                if value is None:  # a text-only round: no multimodal tokens anywhere
                    value = part["prompt_ids"].new_zeros(
                        (part["prompt_ids"].size(0), width + part["completion_ids"].size(1))
                    )
                prompts.append(value[:, :width])
                completions.append(value[:, width:])
            merged[key] = torch.cat([_pad_cat(prompts, 0, left=True), _pad_cat(completions, 0, left=False)], dim=1)
        elif key in _PER_ROW_TENSOR_LISTS:
            template = next(v for v in values if v)[0]
            empty = template.new_zeros((0, *template.shape[1:]))
            merged[key] = [t for value, n in zip(values, sizes, strict=True) for t in (value or [empty] * n)]
        elif key == FEATURES_KEY:  # per-row objects; a round without them: None (that pass encodes)
            merged[key] = [x for value, n in zip(values, sizes, strict=True) for x in (value or [None] * n)]
        elif key in _PER_ROW_INTS:
            merged[key] = [x for value, n in zip(values, sizes, strict=True) for x in (value or [0] * n)]
        elif all(isinstance(v, torch.Tensor) and v.ndim == 1 for v in values):  # advantages and other row vectors
            merged[key] = torch.cat(values)
        else:
            raise ValueError(f"dynamic_sampling: cannot merge generation output field '{key}' across rounds")
    return merged


class DynamicSamplingMixin:
    """Adds ``dynamic_sampling`` to a ``GRPOTrainer`` subclass (see the module docstring)."""

    _ds_cursor: int = 0

    def _check_dynamic_sampling(self) -> None:
        args = self.args
        if not args.dynamic_sampling:
            return
        local_rows = args.per_device_train_batch_size * args.steps_per_generation
        if local_rows % self.num_generations:
            raise ValueError(
                f"dynamic_sampling keeps or drops whole groups per rank: per_device_train_batch_size x "
                f"steps_per_generation ({local_rows}) must be a multiple of num_generations ({self.num_generations})"
            )
        if not hasattr(self.train_dataset, "__getitem__") or not hasattr(self.train_dataset, "__len__"):
            raise ValueError("dynamic_sampling needs a map-style training dataset (it draws further prompts by index)")
        key = args.filter_key
        returns_dicts = any(getattr(f, "kind", "trl") != "trl" for f in self.reward_funcs)
        if key is not None and key not in TOTAL_REWARD_KEYS and key not in self.reward_func_names and not returns_dicts:
            raise ValueError(
                f"filter_key '{key}' is not a reward of this run: use one of {self.reward_func_names} or "
                f"{' / '.join(TOTAL_REWARD_KEYS)} (the weighted sum), or a key of the dict a batch reward returns"
            )
        if key is not None and not args.filter_low < args.filter_high:
            raise ValueError(f"filter_low ({args.filter_low}) must be below filter_high ({args.filter_high})")
        if args.max_sampling_rounds < 1:
            raise ValueError(f"max_sampling_rounds must be at least 1, got {args.max_sampling_rounds}")

    def _filter_column(self, rows: int) -> torch.Tensor | None:
        """This rank's per-row values of ``filter_key`` when it names a key of the dicts a reward returned
        (``accuracy`` of EasyR1's ``{overall, accuracy, format}``; ``label/key`` when two rewards return it);
        None when it names a reward or the weighted sum."""
        key = self.args.filter_key
        if key is None or key in TOTAL_REWARD_KEYS or key in self.reward_func_names:
            return None
        label, _, inner = key.partition("/")
        named = {label: inner} if inner and label in self.reward_func_names else None
        found, seen = {}, set()
        for name, func in zip(self.reward_func_names, self.reward_funcs, strict=True):
            outputs = getattr(func, "last_outputs", [])
            seen.update(f"{name}/{k}" for out in outputs for k in out)
            wanted = named.get(name) if named is not None else key
            if wanted and len(outputs) == rows and any(wanted in out for out in outputs):
                found[name] = [out.get(wanted, float("nan")) for out in outputs]
        if len(found) != 1:
            what = "several rewards return it; write it as reward/key" if found else "no reward returned it"
            raise ValueError(
                f"filter_key '{key}': {what} (rewards: {', '.join(self.reward_func_names)}; keys their dicts "
                f"returned: {', '.join(sorted(seen)) or 'none'}; or reward / overall for the weighted sum)"
            )
        return torch.tensor(next(iter(found.values())), dtype=torch.float32)

    def _further_prompts(self, local_rows: int) -> list[dict]:
        """The next prompts of the second pass over the training set, this rank's share, each repeated G times."""
        groups = local_rows // self.num_generations
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        size = len(self.train_dataset)
        indices = []
        for position in range(self._ds_cursor, self._ds_cursor + groups * world):
            generator = torch.Generator().manual_seed(self.args.seed + 1 + position // size)
            indices.append(int(torch.randperm(size, generator=generator)[position % size]))
        self._ds_cursor += groups * world
        mine = indices[rank * groups : (rank + 1) * groups]
        return [self.train_dataset[i] for i in mine for _ in range(self.num_generations)]

    def _generate_and_score_completions(self, inputs):
        if not self.args.dynamic_sampling or not self.model.training:
            return super()._generate_and_score_completions(inputs)
        G, local_rows = self.num_generations, len(inputs)
        quota = local_rows // G
        rank = self.accelerator.process_index
        rank_slice = slice(rank * local_rows, (rank + 1) * local_rows)
        kept: list[dict] = []
        dropped: list[dict] = []
        n_kept = n_dropped = rounds = 0
        batch = inputs
        while True:
            rounds += 1
            output = split_pixel_values_by_grid(super()._generate_and_score_completions(batch))
            rewards = self._gathered_rewards[rank_slice]  # kept by AdvantageEstimatorMixin
            keep = keep_groups(
                rewards,
                self.reward_weights,
                G,
                list(self.reward_func_names),
                self.args.filter_key,
                self.args.filter_low,
                self.args.filter_high,
                self._filter_column(len(rewards)),
            ).tolist()
            for group, keep_it in enumerate(keep):
                rows = list(range(group * G, (group + 1) * G))
                part = {k: _rows(v, rows) for k, v in output.items() if k != "num_items_in_batch" and v is not None}
                (kept if keep_it else dropped).append(part)
            counts = torch.tensor([sum(keep), len(keep) - sum(keep), max(0, quota - len(kept))], dtype=torch.float64)
            counts = self.accelerator.gather(counts.to(self.accelerator.device)).view(-1, 3).cpu()
            n_kept += int(counts[:, 0].sum())
            n_dropped += int(counts[:, 1].sum())
            if counts[:, 2].max() == 0 or rounds >= self.args.max_sampling_rounds:
                break
            batch = self._further_prompts(local_rows)
        filled = max(0, quota - len(kept))
        total_filled = int(self.accelerator.gather(torch.tensor([filled], device=self.accelerator.device)).sum())
        if total_filled:
            logger.warning(
                "dynamic_sampling: %d group(s) still missing after max_sampling_rounds=%d; filled with dropped groups "
                "(zero advantage, no policy-gradient signal). Raise max_sampling_rounds or check the rewards.",
                total_filled,
                self.args.max_sampling_rounds,
            )
        chosen = kept[:quota] + dropped[-filled:] if filled else kept[:quota]
        merged = merge_batches(chosen, self._tokenizer.pad_token_id)
        loss_mask = merged["completion_mask"]
        if "tool_mask" in merged:
            loss_mask = loss_mask * merged["tool_mask"]
        merged["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum()
        metrics = self._metrics["train"]
        metrics["dynamic_sampling/kept_groups"].append(float(n_kept))
        metrics["dynamic_sampling/dropped_groups"].append(float(n_dropped))
        metrics["dynamic_sampling/rounds"].append(float(rounds))
        metrics["dynamic_sampling/filled_groups"].append(float(total_filled))
        return unsplit_pixel_values_by_grid(merged)

    # ------------------------------------------------------------------ the further-prompt position in checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.dynamic_sampling and self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            folder = os.path.join(self._get_output_dir(trial=trial), name)
            with open(os.path.join(folder, STATE_FILE), "w") as handle:
                json.dump({"cursor": self._ds_cursor}, handle)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, STATE_FILE) if checkpoint else None
        if path and os.path.isfile(path) and self.args.dynamic_sampling:
            with open(path) as handle:
                self._ds_cursor = int(json.load(handle)["cursor"])
