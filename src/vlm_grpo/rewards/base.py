"""What every reward shares: text extraction, the batch-reward protocol and the wrapper that keeps a bad sample
from killing a run.

Three calling conventions are accepted for a reward function (detected by :func:`reward_kind`):

* ``trl`` (default): ``fn(completions, **columns) -> list[float | None]``, TRL's interface.
* ``batch`` (EasyR1 style): ``fn(reward_inputs: list[dict], **kw) -> list[float | dict | None]``, marked with
  :func:`batch_reward` or detected when its first parameter is named ``reward_inputs``.
* ``sequential`` (EasyR1 style, one sample at a time): ``fn(reward_input: dict, **kw) -> float | dict | None``,
  marked with ``@batch_reward(sequential=True)`` or detected when its first parameter is named ``reward_input``.
* ``verl`` (verl / DeepEyes / RynnBrain / PyVision RL code, one sample at a time): ``fn(data_source, solution_str,
  ground_truth, extra_info=None)`` or DeepEyes' ``fn(predict_str, ground_truth, extra_info)``, detected from those
  parameter names. ``solution_str`` / ``predict_str`` is the completion text, ``ground_truth`` the row's solution,
  ``data_source`` the row's ``data_source`` column, ``extra_info`` the row's own ``extra_info`` dict merged over
  every other column (``question``, ``image_path``, ...). It returns a float or a dict with ``score`` (or
  ``overall``); other numeric keys are logged as for batch rewards.

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
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vlm_grpo.cli_errors import UserError

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]

# Keys TRL passes that are not per-sample columns.
_NON_COLUMN_KWARGS = ("trainer_state", "log_extra", "log_metric", "environments")

_KIND_ATTR = "__vlm_grpo_reward_kind__"
REWARD_KINDS = ("trl", "batch", "sequential", "verl")
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
    """``"trl"``, ``"batch"``, ``"sequential"`` or ``"verl"``: the calling convention of ``fn`` (module docstring).

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
    if "ground_truth" in params and ("solution_str" in params or "predict_str" in params):
        return "verl"
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


_VERL_OWN = ("response", "completion", "response_length", "ground_truth", "solution", "completion_ids")


def verl_arguments(fn: Callable, reward_input: dict[str, Any]) -> dict[str, Any]:
    """A verl-style reward's arguments from one sample's reward input (see the module docstring)."""
    extra = {k: v for k, v in reward_input.items() if k not in _VERL_OWN and k != "extra_info"}
    own = reward_input.get("extra_info")
    if isinstance(own, Mapping):
        extra.update(own)
    values = {
        "data_source": reward_input.get("data_source"),
        "solution_str": reward_input["response"],
        "predict_str": reward_input["response"],
        "ground_truth": reward_input["ground_truth"],
        "extra_info": extra,
    }
    return {k: v for k, v in values.items() if _accepts(fn, k)}


def _names(fn: Callable, name: str) -> bool:
    """``fn`` has a parameter called ``name`` (not merely ``**kwargs``)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _accepts(fn: Callable, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class RewardError(UserError):
    """A reward that cannot score anything (wrong signature, missing keyword, missing package): a user error,
    printed by the command line as ``error: ...`` with a non-zero exit status."""


def _likely_fix(label: str, exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, ModuleNotFoundError):
        return f"install the missing package ({exc.name})"
    if isinstance(exc, TypeError) and ("positional argument" in text or "keyword argument" in text):
        return (
            "check its signature against the reward kinds in the README (TRL: fn(completions, **columns); EasyR1: "
            "fn(reward_inputs) / fn(reward_input); verl: fn(data_source, solution_str, ground_truth, extra_info)), "
            f"or pass the keywords it needs with --reward_kwargs '{{\"{label}\": {{...}}}}'"
        )
    if isinstance(exc, KeyError):
        return f"the rows have no column {exc}; add it to the data or bind it with --reward_kwargs"
    return "fix the reward or the rows it reads"


class SafeReward:
    """Calls a reward on a batch; if it raises, retries sample by sample and gives failing samples ``None``.

    TRL treats ``None`` as "no reward" (NaN, ignored by nansum), so one odd completion or row costs
    that sample its reward, never the run. Failures are counted, logged (first one with its
    traceback, then every ``warn_every``-th) and reported as the metric ``rewards/<name>/failures``.

    A reward that raises on EVERY sample of its first batch, or of ``max_failed_batches`` batches in a row, is
    broken rather than unlucky: it raises :class:`RewardError` naming itself, the exception and the likely fix, and
    the run stops (``max_failed_batches=0``, the default of this class: never; every sample then just gets no
    reward; ``build_reward_funcs`` turns it on, ``--reward_max_failed_batches``).
    """

    def __init__(
        self,
        fn: RewardFunc,
        name: str,
        warn_every: int = 100,
        max_failed_batches: int = 0,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        self.fn = fn
        # Run-wide objects (``processing_class``, ``tokenizer``) for a TRL-kind reward that names them explicitly.
        self.context = {k: v for k, v in (context or {}).items() if _names(fn, k)}
        self.__name__ = name
        self.warn_every = warn_every
        self.max_failed_batches = max_failed_batches
        self.failures = 0
        self.batches = 0
        self.failed_batches_in_a_row = 0
        self.kind = reward_kind(fn)
        self._metrics: dict[str, list[float]] = {}
        self._last_error: BaseException | None = None
        self._raw_outputs: list[Any] = []
        #: also log EasyR1's names, ``reward/<key>`` for every key of the returned dicts (``reward/overall``, ...);
        #: set by ``build_reward_funcs`` when the run has this one reward, as EasyR1 runs do
        self.easyr1_metric_names = False
        #: per sample of the latest call, the numeric keys of the dict the reward returned ({} for a plain number
        #: or a failed sample): what dynamic sampling's filter_key can name besides the rewards themselves
        self.last_outputs: list[dict[str, float]] = []

    def _call(self, kwargs: dict[str, Any]) -> list[Any]:
        if self.kind == "trl":
            accepted = {k: v for k, v in kwargs.items() if _accepts(self.fn, k)}
            return list(self.fn(**accepted, **self.context))
        completions = kwargs.pop("completions")
        inputs = reward_inputs_from_kwargs(completions, kwargs)
        if self.kind == "batch":
            outputs = list(self.fn(inputs))
        elif self.kind == "verl":
            outputs = [self.fn(**verl_arguments(self.fn, reward_input)) for reward_input in inputs]
        else:
            outputs = [self.fn(reward_input) for reward_input in inputs]
        if len(outputs) != len(inputs):
            raise ValueError(f"returned {len(outputs)} values for {len(inputs)} completions")
        self._raw_outputs = outputs
        return [self._overall(out) for out in outputs]

    def _overall(self, out: Any) -> Any:
        """A batch reward's per-sample output: the reward (``overall`` of a dict); other dict keys are metrics."""
        if not isinstance(out, Mapping):
            return out
        main = "overall" if "overall" in out else "score" if self.kind == "verl" and "score" in out else None
        if main is None:
            wanted = "'score' or 'overall'" if self.kind == "verl" else "'overall'"
            raise ValueError(f"{self.kind} reward returned a dict without {wanted}: keys {sorted(out)[:10]}")
        for key, value in out.items():
            if key == main or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                key = str(key)
                # TRL itself logs rewards/<name>/mean and /std, and we log /failures: don't mix values into those.
                key = f"batch_{key}" if key in _RESERVED_METRICS else key
                self._metrics.setdefault(key, []).append(float(value))
        return out[main]

    def _record_failure(self, exc: BaseException, index: int) -> None:
        self._last_error = exc
        self.failures += 1
        if self.failures == 1 or self.failures % self.warn_every == 0:
            frames = traceback.extract_tb(exc.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            logger.warning(
                "Reward '%s' failed on a sample (%d failure(s) so far); that sample gets no reward: %r%s",
                self.__name__,
                self.failures,
                exc,
                where,
            )
            # The whole traceback only when asked for (log level DEBUG, or --debug): the line above says where.
            logger.debug("Reward '%s' traceback", self.__name__, exc_info=exc)

    def _stop_if_broken(self, n: int, failed: int) -> None:
        self.batches += 1
        everything_failed = n > 0 and failed >= n
        self.failed_batches_in_a_row = self.failed_batches_in_a_row + 1 if everything_failed else 0
        if not everything_failed or self.max_failed_batches <= 0:
            return
        first = self.batches == 1
        if first or self.failed_batches_in_a_row >= self.max_failed_batches:
            exc = self._last_error
            where = "its first batch" if first else f"{self.failed_batches_in_a_row} batches in a row"
            raise RewardError(
                f"reward '{self.__name__}' raised on every sample of {where} "
                f"({type(exc).__name__}: {str(exc)[:200]}); {_likely_fix(self.__name__, exc)}. "
                "(--reward_max_failed_batches 0 keeps training with no reward from it)"
            ) from exc

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        n = len(completions)
        before = self.failures
        self._metrics = {}
        self._raw_outputs = []
        try:
            values = self._call({"completions": completions, **kwargs})
            if len(values) != n:
                raise ValueError(f"returned {len(values)} values for {n} completions")
            raw = list(self._raw_outputs) or [None] * n
        except Exception:  # isolate the sample(s) that break it
            values, raw = [], []
            self._metrics = {}  # metrics of the failed batch call are dropped; the per-sample calls report theirs
            for i in range(n):
                single = {
                    k: (v[i : i + 1] if isinstance(v, list) and len(v) == n and k not in _NON_COLUMN_KWARGS else v)
                    for k, v in kwargs.items()
                }
                try:
                    self._raw_outputs = []
                    out = self._call({"completions": completions[i : i + 1], **single})
                    if len(out) != 1:
                        raise ValueError(f"returned {len(out)} values for 1 completion")
                    values.append(out[0])
                    raw.append(self._raw_outputs[0] if self._raw_outputs else None)
                except Exception as exc:
                    self._record_failure(exc, i)
                    values.append(None)
                    raw.append(None)
        self.last_outputs = [_numeric_items(out) for out in raw]
        self._stop_if_broken(n, self.failures - before)
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
            if self.easyr1_metric_names:
                for key, value in easyr1_reward_metrics(self.last_outputs).items():
                    log_metric(key, value)
        self._metrics = {}
        return clean


def _numeric_items(out: Any) -> dict[str, float]:
    """The finite numeric entries of a reward's per-sample dict output ({} for anything else)."""
    if not isinstance(out, Mapping):
        return {}
    return {
        str(k): float(v)
        for k, v in out.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def easyr1_reward_metrics(outputs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """EasyR1's reward metrics: ``reward/<key>``, the mean of each key over the samples whose dict has it."""
    sums: dict[str, list[float]] = {}
    for out in outputs:
        for key, value in out.items():
            sums.setdefault(f"reward/{key}", []).append(value)
    return {key: sum(values) / len(values) for key, values in sums.items()}
