"""``--help`` of the training recipes in milliseconds: the text of the last ``--help``, kept on disk.

Building the help needs TRL's and transformers' config classes, i.e. importing torch, transformers, TRL
and peft: seconds, for a text that changes only when those packages or vlm-grpo's own code do. The text
is stored under ``~/.cache/vlm_grpo`` keyed by those versions and by vlm-grpo's source files (sizes and
mtimes); a stale or missing entry just means the slow path, which refreshes it. Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate")


def _cache_file(prog: str) -> Path:
    digest = hashlib.sha256(sys.version.encode())
    for name in _PACKAGES:
        try:
            digest.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=-;".encode())
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        digest.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_grpo"
    return root / f"help-{prog.replace(os.sep, '_')}-{digest.hexdigest()[:16]}.txt"


def wants_help(argv: Sequence[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "-h" in args or "--help" in args


def print_cached_help(argv: Sequence[str] | None = None) -> bool:
    """Print the stored ``--help`` text of this program when ``argv`` asks for help; True when printed."""
    if not wants_help(argv):
        return False
    try:
        text = _cache_file(Path(sys.argv[0]).name).read_text()
    except OSError:
        return False
    sys.stdout.write(text)
    return True


def store_help(text: str) -> None:
    """Keep ``text`` for the next ``--help`` (best effort: a read-only home just means no cache)."""
    path = _cache_file(Path(sys.argv[0]).name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        pass
