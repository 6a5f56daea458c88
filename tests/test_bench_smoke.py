"""The benchmark harness runs on CPU with the tiny preset and reports both trainers (CI smoke test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_grpo_tiny_cpu_prints_both_rows(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_grpo.py"), "--preset", "tiny", "--device", "cpu",
        "--steps", "1", "--warmup", "1", "--num_generations", "4", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout[result.stdout.index("scenario") :]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [r[3] for r in rows] == ["vanilla", "ours"]  # the scenario "56px x1 C8" is three words
    payload = json.loads(out.read_text())
    assert [r["trainer"] for r in payload["results"]] == ["vanilla", "ours"]
    for r in payload["results"]:
        assert r["samples_per_s"] > 0 and r["phases_s"]["generation"] > 0 and r["completion_tokens"] > 0
