"""The reference pages, generated from the code so they cannot drift from it.

Every command line of ``[project.scripts]`` (dataclass flags with their ``help`` metadata, argparse options), every
registered reward, tool and model family (name, signature, docstring), and every error message a user can get (the
messages raised in ``src/vlm_grpo``). ``docs/hooks.py`` adds these pages to the site at build time;
``python docs/gen_reference.py OUT_DIR`` writes them as files (what the tests read).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

# Entry points whose flags come from config dataclasses (HfArgumentParser / TrlParser): "module:Class" names, looked
# up when the page is generated, so a field added to one of them appears without any edit here.
DATACLASS_CLIS: dict[str, list[str]] = {
    "vlm-grpo": [
        "vlm_grpo.configs:GRPOScriptArguments",
        "vlm_grpo.configs:VLMGRPOConfig",
        "vlm_grpo.configs:VLMModelConfig",
    ],
    "vlm-grpo-sft": [
        "vlm_grpo.configs:GRPOScriptArguments",
        "vlm_grpo.sft_trainer:VLMSFTConfig",
        "vlm_grpo.configs:VLMModelConfig",
    ],
    "vlm-grpo-eval": ["vlm_grpo.evaluate:EvalArguments"],
}

# Exception types whose message the command lines print as ``error: ...`` (cli_errors.is_user_error), besides every
# subclass of UserError found in the source.
USER_EXCEPTIONS = {
    "UserError", "ValueError", "OSError", "FileNotFoundError", "FileExistsError", "NotADirectoryError",
    "IsADirectoryError", "PermissionError", "SystemExit",
}  # fmt: skip


def _cell(text: Any) -> str:
    """One Markdown table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _doc(obj: Any) -> str:
    """An object's docstring as Markdown: Sphinx roles (``:func:`x```) become plain code spans."""
    return re.sub(r":(?:func|mod|class|meth|data|attr|obj):`~?([^`]+)`", r"`\1`", inspect.getdoc(obj) or "")


def _code(text: Any) -> str:
    text = _cell(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: command -> ``module:function``."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    table = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    return dict(re.findall(r'^([\w.-]+)\s*=\s*"([^"]+)"', table.group(1) if table else "", re.M))


# ----------------------------------------------------------------------------------------------- command lines


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        try:
            return repr(field.default_factory())
        except Exception:  # a factory that needs the environment: say what it is
            return f"{getattr(field.default_factory, '__name__', 'factory')}()"
    return "required"


def _defining_class(cls: type, name: str) -> type:
    """The most derived class of ``cls``'s MRO that declares (or re-declares) field ``name``."""
    for klass in cls.__mro__:
        if name in inspect.get_annotations(klass):
            return klass
    return cls


def _ours(klass: type) -> bool:
    return klass.__module__.split(".")[0] == "vlm_grpo"


def dataclass_section(command: str, specs: list[str]) -> str:
    own: list[str] = []
    inherited: dict[str, list[str]] = {}
    seen: set[str] = set()
    for spec in specs:
        cls = _resolve(spec)
        for field in dataclasses.fields(cls):
            if not field.init or field.name.startswith("_") or field.name in seen:
                continue
            seen.add(field.name)
            help_text = field.metadata.get("help", "")
            row = f"| `--{field.name}` | {_code(_default(field))} | {_cell(help_text)} |"
            klass = _defining_class(cls, field.name)
            if _ours(klass):
                own.append(row)
            else:
                inherited.setdefault(f"{klass.__module__.split('.')[0]}.{klass.__name__}", []).append(row)
    head = "| flag | default | what it does |\n|---|---|---|"
    classes = ", ".join(f"`{spec.split(':')[1]}`" for spec in specs)
    out = [f"## `{command}`\n", f"Flags from {classes}.\n"]
    out += [f"### vlm-grpo's flags ({len(own)})\n", head, *own, ""]
    for origin, rows in inherited.items():
        out += [f'??? note "Inherited from `{origin}` ({len(rows)} flags)"', ""]
        out += ["    " + line for line in (head.split("\n") + rows)]
        out.append("")
    return "\n".join(out)


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def capture_parser(target: str, prog: str) -> argparse.ArgumentParser:
    """The argparse parser behind entry point ``module:func``: ``build_parser()`` when the module has one, else the
    first parser the function parses with (caught before it parses anything)."""
    module_name, _, func_name = target.partition(":")
    module = importlib.import_module(module_name)
    if callable(getattr(module, "build_parser", None)):
        return module.build_parser()
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    argv = sys.argv
    sys.argv = [prog]
    try:
        func = getattr(module, "main", None) or getattr(module, func_name)
        try:
            func([])
        except TypeError:
            func()
    except _Captured as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_known_args = original  # type: ignore[method-assign]
        sys.argv = argv
    raise RuntimeError(f"{target} did not parse a command line")


def _action_help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%(" in text:
        try:
            text = text % {**vars(action), "prog": parser.prog, "default": action.default}
        except (KeyError, TypeError, ValueError):
            pass
    return text


def argparse_section(parser: argparse.ArgumentParser, title: str, level: int = 2) -> str:
    out = [f"{'#' * level} `{title}`\n"]
    if parser.description:
        out.append(_cell(parser.description) + "\n")
    rows, subs = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            subs.extend(action.choices.items())
            continue
        name = ", ".join(action.option_strings) or action.dest
        default = "required" if action.required else repr(action.default)
        if not action.option_strings:
            default = "positional"
        rows.append(f"| {_code(name)} | {_code(default)} | {_cell(_action_help(action, parser))} |")
    if rows:
        out += ["| option | default | what it does |", "|---|---|---|", *rows, ""]
    for name, sub in subs:
        out.append(argparse_section(sub, f"{title} {name}", min(level + 1, 4)))
    return "\n".join(out)


def cli_page() -> str:
    out = [
        "# Command lines\n",
        "Generated from the code at docs-build time: every entry point of `pyproject.toml` and every flag it takes. "
        "The training recipes also take a `--config FILE.yaml` whose keys are these flags' names.\n",
    ]
    for command, target in _scripts().items():
        if command in DATACLASS_CLIS:
            out.append(dataclass_section(command, DATACLASS_CLIS[command]))
        else:
            out.append(argparse_section(capture_parser(target, command), command))
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- registries


def _signature(obj: Callable) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _entry(name: str, obj: Any, extra: list[str]) -> str:
    doc = _doc(obj) or "(no docstring)"
    where = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"
    out = [f"## `{name}`\n", f"`{where}{_signature(obj)}`\n", *extra, doc, ""]
    return "\n".join(out)


def rewards_page() -> str:
    from vlm_grpo.rewards import REWARDS
    from vlm_grpo.rewards.base import reward_kind

    out = [
        "# Rewards\n",
        "Generated from the reward registry: every name `--reward_funcs` accepts, its signature (keyword "
        "parameters are set with `--reward_kwargs`), its calling convention and what it scores. "
        "See [Rewards and labels](../concepts/rewards.md) for how rewards are named, weighted and logged.\n",
        "| reward | kind | what it scores |",
        "|---|---|---|",
    ]
    sections = []
    for name in REWARDS.names():
        try:
            fn = REWARDS.get(name)
        except Exception as exc:  # an optional dependency missing where the docs are built
            out.append(f"| [`{name}`](#{name}) | ? | could not be loaded here: {_cell(exc)} |")
            sections.append(f"## `{name}`\n\nCould not be loaded where the docs were built: `{_cell(exc)}`.\n")
            continue
        first = _doc(fn).split("\n\n")[0]
        kind = reward_kind(fn)
        out.append(f"| [`{name}`](#{name.lower()}) | {kind} | {_cell(first)} |")
        sections.append(_entry(name, fn, [f"Kind: **{kind}**.\n"]))
    return "\n".join([*out, "", *sections])


def tools_page() -> str:
    from vlm_grpo.tools import TOOLS

    out = [
        "# Tools\n",
        "Generated from the tool registry: every name `--tools` accepts. The parameters after `env` (with their "
        "type hints and the docstring) are the JSON schema the model sees; options are set with `--tool_kwargs`. "
        "See the [tools guide](../guides/deepeyes-pyvision.md).\n",
    ]
    for name in TOOLS.names():
        try:
            out.append(_entry(name, TOOLS.get(name), []))
        except Exception as exc:
            out.append(f"## `{name}`\n\nCould not be loaded where the docs were built: `{_cell(exc)}`.\n")
    return "\n".join(out)


def families_page() -> str:
    from vlm_grpo.modules import VLM_MODULES

    out = [
        "# Model families\n",
        "Generated from the VLM-module registry. The family is picked from the checkpoint's `config.json` "
        "`model_type` (never from its path); `--vlm_module NAME` forces one. See "
        "[Model families](../concepts/model-families.md).\n",
        "| `model_type` | class | vision modules (frozen by `--freeze_vision_modules`) | LoRA targets |",
        "|---|---|---|---|",
    ]
    sections = []
    for name in VLM_MODULES.names():
        cls = VLM_MODULES.get(name)
        prefixes = ", ".join(f"`{p}`" for p in getattr(cls, "vision_prefixes", ())) or "-"
        targets = ", ".join(getattr(cls, "lora_targets", ())) or "-"
        out.append(f"| `{name}` | `{cls.__module__}.{cls.__name__}` | {prefixes} | {_cell(targets)} |")
        sections.append(f"## `{name}`\n\n{_doc(cls)}\n")
    return "\n".join([*out, "", *sections])


# ----------------------------------------------------------------------------------------------- error messages


def _message(node: ast.AST) -> str | None:
    """The text of a message expression, with ``{expr}`` where it interpolates; None when it is not text."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                parts.append("{" + ast.unparse(value.value) + "}")  # type: ignore[attr-defined]
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message(node.left), _message(node.right)
        return None if left is None or right is None else left + right
    return None


def _user_error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    bases: dict[str, set[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).split(".")[-1] for b in node.bases}
    found = set(USER_EXCEPTIONS)
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return found
        found |= more


def error_messages(src: Path = SRC) -> list[tuple[str, int, str, str]]:
    """``(file, line, exception, message)`` for every user-facing error raised in ``src/vlm_grpo``."""
    trees = {p: ast.parse(p.read_text(encoding="utf-8")) for p in sorted((src / "vlm_grpo").rglob("*.py"))}
    kinds = _user_error_classes(trees)
    found = []
    for path, tree in trees.items():
        rel = path.relative_to(src).as_posix()
        for node in ast.walk(tree):
            call = node.exc if isinstance(node, ast.Raise) else node
            if not isinstance(call, ast.Call) or not call.args:
                continue
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            is_parser_error = isinstance(node, ast.Call) and isinstance(func, ast.Attribute) and name == "error"
            if not (isinstance(node, ast.Raise) and name in kinds) and not is_parser_error:
                continue
            text = _message(call.args[0])
            if text and len(text) > 3:
                if name == "SystemExit":  # an exit status or a usage line is no error message
                    if not text.startswith("error: "):
                        continue
                    text = text.removeprefix("error: ")
                found.append((rel, node.lineno, "argparse" if is_parser_error else name, text))
    return sorted(found)


def errors_page() -> str:
    rows = error_messages()
    out = [
        "# Error messages\n",
        f"Generated from the source: the {len(rows)} messages a command line can end with, as "
        "`error: <message>` and exit status 2 (the data commands: `vlm-grpo-data <command>: error: ...`). "
        "`{...}` stands for the value filled in (a path, a flag, a row). "
        "[Troubleshooting](../troubleshooting.md) explains the common ones.\n",
    ]
    current = None
    for rel, line, kind, text in rows:
        if rel != current:
            out += ["", f"## `{rel}`\n", "| message | raised as | line |", "|---|---|---|"]
            current = rel
        out.append(f"| {_code(text)} | {kind} | {line} |")
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------------------------- pages


GENERATORS: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/rewards.md": rewards_page,
    "reference/tools.md": tools_page,
    "reference/model-families.md": families_page,
    "reference/errors.md": errors_page,
}


def pages() -> dict[str, str]:
    """Site path -> Markdown of every generated reference page."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    return {path: make() for path, make in GENERATORS.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the generated reference pages to OUT_DIR.")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    for path, text in pages().items():
        target = args.out_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        print(target)


if __name__ == "__main__":
    main()
