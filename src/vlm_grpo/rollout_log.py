"""``--rollout_log PATH.jsonl``: every rollout of a step as one JSON line (VLM-R1's ``DEBUG_MODE`` log, as data).

Each line: ``step``, ``round`` (generation round of the step; >1 only with dynamic sampling), ``rank``,
``index`` / ``group`` (row and GRPO group in this rank's batch), ``id``, ``system``, ``prompt`` (user text with
``<image>`` markers), ``images`` (paths; embedded images as a short ``data:`` stub), ``solution``,
``completion``, ``rewards`` (each reward's value, null where it did not apply), ``reward`` (the weighted
sum) and ``advantage``. Rank 0 appends to PATH, rank r to ``PATH``'s name with ``.rank<r>`` before the
suffix, so ranks never share a file. ``--rollout_log_every N`` logs every N-th step,
``--rollout_log_max_chars`` cuts long prompts and completions.

VLM-R1 users: ``DEBUG_MODE=true LOG_PATH=run.log`` turns the log on (to ``LOG_PATH``) when ``--rollout_log``
is not given. In a Lewis-game run ``LOG_PATH`` is the ``listener`` reward's game-prediction log (its seed's
meaning), so the rollouts then go beside it, to ``<LOG_PATH without suffix>.rollouts.jsonl``: one schema per file.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from vlm_grpo.rewards import completion_text

logger = logging.getLogger(__name__)


def rollout_log_path(
    configured: str | None, rank: int, environ: dict[str, str] | None = None, predictions_in_log_path: bool = False
) -> str | None:
    """This rank's file: ``--rollout_log``, else VLM-R1's ``LOG_PATH`` under ``DEBUG_MODE=true`` (beside it when
    ``predictions_in_log_path``: the Lewis game's prediction log is ``LOG_PATH``)."""
    environ = os.environ if environ is None else environ
    path = configured
    if path is None and environ.get("DEBUG_MODE", "").lower() == "true" and environ.get("LOG_PATH"):
        path = environ["LOG_PATH"]
        if predictions_in_log_path:
            path = str(Path(path).with_name(f"{Path(path).stem}.rollouts.jsonl"))
    if not path or rank == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def _clip(text: str, limit: int | None) -> str:
    if limit is None or len(text) <= limit:
        return text
    return text[:limit] + f"...[+{len(text) - limit} chars]"


def _image_name(path: Any) -> Any:
    if isinstance(path, str) and path.startswith("data:"):
        return path.split(",", 1)[0] + f",...({len(path)} chars)"
    return path


def _prompt_parts(messages: Any) -> tuple[str | None, str]:
    """(system text, user text with ``<image>`` markers) of a chat prompt, or the plain prompt string."""
    if isinstance(messages, str):
        return None, messages
    system, user = None, []
    for message in messages or []:
        content = message.get("content")
        items = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        text = "".join(
            "<image>" if item.get("type") == "image" else str(item.get("text", ""))
            for item in items
            if isinstance(item, dict)
        )
        if message.get("role") == "system":
            system = text
        elif message.get("role") == "user":
            user.append(text)
    return system, "\n".join(user)


def _number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


class RolloutLogMixin:
    """Writes the rollout log of a ``GRPOTrainer`` subclass (see the module docstring)."""

    _rollout_pending: list[dict] | None = None
    _rollout_round: tuple[int, int] = (-1, 0)

    def _rollout_file(self) -> str | None:
        if not hasattr(self, "_rollout_path"):
            from vlm_grpo.rewards.listener import listener_reward

            unwrapped = [getattr(f, "fn", f) for f in self.reward_funcs]  # SafeReward -> function (or partial)
            lewis = any(getattr(f, "func", f) is listener_reward for f in unwrapped)
            self._rollout_path = rollout_log_path(
                self.args.rollout_log, self.args.process_index, predictions_in_log_path=lewis
            )
            if self._rollout_path:
                Path(self._rollout_path).parent.mkdir(parents=True, exist_ok=True)
                logger.info("Rollout log: %s", self._rollout_path)
        return self._rollout_path

    def _logs_this_step(self) -> bool:
        every = max(1, self.args.rollout_log_every)
        return self.model.training and self._rollout_file() is not None and self.state.global_step % every == 0

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if not self._logs_this_step():
            return rewards
        limit = self.args.rollout_log_max_chars
        start = self.accelerator.process_index * len(prompts)
        local = rewards[start : start + len(prompts)].tolist()
        weights = self.reward_weights.tolist()
        self._rollout_pending = []
        for i, (row, prompt, completion) in enumerate(zip(inputs, prompts, completions, strict=True)):
            system, user = _prompt_parts(prompt)
            values = [_number(v) for v in local[i]]
            applied = [v * w for v, w in zip(values, weights, strict=True) if v is not None]
            self._rollout_pending.append(
                {
                    "id": row.get("id"),
                    "system": _clip(system, limit) if system else system,
                    "prompt": _clip(user, limit),
                    "images": [_image_name(p) for p in row.get("image_path") or []],
                    **({"video": row["video"]} if row.get("video") is not None else {}),
                    "solution": _clip(str(row.get("solution", "")), limit) if "solution" in row else None,
                    "completion": _clip(completion_text(completion), limit),
                    "rewards": dict(zip(self.reward_func_names, values, strict=True)),
                    "reward": sum(applied) if applied else None,
                }
            )
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        pending, self._rollout_pending = self._rollout_pending, None
        if pending is None:
            return output
        step = self.state.global_step + 1  # the optimizer step these rollouts train
        last_step, rounds = self._rollout_round
        self._rollout_round = (step, rounds + 1 if last_step == step else 1)
        advantages = output["advantages"].tolist()
        with open(self._rollout_file(), "a", encoding="utf-8") as handle:
            for index, (record, advantage) in enumerate(zip(pending, advantages, strict=True)):
                head = {"step": step, "round": self._rollout_round[1], "rank": self.args.process_index}
                head |= {"index": index, "group": index // self.num_generations}
                handle.write(json.dumps({**head, **record, "advantage": advantage}, ensure_ascii=False) + "\n")
        return output
