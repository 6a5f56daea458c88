"""Command-line spellings other projects' scripts use for our flags, rewritten before parsing.

The Lewis-game seed passes ``--lo_rank / --lo_alpha / --lo_dropout``; they mean TRL's ``--lora_r /
--lora_alpha / --lora_dropout`` exactly. VLM-R1's older run scripts (``grpo_rec.py``) and open-r1's pass
``--torch_dtype bfloat16``: TRL's ``ModelConfig`` field was renamed ``dtype``, with the same meaning. RynnBrain's
SFT and older scripts pass ``--warmup_ratio R``: transformers 5 reads ``--warmup_steps R`` with R below 1 as that
ratio of the total steps (a ratio of 1 or more is refused). So all are
plain synonyms (each rewrite is logged). Giving both spellings of one flag is an error rather than a silent pick.
"""

from __future__ import annotations

import ast
import difflib
import logging
from collections.abc import Sequence

logger = logging.getLogger("vlm_grpo")

FLAG_ALIASES: dict[str, str] = {
    "--lo_rank": "--lora_r",
    "--lo_alpha": "--lora_alpha",
    "--lo_dropout": "--lora_dropout",
    "--torch_dtype": "--dtype",
    # transformers 5 folded warmup_ratio into warmup_steps: a value below 1 is a ratio of the total steps
    "--warmup_ratio": "--warmup_steps",
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
    for i, arg in enumerate(argv):  # a ratio of 1 or more would be read as a number of steps
        flag, eq, value = arg.partition("=")
        if flag == "--warmup_ratio":
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                ratio = float(value)
            except ValueError:
                continue  # the parser names the bad value
            if not 0.0 <= ratio < 1.0:
                raise SystemExit(f"error: --warmup_ratio {value}: a fraction of the training steps in [0, 1)")
    return out


# Flags of other projects' scripts that have no synonym here: what to pass instead.
FOREIGN_FLAGS: dict[str, str] = {
    "--image_root": "VLM-R1's grpo_rec.py flag; pass the folder as --image_folders DIR (':'-separated, one per "
    "--data_file_paths file or one for all)",
    "--max_output_token_length": "pass --max_completion_length N",
    "--custom_reward_weights": "pass TRL's --reward_weights W1 W2 ... (space-separated, one per --reward_funcs)",
}
_UNUSED = "Some specified arguments are not used by the HfArgumentParser: "  # transformers' words, command line
_CONFIG_UNUSED = "Unknown arguments from config file: "  # TRL's words, --config YAML keys


def explain_unknown_flags(message: str, known: set[str]) -> str:
    """HfArgumentParser's "not used" error (command line) or TrlParser's "unknown arguments" one (``--config``
    YAML) rewritten as what to change for each unknown flag or key; other errors as they are. ``known``: every
    flag the parser takes (close matches are offered for typos)."""
    prefix = next((p for p in (_UNUSED, _CONFIG_UNUSED) if message.startswith(p)), None)
    if prefix is None:
        return message
    in_config = prefix == _CONFIG_UNUSED
    try:
        remaining = ast.literal_eval(message[len(prefix) :].split("]", 1)[0] + "]")
    except (ValueError, SyntaxError):
        return message
    spelled = sorted({"--" + k[2:].replace("-", "_") for k in known})  # --a-b is --a_b's other spelling
    parts = []
    for token in remaining:
        flag = token.partition("=")[0]
        if not flag.startswith("-"):
            continue  # a value of the unknown flag before it
        hint = FOREIGN_FLAGS.get(flag)
        if in_config and flag in FLAG_ALIASES:  # the command line reads these; a YAML key is not rewritten
            hint = f"write {FLAG_ALIASES[flag][2:]}:, the name it stands for"
        if hint is None:
            close = difflib.get_close_matches("--" + flag.lstrip("-").replace("-", "_"), spelled, n=2, cutoff=0.75)
            hint = f"did you mean {' or '.join(close)}?" if close else "no such flag"
        parts.append(f"{flag[2:] if in_config else flag}: {hint}")
    if not parts:
        return f"unexpected values {remaining}: a value without its --flag, or a flag's value split by a space"
    if in_config:
        return "unknown key in the --config file: " + "; ".join(parts) + " (--help lists every flag; keys are flags)"
    return "unknown flag " + "; ".join(parts) + " (--help lists every flag)"
