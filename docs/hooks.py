"""mkdocs hooks: add the pages generated at build time (docs/gen_reference.py's reference pages, the benchmark
tables of benchmarks/RESULTS.md and CHANGELOG.md) to the site, so none of them is a copy that can drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent


def _generator():
    spec = importlib.util.spec_from_file_location("vlm_grpo_docs_gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config) -> Files:
    pages = _generator().pages()
    pages["benchmarks.md"] = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    pages["changelog.md"] = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    for path, text in pages.items():
        files.append(File.generated(config, path, content=text))
    return files
