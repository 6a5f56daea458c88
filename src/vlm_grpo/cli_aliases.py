"""Command-line spellings other projects' scripts use for our flags, rewritten before parsing.

The Lewis-game seed passes ``--lo_rank / --lo_alpha / --lo_dropout``; they mean TRL's ``--lora_r /
--lora_alpha / --lora_dropout`` exactly. VLM-R1's older run scripts (``grpo_rec.py``) and open-r1's pass
``--torch_dtype bfloat16``: TRL's ``ModelConfig`` field was renamed ``dtype``, with the same meaning. RynnBrain's
SFT and older scripts pass ``--warmup_ratio R``: transformers 5 reads ``--warmup_steps R`` with R below 1 as that
ratio of the total steps (a ratio of 1 or more is refused). So all are
plain synonyms (each rewrite is logged). Giving both spellings of one flag is an error rather than a silent pick.

RynnBrain's SFT script (RynnScale's ``easy_vlm.api.train``) passes ``--model_path`` (the checkpoint:
``--model_name_or_path``), ``--data_mixture`` (its training file(s): ``--data_file_paths``, ':'-separated),
``--model_max_length`` (the longest sequence in tokens: SFT's ``--max_length``) and ``--use_multimodal_thinking``
(images inside the thinking turn). Only the last one's default, false, can be honoured here: SFT rows' thinking is
text, so ``--use_multimodal_thinking false`` is accepted (logged) and ``true`` is an error saying so.
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
    "--model_path": "--model_name_or_path",
    "--data_mixture": "--data_file_paths",
    "--model_max_length": "--max_length",
    # transformers 5 folded warmup_ratio into warmup_steps: a value below 1 is a ratio of the total steps
    "--warmup_ratio": "--warmup_steps",
}

# Boolean flags of other projects whose one value we honour by doing nothing (the flag is then removed, logged);
# the other value is an error: (value we honour, why, what to do instead).
HONOURED_ONLY_AS: dict[str, tuple[bool, str, str]] = {
    "--use_multimodal_thinking": (
        False,
        "the thinking turn is text only here",
        "RynnScale's multimodal thinking (images inside the thinking turn) is not supported: pass "
        "--use_multimodal_thinking false or leave it out (vlm-grpo-data preprocess --keep_images appends a thinking "
        "turn's images to the prompt instead)",
    ),
}
_TRUE, _FALSE = ("true", "1", "yes", "y", "t"), ("false", "0", "no", "n", "f")


def _drop_honoured_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` without the :data:`HONOURED_ONLY_AS` flags given their honoured value; SystemExit for the other."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        rule = HONOURED_ONLY_AS.get(flag)
        if rule is None:
            out.append(argv[i])
            i += 1
            continue
        if not eq:  # a bare flag means true; else the next word is its value
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else "true"
            i += 1 + has_value
        else:
            i += 1
        honoured, why, instead = rule
        if value.lower() not in (_TRUE + _FALSE):
            raise SystemExit(f"error: {flag} {value}: expected true or false")
        if (value.lower() in _TRUE) != honoured:
            raise SystemExit(f"error: {flag} {value}: {instead}")
        logger.info("%s %s: nothing to change (%s)", flag, value, why)
    return out


def expand_flag_aliases(argv: Sequence[str]) -> list[str]:
    """``argv`` with every alias (``--lo_rank 8`` or ``--lo_rank=8``) written as the flag it stands for."""
    out: list[str] = []
    seen: dict[str, str] = {}
    for arg in _drop_honoured_flags(argv):
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
    # RynnScale's --model_max_length is read as --max_length, which only the SFT recipe has
    "--max_length": "an SFT flag (vlm-grpo-sft; RynnScale's --model_max_length): GRPO bounds prompts with "
    "--max_prompt_length and completions with --max_completion_length",
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
