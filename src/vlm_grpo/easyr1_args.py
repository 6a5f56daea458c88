"""EasyR1's command line on ``vlm-grpo``: ``config=x.yaml section.key=value ...`` (OmegaConf style, as
``python3 -m verl.trainer.main`` takes it), or ``--config x.yaml`` with the same dotted overrides.

    vlm-grpo config=examples/config.yaml worker.rollout.n=8 data.train_files=geo.parquet [--flag value ...]

The EasyR1 config with its overrides applied is converted (:func:`vlm_grpo.convert_config.convert`) into a
temporary vlm-grpo YAML handed to ``--config``; ``--flag value`` arguments stay on the command line and win over
it. Each conversion note is logged. A setting that would train differently here stops the run with ``error:``
unless ``--accept_easyr1_differences`` is given.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vlm_grpo.cli_errors import UserError
from vlm_grpo.config_words import override_value, yaml_problem
from vlm_grpo.convert_config import (
    EASYR1_SECTIONS,
    ConfigError,
    apply_override,
    convert,
    is_easyr1_config,
    render,
)

logger = logging.getLogger("vlm_grpo")

ACCEPT_FLAG = "--accept_easyr1_differences"
_EVAL_FLAGS = ("eval_file_paths", "eval_strategy", "eval_steps", "eval_on_start")


def _is_override(arg: str) -> bool:
    key = arg.partition("=")[0]
    return "=" in arg and not arg.startswith("-") and key.split(".")[0] in EASYR1_SECTIONS and "." in key


def _read(path: str) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"config={path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise UserError(f"config={path}: not valid YAML: {yaml_problem(exc)}") from None


def _is_easyr1_file(path: str) -> bool:
    """``--config PATH`` names an EasyR1 YAML (any other file, broken YAML included, is TrlParser's to read, or to
    report as ``--config PATH``)."""
    try:
        return Path(path).is_file() and is_easyr1_config(_read(path))
    except UserError:
        return False


def _take_accept_flag(argv: list[str]) -> tuple[list[str], bool]:
    out, accept = [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == ACCEPT_FLAG:
            value = argv[i + 1] if i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false") else None
            accept = value is None or value.lower() == "true"
            i += 2 if value is not None else 1
            continue
        if arg.startswith(ACCEPT_FLAG + "="):
            accept = arg.partition("=")[2].lower() == "true"
        else:
            out.append(arg)
        i += 1
    return out, accept


def _eval_turned_off(argv: list[str]) -> bool:
    for i, arg in enumerate(argv):
        if arg == "--eval_strategy" and i + 1 < len(argv):
            return argv[i + 1] == "no"
        if arg.startswith("--eval_strategy="):
            return arg.partition("=")[2] == "no"
    return False


def easyr1_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with an EasyR1 config (``config=x.yaml`` or an EasyR1 ``--config``) and its dotted overrides
    replaced by ``--config <converted YAML>``; any other command line is returned unchanged."""
    argv, accept = _take_accept_flag(list(argv))
    rest: list[str] = []
    path, overrides = None, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("config=") and path is None:
            path = arg.partition("=")[2]
        elif arg == "--config" and i + 1 < len(argv) and path is None and _is_easyr1_file(argv[i + 1]):
            path = argv[i + 1]
            i += 1
        elif arg.startswith("--config=") and path is None and _is_easyr1_file(arg.partition("=")[2]):
            path = arg.partition("=")[2]
        elif _is_override(arg):
            overrides.append(arg)
        else:
            rest.append(arg)
        i += 1
    if path is None and not overrides:
        if accept:
            raise UserError(f"{ACCEPT_FLAG}: only with an EasyR1 config (config=x.yaml or section.key=value)")
        return argv
    if path is None and any(a == "--config" or a.startswith("--config=") for a in rest):
        raise UserError(
            f"EasyR1 overrides ({overrides[0]}, ...) apply to an EasyR1 config: pass it as config=x.yaml, or write "
            "the overrides as --flags of the vlm-grpo config"
        )
    config = _read(path) if path else {}
    if path and not is_easyr1_config(config):
        raise UserError(f"config={path}: not an EasyR1 config (top-level sections {', '.join(EASYR1_SECTIONS)})")
    source = f"config={path}" if path else "command line"
    try:
        for item in overrides:
            key, _, text = item.partition("=")
            apply_override(config, key, override_value(text))
        flags, notes = convert(config, accept_differences=accept)
    except ConfigError as exc:
        raise UserError(f"{source}{' (with its overrides)' if overrides else ''}: {exc}") from None
    if _eval_turned_off(rest) and "eval_file_paths" in flags:
        for flag in _EVAL_FLAGS:
            flags.pop(flag, None)
        notes.append("--eval_strategy no: data.val_files not loaded")
    project = (config.get("trainer") or {}).get("project_name")
    if project and "wandb" in (flags.get("report_to") or []):
        os.environ.setdefault("WANDB_PROJECT", str(project))
    for note in notes:
        logger.warning("EasyR1 %s: %s", source, note)
    handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="easyr1_", delete=False, encoding="utf-8")
    with handle:
        handle.write(render(flags, notes, source + (" " + " ".join(overrides) if overrides else "")))
    return ["--config", handle.name, *rest]
