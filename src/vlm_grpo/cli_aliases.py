"""Command-line spellings other projects' scripts use for our flags, rewritten before parsing.

The Lewis-game seed passes ``--lo_rank / --lo_alpha / --lo_dropout``; they mean TRL's ``--lora_r /
--lora_alpha / --lora_dropout`` exactly, so they are plain synonyms (each rewrite is logged). Giving both
spellings of one flag is an error rather than a silent pick.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger("vlm_grpo")

FLAG_ALIASES: dict[str, str] = {
    "--lo_rank": "--lora_r",
    "--lo_alpha": "--lora_alpha",
    "--lo_dropout": "--lora_dropout",
}


def expand_flag_aliases(argv: Sequence[str]) -> list[str]:
    """``argv`` with every alias (``--lo_rank 8`` or ``--lo_rank=8``) written as the flag it stands for."""
    out: list[str] = []
    seen: dict[str, str] = {}
    for arg in argv:
        flag, eq, value = arg.partition("=")
        target = FLAG_ALIASES.get(flag)
        canonical = target or flag
        if flag.startswith("--") and canonical in FLAG_ALIASES.values():
            if canonical in seen and seen[canonical] != flag:
                raise SystemExit(f"error: {seen[canonical]} and {flag} are the same option; pass only one of them")
            seen[canonical] = flag
        if target:
            logger.info("%s is read as %s", flag, target)
            arg = target + eq + value
        out.append(arg)
    return out
