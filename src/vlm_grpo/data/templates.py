"""``--format_prompt FILE.jinja``: the user prompt rendered from the row by a sandboxed Jinja template.

EasyR1 renders its ``format_prompt`` templates with the question as ``content``; here the template also
sees ``prompt`` (the same text), ``answer`` (the solution), ``images`` (the image paths / URIs) and every
column of the row, so EasyR1's templates work unchanged and new ones can use any column. Rendering runs in
Jinja's immutable sandbox (no access to Python internals such as ``__class__``), with undefined names an
error. A syntax error stops the run naming ``file:line``; a row the template cannot render is a bad row
(``source: field 'format_prompt': file:line: reason``), reported or skipped like any other.

The rendered text replaces the question (``<image>`` markers in it place the images, and it is what
``--max_prompt_length`` counts); the model family's task template is not applied on top of it.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from vlm_grpo.data.formats import RowError


class TemplateError(ValueError):
    """A template that does not load (syntax error, missing file)."""


class PromptTemplate:
    """One ``.jinja`` file, loaded once and rendered per row."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(Path(path).resolve())
        if not Path(self.path).is_file():
            raise TemplateError(f"--format_prompt: template file not found: {path}")
        env = ImmutableSandboxedEnvironment(
            loader=jinja2.FileSystemLoader(str(Path(self.path).parent)),
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=False,
            autoescape=False,
        )
        try:
            self.template = env.get_template(Path(self.path).name)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{self.path}:{exc.lineno}: template syntax error: {exc.message}") from exc

    def _line_of(self, exc: BaseException) -> int | None:
        """The template line a render error happened on (Jinja maps its frames back to the file)."""
        lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == self.path]
        return lines[-1] if lines else None

    def render(self, row: dict[str, Any], raw: dict[str, Any] | None = None) -> str:
        """The prompt text of a canonical ``row``; ``raw`` (the row as read) adds its own columns."""
        context = {k: v for k, v in (raw or {}).items() if not isinstance(v, (bytes, bytearray))}
        context.update(
            {
                "content": row["question"],
                "prompt": row["question"],
                "answer": row["solution"],
                "images": list(row["image_path"]),
                "system": row.get("system"),
                "task_type": row.get("task_type"),
            }
        )
        try:
            return self.template.render(**context).strip()
        except Exception as exc:  # UndefinedError, SecurityError, TypeError from a filter, ...
            line = self._line_of(exc)
            where = f"{self.path}:{line}" if line else self.path
            raise RowError("format_prompt", f"{where}: {type(exc).__name__}: {exc}") from exc
