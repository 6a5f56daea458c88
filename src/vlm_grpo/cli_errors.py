"""How every command line ends on a user error: ``error: <what, where, how to fix>`` and exit status 2.

A traceback tells a user nothing they can act on when the cause is their flag, path or file; it is
kept for bugs, and for everything when ``--debug`` (bare) or ``VLM_GRPO_DEBUG=1`` is given. Standard
library only: every layer (data, serve, recipes) may import it.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

USER_ERROR_EXIT = 2
_PACKAGE_DIR = str(Path(__file__).resolve().parent)


class UserError(Exception):
    """An error in what the user gave (flag, path, file): printed as ``error: ...``, no traceback."""


def is_user_error(exc: BaseException) -> bool:
    """A ``UserError``; an ``OSError`` (a missing or unwritable path, a full disk, a model id the Hub cannot
    resolve: the user's environment, wherever it surfaces); or a ``ValueError`` our own code raised about the
    input (its innermost frame is in vlm_grpo). Anything else (TypeError, errors inside torch, ...) is a bug."""
    if isinstance(exc, (UserError, OSError)):
        return True
    if isinstance(exc, ValueError):
        frames = traceback.extract_tb(exc.__traceback__)
        return bool(frames) and str(Path(frames[-1].filename).resolve()).startswith(_PACKAGE_DIR)
    return False


def error_message(exc: BaseException) -> str:
    message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC and "No space left" not in message:
        message = f"no space left on the device ({message})"
    return str(message) or type(exc).__name__


def pop_debug_flag(argv: list[str]) -> bool:
    """Remove a bare ``--debug`` (no value after it) from ``argv``; ``--debug underflow_overflow`` stays
    for ``TrainingArguments.debug``."""
    found = False
    for i in reversed(range(len(argv))):
        if argv[i] == "--debug" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            del argv[i]
            found = True
    return found


def run_cli(entry: Callable[[list[str]], T], argv: Sequence[str] | None = None) -> T:
    """Run ``entry(argv)``; a user error prints ``error: ...`` to stderr and exits 2 (traceback with --debug)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = pop_debug_flag(args) or os.environ.get("VLM_GRPO_DEBUG", "").lower() not in ("", "0", "false")
    try:
        return entry(args)
    except Exception as exc:
        if debug or not is_user_error(exc):
            raise
        # On a line of its own: an error raised mid-training finds the progress bar's line unfinished.
        print(f"\nerror: {error_message(exc)}", file=sys.stderr, flush=True)
        raise SystemExit(USER_ERROR_EXIT) from None
