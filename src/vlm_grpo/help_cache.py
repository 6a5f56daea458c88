"""``--help`` of the training recipes in milliseconds, without importing torch: the text, stored with what it
was built from, printed only when that matches what is installed now.

Building the help needs TRL's and transformers' config classes, i.e. importing torch, transformers, TRL and
peft: seconds, for a text that changes only when those packages or vlm-grpo's own code do. So the text is
stored with a key: the Python version, the versions of those packages, and a digest of the contents of every
vlm-grpo source file that was loaded to build the parser (a change to any of them, an added import included,
changes the key). It is looked up in two places:

* the package's ``help/<program>.json``, written by ``python -m vlm_grpo.help_cache`` (a test checks that
  it is current, so it cannot drift from the dataclasses);
* the user's cache (``$XDG_CACHE_HOME/vlm_grpo``, else ``~/.cache/vlm_grpo``), written by every slow ``--help``.

A key that does not match (other package versions, edited sources) means the slow path, which builds the
help from the live parser and stores it. ``VLM_GRPO_HELP_CACHE=0`` always takes the slow path. The text is
formatted :data:`HELP_WIDTH` columns wide whatever the terminal, so a stored text is the live one.
Standard library only (and the standard-library-only ``cli_errors``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

from vlm_grpo.cli_errors import run_cli

HELP_WIDTH = 78  # the help's width in columns whatever the terminal (argparse's for an 80-column one)
_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate")
_PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED_DIR = _PACKAGE_DIR / "help"
# Programs whose help is shipped: the name argparse prints (the console script) -> the module whose cli() builds it.
RECIPES = {"vlm-grpo": "vlm_grpo.grpo_jsonl", "vlm-grpo-sft": "vlm_grpo.sft_jsonl"}


def environment_key(sources: Sequence[str]) -> str:
    """Digest of the Python version, the installed versions of :data:`_PACKAGES` and the contents of ``sources``
    (paths relative to the package)."""
    digest = hashlib.sha256(f"python {sys.version_info[0]}.{sys.version_info[1]};".encode())
    for name in _PACKAGES:
        try:
            digest.update(f"{name}={metadata.version(name)};".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{name}=-;".encode())
    for rel in sorted(sources):
        try:
            content = hashlib.sha256((_PACKAGE_DIR / rel).read_bytes()).hexdigest()
        except OSError:
            content = "-"
        digest.update(f"{rel}:{content};".encode())
    return digest.hexdigest()


def loaded_sources() -> list[str]:
    """The package's source files loaded in this process (relative paths): what a parser built now came from."""
    found = set()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and (name == "vlm_grpo" or name.startswith("vlm_grpo.")):
            try:
                found.add(Path(file).resolve().relative_to(_PACKAGE_DIR).as_posix())
            except ValueError:  # another copy of the package: not what the stored text is checked against
                continue
    return sorted(found)


def program() -> str:
    return Path(sys.argv[0]).name


def _user_cache(prog: str, cache_home: str | None = None) -> Path:
    root = Path(cache_home or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm_grpo"
    return root / f"help-{prog.replace(os.sep, '_')}.json"


def _matching_text(path: Path) -> str | None:
    """The stored text at ``path`` when its key matches this environment, else None."""
    try:
        entry = json.loads(path.read_text())
        sources, key, text = entry["sources"], entry["key"], entry["text"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(text, str) or not isinstance(sources, list) or key != environment_key(sources):
        return None
    return text


def wants_help(argv: Sequence[str] | None) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "-h" in args or "--help" in args


def stored_help(prog: str) -> str | None:
    """The shipped or cached help of ``prog`` valid for this environment, or None (then the slow path)."""
    if os.environ.get("VLM_GRPO_HELP_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    return _matching_text(SHIPPED_DIR / f"{prog}.json") or _matching_text(_user_cache(prog))


def print_cached_help(argv: Sequence[str] | None = None) -> bool:
    """Print the stored ``--help`` text of this program when ``argv`` asks for help; True when printed."""
    if not wants_help(argv):
        return False
    text = stored_help(program())
    if text is None:
        return False
    sys.stdout.write(text)
    return True


def answer_help(argv: Sequence[str] | None, parse: Callable[[list[str]], object]) -> bool:
    """A recipe's ``--help``: the stored text when it matches what is installed, else ``parse`` (the live parser)
    prints it. True when help was asked for."""
    if not wants_help(argv):
        return False
    if not print_cached_help(argv):
        run_cli(parse, argv)
    return True


def _entry(text: str) -> str:
    sources = loaded_sources()
    return json.dumps({"key": environment_key(sources), "sources": sources, "text": text}, indent=1) + "\n"


def store_help(text: str) -> None:
    """Keep ``text``, built by the live parser, for the next ``--help`` (best effort: a read-only home just
    means no cache)."""
    path = _user_cache(program())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(_entry(text))
        os.replace(tmp, path)
    except OSError:
        pass


def build_entry(prog: str) -> str:
    """The stored form of ``prog``'s help, built by the live parser in a fresh interpreter (only the modules the
    parser needs loaded): what ``help/<prog>.json`` holds."""
    code = (
        "import sys; sys.argv[0] = sys.argv[1]; import importlib; "
        f"importlib.import_module({RECIPES[prog]!r}).cli(['--help'])"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "XDG_CACHE_HOME": cache, "VLM_GRPO_HELP_CACHE": "0"}
        subprocess.run([sys.executable, "-c", code, prog], env=env, check=True, stdout=subprocess.DEVNULL)
        return _user_cache(prog, cache).read_text()


def main(argv: Sequence[str] | None = None) -> None:
    """Rewrite the shipped help texts (``python -m vlm_grpo.help_cache``): after a change to a config class."""
    for prog in argv or RECIPES:
        path = SHIPPED_DIR / f"{prog}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(build_entry(prog))
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
