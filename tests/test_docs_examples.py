"""The docs' runnable examples: every ```bash block right after a `<!-- docs-test -->` line in docs/ runs as written.

Each block runs under `bash -euo pipefail` in a fresh temporary folder, with `REPO` (the repository root), `TINY`
(tiny models of all four families, built once for this module), the venv's bin first on PATH and one torch thread.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MARKER = "<!-- docs-test -->"
BLOCK = re.compile(r"^<!-- docs-test -->[ \t]*\n```bash[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
TIMEOUT_S = 600  # a block should finish in well under 40 s on one idle core; this only stops a hang
PARALLEL = 2  # blocks run two at a time (each is one process on one thread): the file runs on one xdist worker


def docs_blocks(root: Path = DOCS) -> list[tuple[str, str]]:
    """``(page:line, script)`` of every marked block; a marker not followed by a ```bash block is an error."""
    found = []
    for page in sorted(root.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        starts = {m.start() for m in BLOCK.finditer(text)}
        for m in re.finditer(r"^<!-- docs-test -->[ \t]*$", text, re.M):  # a line of its own, not inline text
            line = text.count("\n", 0, m.start()) + 1
            where = f"{page.relative_to(root).as_posix()}:{line}"
            if m.start() not in starts:
                raise AssertionError(f"{where}: {MARKER} is not followed by a ```bash block")
        for m in BLOCK.finditer(text):
            found.append((f"{page.relative_to(root).as_posix()}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return found


BLOCKS = docs_blocks()


@pytest.fixture(scope="module")
def tiny_dir(tiny_models) -> Path:
    """Tiny models of every family (`$TINY/<family>`, as `vlm-grpo-tiny --family all` lays them out), built once."""
    folders = {family: tiny_models[family] for family in tiny_models}
    assert all(path == tiny_models.root / family for family, path in folders.items())
    return tiny_models.root


def run_block(script: str, cwd: Path, tiny: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "REPO": str(REPO),
        "TINY": str(tiny),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p),
    }
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)  # fmt: skip


def test_the_docs_have_runnable_examples():
    pages = {where.split(":")[0] for where, _ in BLOCKS}
    assert {
        "guides/vlm-r1.md",
        "guides/vivqa-x-internvl.md",
        "getting-started/your-own-data.md",
        "concepts/rewards.md",
    } <= pages


@pytest.fixture(scope="module")
def block_runs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Every block started at once on a pool of PARALLEL, each in its own fresh folder; tests wait for their own."""
    with ThreadPoolExecutor(PARALLEL) as pool:
        yield {
            where: pool.submit(run_block, script, tmp_path_factory.mktemp("docs_example"), tiny_dir)
            for where, script in BLOCKS
        }


@pytest.mark.parametrize("where", [where for where, _ in BLOCKS])
def test_docs_example_runs(where: str, block_runs: dict[str, Future]):
    result = block_runs[where].result()
    assert result.returncode == 0, f"{where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def test_a_failing_block_fails(tmp_path: Path):
    """Negative control: the runner sees a failing command in the middle of a block (-e) and in a pipe (pipefail)."""
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(f"x\n\n{MARKER}\n```bash\nfalse | cat\necho after\n```\n\n```bash\nfalse\n```\n")
    blocks = docs_blocks(page.parent)
    assert [where for where, _ in blocks] == ["page.md:3"]  # the unmarked block is not collected
    assert run_block(blocks[0][1], tmp_path, tmp_path).returncode != 0
    page.write_text(f"mention `{MARKER}` inline\n\n{MARKER}\n```python\nprint(1)\n```\n")
    with pytest.raises(AssertionError, match=r"page\.md:3: .* is not followed by a ```bash block"):
        docs_blocks(page.parent)
