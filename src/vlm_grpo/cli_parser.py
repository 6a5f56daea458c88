"""The command-line parser of the recipes: TRL's ``TrlParser`` reading other projects' command lines as their users
mean them, with every user mistake as one ``error:`` line."""

from __future__ import annotations

import functools
import json
import sys
from argparse import ArgumentDefaultsHelpFormatter
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import yaml
from trl import TrlParser

from vlm_grpo.cli_aliases import _CONFIG_UNUSED, _UNUSED, expand_flag_aliases, explain_unknown_flags
from vlm_grpo.cli_errors import UserError
from vlm_grpo.config_words import yaml_problem
from vlm_grpo.help_cache import HELP_WIDTH, store_help


class FlagError(UserError, ValueError):
    pass


class VLMParser(TrlParser):
    """TrlParser that reads VLM-R1 command lines as VLM-R1 users mean them.

    A boolean flag given bare (``--bf16``, ``--gradient_checkpointing``, ``--use_peft``) means ``true``:
    HfArgumentParser accepts that only for fields typed plain ``bool``, not ``bool | None`` ones such as
    TrainingArguments' ``bf16``. ``--deepspeed FILE`` is read here, so a missing or broken file is named
    before anything else runs. Other projects' spellings of our flags (``cli_aliases``: the Lewis seed's
    ``--lo_rank``, older scripts' ``--torch_dtype``) are rewritten first, for every recipe.
    """

    def __init__(self, dataclass_types: Any, **kwargs: Any) -> None:
        # Whole flag names only: argparse would take a unique prefix (``--report`` for ``--report_to``) as the
        # flag and an ambiguous one as an error printed under the whole usage; unknown here, it gets a hint.
        kwargs.setdefault("allow_abbrev", False)
        # One width whatever the terminal: the stored help (vlm_grpo.help_cache) is then the live one.
        kwargs.setdefault("formatter_class", functools.partial(ArgumentDefaultsHelpFormatter, width=HELP_WIDTH))
        super().__init__(dataclass_types, **kwargs)

    def error(self, message: str) -> NoReturn:
        """argparse's own errors (a missing value, a bad choice) as one ``error:`` line, not under the usage."""
        raise FlagError(f"{message} (--help lists every flag)")

    def parse_args_and_config(self, args: Sequence[str] | None = None, **kwargs: Any) -> tuple[Any, ...]:
        argv = self.with_bare_booleans(expand_flag_aliases(sys.argv[1:] if args is None else args))
        config = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
        try:
            return super().parse_args_and_config(args=argv, **kwargs)
        except yaml.YAMLError as exc:
            raise FlagError(f"--config {config}: not valid YAML: {yaml_problem(exc)}") from None
        except OSError as exc:
            if config is None or exc.filename != config:
                raise
            raise FlagError(f"--config {config}: cannot read it ({exc.strerror or exc})") from None
        except ValueError as exc:  # raised by the configs' own checks: about the flags the user gave
            known = {o for a in self._actions for o in a.option_strings if o.startswith("--")}
            raise FlagError(explain_unknown_flags(str(exc), known)) from exc

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        """An unknown flag is reported before the configs are built: their own checks would otherwise speak first,
        about a value the misspelt flag was meant to set (``--num_genrations 4`` -> "not divisible by 8")."""
        namespace, remaining = super().parse_known_args(args, namespace)
        if remaining:
            raise ValueError(f"{_UNUSED}{remaining}")
        return namespace, remaining

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        """The same for a key of the ``--config`` YAML that is no flag."""
        remaining = super().set_defaults_with_config(**kwargs)
        if remaining:
            raise ValueError(f"{_CONFIG_UNUSED}{remaining}")
        return remaining

    def print_help(self, file: Any = None) -> None:
        text = self.format_help()
        store_help(text)
        (file or sys.stdout).write(text)

    def boolean_flags(self) -> set[str]:
        """``--name`` of every boolean field, ``bool`` or ``bool | None``."""
        flags = set()
        for dataclass_type in self.dataclass_types:
            for f in fields(dataclass_type):
                spelled = str(f.type).replace(" ", "").replace("typing.", "")
                if f.type is bool or spelled in ("bool", "bool|None", "Optional[bool]", "Union[bool,None]"):
                    flags.update({f"--{f.name}", f"--{f.name.replace('_', '-')}"})
        return flags

    def with_bare_booleans(self, argv: list[str]) -> list[str]:
        flags = self.boolean_flags()
        out = []
        for i, arg in enumerate(argv):
            out.append(arg)
            if arg in flags and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
                out.append("true")
            if arg == "--deepspeed" and i + 1 < len(argv):
                check_deepspeed_config(argv[i + 1])
        return out


def check_deepspeed_config(value: str) -> None:
    """A ``--deepspeed`` path (not inline JSON / base64) must exist and hold JSON."""
    if value.lstrip().startswith("{") or not value.endswith(".json"):
        return
    path = Path(value)
    if not path.is_file():
        raise UserError(
            f"--deepspeed {value}: no such file (see local_scripts/zero2.json, zero3.json); or leave it out"
        )
    try:
        json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"--deepspeed {value}: not valid JSON ({exc}); fix the file") from None
