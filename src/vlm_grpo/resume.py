"""What ``--resume_from_checkpoint`` means, decided once, before any model is loaded; and when a
checkpoint counts as complete.

* not given / false  -> a fresh run; refused if output_dir already holds checkpoints (unless
  ``--overwrite_output_dir``, which removes them), so an old run is never silently continued.
* ``true`` / ``latest`` -> the newest COMPLETE ``checkpoint-N`` in output_dir (broken newer ones are
  skipped with a warning naming them); a fresh run, with an info line, when there is none yet
  (VLM-R1 scripts pass ``--resume_from_checkpoint True`` on their first run).
* a path             -> that checkpoint, if complete; else an error naming the broken file and the
  newest complete checkpoint beside it.

Completeness is a marker file (:data:`COMPLETE_MARKER`) written last, after every rank has written
its files, listing each file with its size. A marker rather than write-to-temp-then-rename because
transformers' ``Trainer`` (and DeepSpeed, on every rank) writes straight into ``checkpoint-N`` and
other code (rotation, best-model tracking, hub pushes) refers to that name: redirecting the writes
to a temporary folder would mean copying ``Trainer._save_checkpoint``. The marker costs one small
file, and the sizes it lists let a later truncation be named file by file. Checkpoints written by
other tools (plain transformers, VLM-R1) have no marker: they are checked structurally instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path

from vlm_grpo.cli_errors import UserError

logger = logging.getLogger(__name__)

_FALSE = {"", "false", "no", "none", "0", "off"}
_LATEST = {"true", "latest", "yes", "1", "on"}

COMPLETE_MARKER = "checkpoint_complete.json"
_WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")
_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class ResumeError(UserError, ValueError):
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


def mark_complete(checkpoint: str | Path) -> None:
    """Flush every file of a finished checkpoint to disk, then write the marker (atomically, last)."""
    root = Path(checkpoint)
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != COMPLETE_MARKER):
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
        files[path.relative_to(root).as_posix()] = path.stat().st_size
    step = int(root.name.rsplit("-", 1)[-1]) if re.fullmatch(r"checkpoint-\d+", root.name) else None
    tmp = root / f".{COMPLETE_MARKER}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"step": step, "files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / COMPLETE_MARKER)


def checkpoint_problem(checkpoint: str | Path) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (naming the file), or None when it is complete.

    Once a run of ours has marked any checkpoint in the folder, an unmarked sibling is a save that did not
    finish (even when its files look whole): only folders of other tools get the structural check.
    """
    root = Path(checkpoint)
    if not root.is_dir():
        return f"'{root}' is not a folder"
    marker = root / COMPLETE_MARKER
    if not marker.is_file() and any((p / COMPLETE_MARKER).is_file() for p in list_checkpoints(root.parent)):
        return f"{root} has no {COMPLETE_MARKER}: its save did not finish"
    if marker.is_file():
        try:
            files = json.loads(marker.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return f"{marker} is not a valid completion marker"
        for name, size in files.items():
            path = root / name
            if not path.is_file():
                return f"{path} is missing"
            if path.stat().st_size != size:
                return f"{path} has {path.stat().st_size} bytes, {size} were written"
        return None
    return _legacy_problem(root)


def _legacy_problem(root: Path) -> str | None:
    """A checkpoint without our marker (an older vlm-grpo, plain transformers, VLM-R1): the files a resume
    reads must exist and parse; a safetensors file must be as long as its header says."""
    if not any(root.iterdir()):
        return f"{root} is empty (killed while the checkpoint was being created)"
    state = root / "trainer_state.json"
    problem = _json_problem(state)
    if problem:
        return problem
    if (root / "config.json").exists() and (problem := _json_problem(root / "config.json")):
        return problem
    weights = [root / n for n in _WEIGHT_FILES if (root / n).exists()]
    for index in (root / n for n in _INDEX_FILES if (root / n).exists()):
        if problem := _json_problem(index):
            return problem
        weights += [root / n for n in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))]
    if not weights and not any(p.name.startswith("global_step") for p in root.iterdir()):
        return f"{root} holds no model weights (model.safetensors, adapter_model.safetensors, global_step*)"
    for path in weights:
        if not path.is_file():
            return f"{path} is missing"
        if path.suffix == ".safetensors" and (problem := _safetensors_problem(path)):
            return problem
        if path.stat().st_size == 0:
            return f"{path} is empty"
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        if (root / name).exists() and (root / name).stat().st_size == 0:
            return f"{root / name} is empty"
    return None


def _json_problem(path: Path) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        return f"{path} is not valid JSON ({path.stat().st_size} bytes; cut short by a kill?)"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A truncated safetensors file: shorter than its header's last tensor offset."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length)) if 8 + length <= size else None
    except (struct.error, ValueError, UnicodeDecodeError):
        header = None
    if header is None:
        return f"{path} is truncated ({size} bytes; its header is incomplete)"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"{path} is truncated ({size} of {8 + length + end} bytes)"
    return None


def newest_complete(output_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint in ``output_dir`` and the broken newer ones skipped, with why."""
    skipped = []
    for path in reversed(list_checkpoints(output_dir)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def checkpoint_step(checkpoint: str | Path) -> int | None:
    try:
        return int(json.loads((Path(checkpoint) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove_old_checkpoints(output_dir: str | Path, is_main_process: bool = True) -> None:
    """A fresh run under ``--overwrite_output_dir``: the checkpoints of the run it replaces go (main process)."""
    existing = list_checkpoints(output_dir)
    if existing and is_main_process:
        logger.warning("--overwrite_output_dir: removing %d old checkpoint(s) in %s", len(existing), output_dir)
        for path in existing:
            shutil.rmtree(path)


def resolve_resume(
    output_dir: str | Path,
    resume_from_checkpoint: str | bool | None,
    overwrite_output_dir: bool = False,
    is_main_process: bool = True,
    remove_old: bool = True,
) -> str | None:
    """The checkpoint path to resume from, or None for a fresh run. ``remove_old=False``: a fresh run under
    ``--overwrite_output_dir`` leaves the old checkpoints for :func:`remove_old_checkpoints`, called once every
    other check has passed (a typo found later must not have cost them)."""
    log = logger.info if is_main_process else logger.debug
    existing = list_checkpoints(output_dir)
    value = resume_from_checkpoint
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in _FALSE):
        if existing and not overwrite_output_dir:
            raise ResumeError(
                f"output_dir '{output_dir}' already holds {len(existing)} checkpoint(s) (newest: {existing[-1].name}) "
                "and no --resume_from_checkpoint was given. Choose one:\n"
                "  --resume_from_checkpoint true      continue from the newest complete checkpoint (also: latest)\n"
                "  --resume_from_checkpoint PATH      continue from a specific checkpoint folder\n"
                "  --overwrite_output_dir             start a fresh run there (removes the old checkpoints)\n"
                "  --output_dir OTHER_DIR             start a fresh run elsewhere"
            )
        if remove_old:
            remove_old_checkpoints(output_dir, is_main_process)
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in _LATEST):
        if not existing:
            log("--resume_from_checkpoint %s: no checkpoint in '%s' yet, starting a fresh run", value, output_dir)
            return None
        chosen, skipped = newest_complete(output_dir)
        if chosen is None:
            broken = "; ".join(problem for _, problem in skipped)
            raise ResumeError(
                f"--resume_from_checkpoint {value}: none of the {len(existing)} checkpoint(s) in '{output_dir}' is "
                f"complete ({broken}). Start again with --overwrite_output_dir (removes them) or another --output_dir."
            )
        if is_main_process:
            for path, problem in skipped:
                logger.warning("Skipping incomplete checkpoint %s: %s", path, problem)
        log("Resuming from %s (step %s)", chosen, checkpoint_step(chosen))
        return str(chosen)
    path = Path(str(value))
    if not path.is_dir():
        raise ResumeError(f"--resume_from_checkpoint: '{value}' is not a checkpoint folder")
    named_like_one = re.fullmatch(r"checkpoint-\d+", path.name) is not None
    if not named_like_one and not (path / "trainer_state.json").exists() and not (path / COMPLETE_MARKER).exists():
        raise ResumeError(
            f"--resume_from_checkpoint: '{value}' has no trainer_state.json; is it a checkpoint-N folder?"
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        newest, _ = newest_complete(path.parent)
        hint = (
            f"The newest complete checkpoint beside it is {newest}: pass --resume_from_checkpoint {newest} "
            "(or true for the newest complete one)."
            if newest is not None
            else "No complete checkpoint sits beside it; start a fresh run (--overwrite_output_dir)."
        )
        raise ResumeError(
            f"--resume_from_checkpoint {value}: this checkpoint is incomplete, probably written by a run that was "
            f"killed while saving: {problem}. {hint}"
        )
    log("Resuming from %s (step %s)", path, checkpoint_step(path))
    return str(path)
