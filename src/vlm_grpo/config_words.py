"""What the config converters share: reading a ``key=value`` word's value as Hydra / OmegaConf read it, a YAML
error on one line, and writing a converted config with its notes."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

_NOT_NUMBERS = ("nan", "inf", "-inf", "infinity")


def override_value(text: str) -> Any:
    """A dotted override's value as OmegaConf reads it: YAML scalars and lists, plus numbers YAML 1.1 keeps as text
    (``1e-3``, ``2e-6``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value) if value.strip().lower() not in _NOT_NUMBERS else value
        except ValueError:
            return value
    return value


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML parse error on one line: ``line L, column C: problem`` (PyYAML's own text spans five lines)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def write_converted(text: str, output: str | None, notes: Sequence[str]) -> int:
    """The converted YAML to ``output`` (stdout when None), each note on stderr; the exit status."""
    if output:
        Path(output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
