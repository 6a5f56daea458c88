"""What every reward shares: text extraction, the batch-reward protocol and the wrapper that keeps a bad sample
from killing a run.

Three calling conventions are accepted for a reward function (detected by :func:`reward_kind`):

* ``trl`` (default): ``fn(completions, **columns) -> list[float | None]``, TRL's interface.
* ``batch`` (EasyR1 style): ``fn(reward_inputs: list[dict], **kw) -> list[float | dict | None]``, marked with
  :func:`batch_reward` or detected when its first parameter is named ``reward_inputs``.
* ``sequential`` (EasyR1 style, one sample at a time): ``fn(reward_input: dict, **kw) -> float | dict | None``,
  marked with ``@batch_reward(sequential=True)`` or detected when its first parameter is named ``reward_input``.

A batch/sequential reward gets one dict per sample holding ``response`` and ``completion`` (the completion text),
``ground_truth`` and ``solution`` (the row's solution), ``prompt``, ``response_length`` (completion tokens;
characters without token ids) and every dataset column of the row (``image_path``, ``image_sizes``,
``accu_reward_method``, ``task_type``, ...). It may return plain numbers or dicts
``{"overall": x, "accuracy": ..., ...}``: ``overall`` is the reward, every other numeric key is logged as the
metric ``rewards/<name>/<key>`` (mean over the samples of the batch that report it; the keys ``mean``, ``std`` and
``failures``, which TRL and :class:`SafeReward` use themselves, become ``batch_<key>``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]

# Keys TRL passes that are not per-sample columns.
_NON_COLUMN_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")

_KIND_ATTR = "__vlm_grpo_reward_kind__"
REWARD_KINDS = ("trl", "batch", "sequential")
_RESERVED_METRICS = ("mean", "std", "failures")


def column(kwargs: dict[str, Any], name: str, n: int) -> Sequence[Any]:
    """A per-sample dataset column of length ``n`` (``None`` per sample when the column is absent)."""
    value = kwargs.get(name)
    if value is None:
        return [None] * n
    if len(value) != n:
        raise ValueError(f"Column '{name}' has {len(value)} entries for {n} completions")
    return value


def completion_text(completion: Any) -> str:
    """Text of one completion, whether TRL passed a plain string or a list of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        parts = []
        for message in completion:
            content = message.get("content", "") if isinstance(message, dict) else message
            if isinstance(content, list):
                content = "".join(p.get("text", "") or "" for p in content if isinstance(p, dict))
            parts.append(content if isinstance(content, str) else "" if content is None else str(content))
        return "".join(parts)
    return "" if completion is None else str(completion)


def batch_reward(fn: Callable | None = None, *, sequential: bool = False) -> Any:
    """Mark ``fn`` as an EasyR1-style reward: ``@batch_reward`` for ``fn(reward_inputs: list[dict]) -> list``,
    ``@batch_reward(sequential=True)`` for ``fn(reward_input: dict) -> float | dict``. See the module docstring."""

    def mark(target: Callable) -> Callable:
        setattr(target, _KIND_ATTR, "sequential" if sequential else "batch")
        return target

    return mark if fn is None else mark(fn)


def _unwrap(fn: Callable) -> Callable:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


def reward_kind(fn: Callable) -> str:
    """``"trl"``, ``"batch"`` or ``"sequential"``: the calling convention of a reward function (module docstring).

    An explicit :func:`batch_reward` mark wins; otherwise a function whose first parameter is ``reward_inputs``
    (``reward_input``) and that has no ``completions`` parameter is a batch (sequential) reward.
    """
    marked = getattr(_unwrap(fn), _KIND_ATTR, None)
    if marked in REWARD_KINDS:
        return marked
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "trl"
    if "completions" in params:
        return "trl"
    positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else None
    if first == "reward_inputs":
        return "batch"
    if first == "reward_input":
        return "sequential"
    return "trl"


def reward_inputs_from_kwargs(completions: Sequence[Any], kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The per-sample dicts a batch reward receives (see the module docstring) from TRL's keyword arguments."""
    n = len(completions)
    columns = {
        k: v for k, v in kwargs.items() if k not in _NON_COLUMN_KWARGS and isinstance(v, (list, tuple)) and len(v) == n
    }
    inputs = []
    for i in range(n):
        row = {("prompt" if k == "prompts" else k): v[i] for k, v in columns.items()}
        text = completion_text(completions[i])
        ids = row.get("completion_ids")
        row["response"] = text
        row["completion"] = text
        row["response_length"] = len(ids) if isinstance(ids, (list, tuple)) else len(text)
        row.setdefault("solution", None)
        row["ground_truth"] = row["solution"]
        inputs.append(row)
    return inputs


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class SafeReward:
    """Calls a reward on a batch; if it raises, retries sample by sample and gives failing samples ``None``.

    TRL treats ``None`` as "no reward" (NaN, ignored by nansum), so one odd completion or row costs
    that sample its reward, never the run. Failures are counted, logged (first one with its
    traceback, then every ``warn_every``-th) and reported as the metric ``rewards/<name>/failures``.
    """

    def __init__(self, fn: RewardFunc, name: str, warn_every: int = 100) -> None:
        self.fn = fn
        self.__name__ = name
        self.warn_every = warn_every
        self.failures = 0
        self.kind = reward_kind(fn)
        self._metrics: dict[str, list[float]] = {}

    def _call(self, kwargs: dict[str, Any]) -> list[Any]:
        if self.kind == "trl":
            accepted = {k: v for k, v in kwargs.items() if _accepts(self.fn, k)}
            return list(self.fn(**accepted))
        completions = kwargs.pop("completions")
        inputs = reward_inputs_from_kwargs(completions, kwargs)
        if self.kind == "batch":
            outputs = list(self.fn(inputs))
        else:
            outputs = [self.fn(reward_input) for reward_input in inputs]
        if len(outputs) != len(inputs):
            raise ValueError(f"returned {len(outputs)} values for {len(inputs)} completions")
        return [self._overall(out) for out in outputs]

    def _overall(self, out: Any) -> Any:
        """A batch reward's per-sample output: the reward (``overall`` of a dict); other dict keys are metrics."""
        if not isinstance(out, Mapping):
            return out
        if "overall" not in out:
            raise ValueError(f"batch reward returned a dict without 'overall': keys {sorted(out)[:10]}")
        for key, value in out.items():
            if key == "overall" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                key = str(key)
                # TRL itself logs rewards/<name>/mean and /std, and we log /failures: don't mix values into those.
                key = f"batch_{key}" if key in _RESERVED_METRICS else key
                self._metrics.setdefault(key, []).append(float(value))
        return out["overall"]

    def _record_failure(self, exc: BaseException, index: int) -> None:
        self.failures += 1
        if self.failures == 1 or self.failures % self.warn_every == 0:
            logger.warning(
                "Reward '%s' failed on a sample (%d failure(s) so far); that sample gets no reward: %r",
                self.__name__,
                self.failures,
                exc,
                exc_info=exc if self.failures == 1 else None,
            )

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        n = len(completions)
        before = self.failures
        self._metrics = {}
        try:
            values = self._call({"completions": completions, **kwargs})
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
        except Exception:  # isolate the sample(s) that break it
            values = []
            self._metrics = {}  # metrics of the failed batch call are dropped; the per-sample calls report theirs
            for i in range(n):
                single = {
                    k: (v[i : i + 1] if isinstance(v, list) and len(v) == n and k not in _NON_COLUMN_KWARGS else v)
                    for k, v in kwargs.items()
                }
                try:
                    out = self._call({"completions": completions[i : i + 1], **single})
                    if len(out) != 1:
                        raise ValueError(f"returned {len(out)} values for 1 completion")
                    values.append(out[0])
                except Exception as exc:
                    self._record_failure(exc, i)
                    values.append(None)
        clean: list[float | None] = []
        for i, value in enumerate(values):
            if value is None:
                clean.append(None)
                continue
            try:
                value = float(value)
                if not math.isfinite(value):
                    raise ValueError(f"non-finite reward {value}")
            except Exception as exc:  # TypeError, ValueError, OverflowError (float(10**400)), ...
                self._record_failure(exc, i)
                clean.append(None)
                continue
            clean.append(value)
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            log_metric(f"rewards/{self.__name__}/failures", float(self.failures - before))
            for key, vals in sorted(self._metrics.items()):
                if vals:
                    log_metric(f"rewards/{self.__name__}/{key}", sum(vals) / len(vals))
        self._metrics = {}
        return clean
