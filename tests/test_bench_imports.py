"""Every name a benchmark script imports from another one exists there, including imports inside functions (which
only run on a GPU machine, where a missing name costs a device run)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _sibling_imports() -> list[tuple[str, str, str]]:
    siblings = {p.stem for p in BENCH.glob("*.py")}
    found = []
    for path in sorted([*BENCH.glob("*.py"), *BENCH.glob("micro/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in siblings:
                found += [(str(path.relative_to(BENCH)), node.module, alias.name) for alias in node.names]
    return found


def test_benchmark_imports_resolve():
    imports = _sibling_imports()
    assert any(name == "PEAK_TFLOPS" for _, _, name in imports)  # control: function-level imports are seen
    sys.path.insert(0, str(BENCH))
    try:
        missing = [
            f"{where}: from {module} import {name}"
            for where, module, name in imports
            if not hasattr(importlib.import_module(module), name)
        ]
    finally:
        sys.path.remove(str(BENCH))
    if missing:
        pytest.fail("names the benchmark scripts import do not exist: " + "; ".join(missing))
