"""``vlm-grpo --help`` and ``vlm-grpo-sft --help`` answer without importing torch, from a stored text that is the
live parser's (it cannot drift), and never from a text built for other package versions or other sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_grpo import help_cache

SRC = Path(__file__).resolve().parents[1] / "src"
STALE = "stale: after a change to the flags or the pinned packages, run `python -m vlm_grpo.help_cache`"


def _help(prog: str, cache_home: Path, **env: str) -> tuple[str, bool]:
    """(stdout of ``prog --help``, whether torch was imported) in a fresh interpreter."""
    code = (
        "import sys, importlib\n"
        "sys.argv[0] = sys.argv[1]\n"
        "try:\n"
        "    importlib.import_module(sys.argv[2]).cli(['--help'])\n"
        "finally:\n"
        "    print('torch' in sys.modules, file=sys.stderr)\n"
    )
    full_env = {**os.environ, "PYTHONPATH": str(SRC), "XDG_CACHE_HOME": str(cache_home), **env}
    result = subprocess.run(
        [sys.executable, "-c", code, prog, help_cache.RECIPES[prog]],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, result.stderr.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("prog", sorted(help_cache.RECIPES))
def test_help_answers_without_torch_from_the_shipped_text(prog, tmp_path):
    text, imported_torch = _help(prog, tmp_path)  # an empty user cache: only the shipped text can answer
    assert text.startswith(f"usage: {prog} ")
    assert not imported_torch, f"src/vlm_grpo/help/{prog}.json is {STALE}"
    assert not (tmp_path / "vlm_grpo").exists()


@pytest.mark.parametrize("prog", sorted(help_cache.RECIPES))
def test_the_shipped_text_is_the_live_parsers(prog, tmp_path):
    live, imported_torch = _help(prog, tmp_path, VLM_GRPO_HELP_CACHE="0", COLUMNS="200")  # any terminal width
    assert imported_torch  # the control: this one was built by the parser
    shipped = json.loads((help_cache.SHIPPED_DIR / f"{prog}.json").read_text())["text"]
    assert shipped == live, f"src/vlm_grpo/help/{prog}.json is {STALE}"
    assert "--num_generations" in live or prog == "vlm-grpo-sft"
    assert "--overwrite_output_dir" in live and "--report_to" in live
    stored = json.loads((tmp_path / "vlm_grpo" / f"help-{prog}.json").read_text())  # the slow path keeps it
    assert stored["text"] == live and stored["key"] == help_cache.environment_key(stored["sources"])


def _package_copy(tmp_path: Path, monkeypatch) -> Path:
    """The key is checked against a copy of the package's sources, so editing one does not touch the repo."""
    copy = tmp_path / "pkg"
    for rel in ("configs.py", "help_cache.py"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((SRC / "vlm_grpo" / rel).read_bytes())
    monkeypatch.setattr(help_cache, "_PACKAGE_DIR", copy)
    monkeypatch.setattr(help_cache, "SHIPPED_DIR", copy / "help")
    monkeypatch.setattr(help_cache, "loaded_sources", lambda: ["configs.py", "help_cache.py"])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["vlm-grpo", "--help"])
    return copy


def test_a_stored_text_is_used_only_while_its_sources_and_versions_are_unchanged(tmp_path, monkeypatch, capsys):
    copy = _package_copy(tmp_path, monkeypatch)
    help_cache.store_help("usage: vlm-grpo [-h] [--flag FLAG]\n")
    assert help_cache.print_cached_help(["--help"])
    assert capsys.readouterr().out == "usage: vlm-grpo [-h] [--flag FLAG]\n"
    assert not help_cache.print_cached_help(["--output_dir", "x"])  # no help asked for: nothing printed

    # other installed versions: the stored text may be wrong for them
    real_version = help_cache.metadata.version
    monkeypatch.setattr(help_cache.metadata, "version", lambda n: "9.9" if n == "transformers" else real_version(n))
    assert help_cache.stored_help("vlm-grpo") is None
    monkeypatch.setattr(help_cache.metadata, "version", real_version)
    assert help_cache.stored_help("vlm-grpo") is not None

    # an edited config file (a new flag, a changed help text)
    with open(copy / "configs.py", "a") as handle:
        handle.write("\n# a new field\n")
    assert help_cache.stored_help("vlm-grpo") is None
    assert not help_cache.print_cached_help(["--help"])


def test_the_shipped_text_is_refused_when_its_key_does_not_match(tmp_path, monkeypatch):
    _package_copy(tmp_path, monkeypatch)
    entry = {"sources": ["configs.py"], "key": help_cache.environment_key(["configs.py"]), "text": "usage: x\n"}
    (tmp_path / "pkg" / "help").mkdir()
    path = tmp_path / "pkg" / "help" / "vlm-grpo.json"
    path.write_text(json.dumps(entry))
    assert help_cache.stored_help("vlm-grpo") == "usage: x\n"
    monkeypatch.setenv("VLM_GRPO_HELP_CACHE", "0")
    assert help_cache.stored_help("vlm-grpo") is None
    monkeypatch.delenv("VLM_GRPO_HELP_CACHE")
    path.write_text(json.dumps({**entry, "key": "0" * 64}))
    assert help_cache.stored_help("vlm-grpo") is None
    path.write_text("{not json")
    assert help_cache.stored_help("vlm-grpo") is None
