"""What ``--resume_from_checkpoint`` means, decided once, before any model is loaded.

* not given / false  -> a fresh run; refused if output_dir already holds checkpoints (unless
  ``--overwrite_output_dir``, which removes them), so an old run is never silently continued.
* ``true`` / ``latest`` -> the newest ``checkpoint-N`` in output_dir.
* a path             -> that checkpoint.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

_FALSE = {"", "false", "no", "none", "0", "off"}
_LATEST = {"true", "latest", "yes", "1", "on"}


class ResumeError(ValueError):
    pass


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """``checkpoint-N`` folders, oldest first (by N, not by name)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := re.fullmatch(r"checkpoint-(\d+)", p.name))
    ]
    return [p for _, p in sorted(found)]


def resolve_resume(
    output_dir: str | Path,
    resume_from_checkpoint: str | bool | None,
    overwrite_output_dir: bool = False,
    is_main_process: bool = True,
) -> str | None:
    """The checkpoint path to resume from, or None for a fresh run."""
    existing = list_checkpoints(output_dir)
    value = resume_from_checkpoint
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _FALSE):
        if existing and not overwrite_output_dir:
            raise ResumeError(
                f"output_dir '{output_dir}' already holds {len(existing)} checkpoint(s) (newest: {existing[-1].name}) "
                "and no --resume_from_checkpoint was given. Choose one:\n"
                "  --resume_from_checkpoint true      continue from the newest checkpoint (also: latest)\n"
                "  --resume_from_checkpoint PATH      continue from a specific checkpoint folder\n"
                "  --overwrite_output_dir             start a fresh run there (removes the old checkpoints)\n"
                "  --output_dir OTHER_DIR             start a fresh run elsewhere"
            )
        if existing and is_main_process:
            logger.warning("--overwrite_output_dir: removing %d old checkpoint(s) in %s", len(existing), output_dir)
            for path in existing:
                shutil.rmtree(path)
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in _LATEST):
        if not existing:
            raise ResumeError(
                f"--resume_from_checkpoint {value}: output_dir '{output_dir}' holds no checkpoint-* folder "
                "to resume from"
            )
        return str(existing[-1])
    path = Path(str(value))
    if not path.is_dir():
        raise ResumeError(f"--resume_from_checkpoint: '{value}' is not a checkpoint folder")
    if not (path / "trainer_state.json").is_file():
        raise ResumeError(
            f"--resume_from_checkpoint: '{value}' has no trainer_state.json; is it a checkpoint-N folder?"
        )
    return str(path)
