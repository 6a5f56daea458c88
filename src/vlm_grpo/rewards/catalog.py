"""The reward registry, its built-in entries (lazy ``module:fn`` specs: importing vlm_grpo stays cheap), and
``build_reward_funcs``, which turns ``--reward_funcs`` names into the callables TRL calls."""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vlm_grpo.registry import Registry, load_object, parse_kwargs_by_name
from vlm_grpo.rewards.base import RewardFunc, SafeReward

logger = logging.getLogger(__name__)

REWARDS: Registry[RewardFunc] = Registry("reward", entry_point_group="vlm_grpo.rewards")


def register_reward(name: str):
    """Decorator: ``@register_reward("accuracy")``."""
    return REWARDS.register(name)


REWARDS.register("accuracy", "vlm_grpo.rewards.accuracy:accuracy_reward")
REWARDS.register("format", "vlm_grpo.rewards.format:format_reward")
REWARDS.register("iou", "vlm_grpo.rewards.grounding:iou_reward")

REWARDS.register("vqa_graded", "vlm_grpo.rewards.accuracy:vqa_graded_reward")
REWARDS.register("format_explain", "vlm_grpo.rewards.format:format_explain_reward")
REWARDS.register("format_speaker", "vlm_grpo.rewards.listener:format_speaker_reward")
REWARDS.register("format_speaker_strict", "vlm_grpo.rewards.format:format_speaker_strict_reward")
REWARDS.register("format_rynnbrain", "vlm_grpo.rewards.format:format_rynnbrain_reward")
REWARDS.register("iou_threshold", "vlm_grpo.rewards.grounding:iou_threshold_reward")
REWARDS.register("od_ap", "vlm_grpo.rewards.detection:od_ap_reward")
REWARDS.register("od_ap50", "vlm_grpo.rewards.detection:od_ap50_reward")
REWARDS.register("od_length", "vlm_grpo.rewards.detection:od_length_reward")
REWARDS.register("weighted_sum", "vlm_grpo.rewards.detection:weighted_sum_reward")
REWARDS.register("rynn_trajectory", "vlm_grpo.rewards.rynnbrain:rynn_trajectory_reward")
REWARDS.register("rynn_affordance", "vlm_grpo.rewards.rynnbrain:rynn_affordance_reward")
REWARDS.register("rynn_area", "vlm_grpo.rewards.rynnbrain:rynn_area_reward")
REWARDS.register("rynn_counting", "vlm_grpo.rewards.rynnbrain:rynn_counting_reward")
REWARDS.register("rynn_segment", "vlm_grpo.rewards.rynnbrain:rynn_segment_reward")
REWARDS.register("rynn_general", "vlm_grpo.rewards.rynnbrain:rynn_general_reward")
REWARDS.register("rynnbrain", "vlm_grpo.rewards.rynnbrain:rynnbrain_reward")
REWARDS.register("explanation", "vlm_grpo.rewards.explanation:explanation_reward")
REWARDS.register("length", "vlm_grpo.rewards.shaping:length_reward")
REWARDS.register("one_sentence", "vlm_grpo.rewards.shaping:one_sentence_reward")
REWARDS.register("repetition", "vlm_grpo.rewards.shaping:repetition_reward")
REWARDS.register("overlong", "vlm_grpo.rewards.shaping:overlong_reward")
REWARDS.register("accuracy_format", "vlm_grpo.rewards.batch:accuracy_format_reward")

# served-model rewards
REWARDS.register("listener", "vlm_grpo.rewards.listener:listener_reward")
REWARDS.register("http", "vlm_grpo.rewards.http_endpoint:http_reward")
REWARDS.register("llm_judge", "vlm_grpo.rewards.judge:llm_judge_reward")


def check_requirements(name: str, fn: Callable) -> None:
    """A reward that needs an optional package declares ``fn.requires = {"module": "extra"}``; say which extra to
    install before the run starts rather than failing on every sample."""
    for module, extra in getattr(fn, "requires", {}).items():
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"Reward '{name}' needs the '{module}' package: pip install 'vlm-grpo[{extra}]'")


def parse_reward_kwargs(value: str | Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``--reward_kwargs``: reward label (or entry) -> keyword arguments."""
    return parse_kwargs_by_name(value, "--reward_kwargs", '{"iou": {"threshold": 0.5}}')


# The reward names of our users' own systems, where they mean something else here. Used only when asked for
# (``--reward_aliases vivqa_x``): the seed's name is kept as the label and the mapping is logged.
SEED_ALIASES: dict[str, dict[str, str]] = {
    # ViVQA-X on InternVL: graded answer match, think/answer/explain layout, CIDEr(+CLIP) of the explanation.
    "vivqa_x": {"accuracy": "vqa_graded", "format": "format_explain", "explanation": "explanation"},
    # Lewis game speaker: the listener's pick, the speaker's tag layout, one-sentence descriptions.
    "lewis": {"accuracy": "listener", "format": "format_speaker", "length": "one_sentence"},
}


def apply_seed_aliases(entries: Sequence[str], seed: str | None) -> list[str]:
    """``--reward_funcs`` entries with a seed's names written as ``seed_name=our_name`` (see ``SEED_ALIASES``)."""
    if not seed:
        return list(entries)
    if seed not in SEED_ALIASES:
        raise ValueError(f"Unknown --reward_aliases '{seed}'. Available: {', '.join(sorted(SEED_ALIASES))}")
    table = SEED_ALIASES[seed]
    out = []
    for entry in entries:
        if entry in table and table[entry] != entry:
            logger.info("--reward_aliases %s: reward '%s' is %s's name for '%s'", seed, entry, seed, table[entry])
            out.append(f"{entry}={table[entry]}")
        else:
            out.append(entry)
    return out


_ALIAS = re.compile(r"([A-Za-z_][\w.\-]*)=(.+)")


def reward_labels(entries: Sequence[str]) -> list[tuple[str, str]]:
    """``(label, spec)`` for each ``--reward_funcs`` entry; the label names its metrics and its ``--reward_kwargs``.

    A registered name is its own label; ``path/file.py:fn`` / ``package.module:fn`` is labelled ``fn`` when no other
    entry has that name, else ``file.fn`` (the file's stem or the module's last part); ``name=spec`` sets the label.
    Two entries with one label are refused.
    """
    parsed = []
    for entry in entries:
        alias = _ALIAS.fullmatch(entry)
        parsed.append((alias.group(1), alias.group(2)) if alias else (None, entry))
    short = [spec.rpartition(":")[2] if ":" in spec else spec for _, spec in parsed]
    labels = []
    for (alias, spec), name in zip(parsed, short, strict=True):
        if alias is None and ":" in spec and short.count(name) > 1:
            target = spec.rpartition(":")[0]
            stem = Path(target).stem if target.endswith(".py") else target.rpartition(".")[2]
            name = f"{stem}.{name}"
        labels.append((alias or name, spec))
    seen: dict[str, str] = {}
    for (label, _), entry in zip(labels, entries, strict=True):
        if label in seen:
            raise ValueError(
                f"--reward_funcs entries '{seen[label]}' and '{entry}' would both log as '{label}': give one a name, "
                f"e.g. my_{label.replace('.', '_')}={entry}"
            )
        seen[label] = entry
    return labels


def build_reward_funcs(
    names: Sequence[str],
    overrides: Mapping[str, str | Callable] | None = None,
    reward_kwargs: str | Mapping[str, Any] | None = None,
    max_failed_batches: int = 5,
    processing_class: Any = None,
    seed_aliases: str | None = None,
) -> list[SafeReward]:
    """Resolve ``--reward_funcs`` entries (registered names, ``file.py:fn`` / ``module:fn`` specs, ``name=spec``)
    into safe callables for TRL, labelled as :func:`reward_labels` says.

    ``overrides`` (a VLM module's own variants, name -> callable or ``module:attr``) win over the registry.
    ``reward_kwargs`` (label, or the entry as written -> keyword arguments) are bound to the reward, e.g.
    ``{"vqa_graded": {"scale": 3}}``. ``max_failed_batches``: see :class:`SafeReward`. A reward with a
    ``processing_class`` or ``tokenizer`` parameter gets the run's processor / its tokenizer there (VLM-R1's
    length rewards count tokens). ``seed_aliases``: read the entries with a seed's reward names
    (:data:`SEED_ALIASES`).
    """
    names = apply_seed_aliases(names, seed_aliases)
    labels = reward_labels(names)
    keys = {}
    for i, (entry, (label, spec)) in enumerate(zip(names, labels, strict=True)):
        for key in (label, spec, entry):
            keys.setdefault(key, i)
    bound: dict[int, dict[str, Any]] = {}
    for key, kwargs in parse_reward_kwargs(reward_kwargs).items():
        if key not in keys:
            raise ValueError(
                f"--reward_kwargs names reward '{key}', which is not in --reward_funcs (labels: "
                f"{', '.join(label for label, _ in labels)})"
            )
        bound.setdefault(keys[key], {}).update(kwargs)
    context = {}
    if processing_class is not None:
        tokenizer = getattr(processing_class, "tokenizer", processing_class)  # a text-only run passes the tokenizer
        context = {"processing_class": processing_class, "tokenizer": tokenizer}
    funcs = []
    for i, (label, spec) in enumerate(labels):
        fn = (overrides or {}).get(spec) or REWARDS.get(spec)
        if isinstance(fn, str):
            fn = load_object(fn)
        if not callable(fn):
            raise TypeError(f"Reward '{spec}' resolved to {fn!r}, which is not callable")
        check_requirements(label, fn)
        if i in bound:
            fn = functools.partial(fn, **bound[i])
        funcs.append(SafeReward(fn, label, max_failed_batches=max_failed_batches, context=context))
    if len(funcs) == 1:  # EasyR1's setup: its metric names (reward/overall, ...) then mean the same
        funcs[0].easyr1_metric_names = True
    return funcs
