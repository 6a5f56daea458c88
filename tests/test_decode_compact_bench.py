"""The EasyR1-shaped benchmark reports the rows fast_decode computes against a decode at full width."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_shaped_run_reports_row_steps_against_full_width(tmp_path):
    out = tmp_path / "shape.json"
    shape = "easyr1_geo3k:prompts=4,image_size=56,max_completion=24,mean_completion=6,micro_batch=5"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_grpo.py"), "--preset", "tiny", "--device", "cpu",
        "--shape", shape, "--steps", "1", "--warmup", "0", "--trainers", "ours",
        "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    (compacted,) = (r["completion_stats"] for r in json.loads(out.read_text())["results"])
    # 20 rows ending at geometric lengths (mean 6, at most 24): most have ended at the first check (8 steps)
    assert 0 < compacted["decode_row_steps"] < 0.8 * compacted["decode_full_row_steps"], compacted
    assert "row-steps a cycle" in result.stdout

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from results_tables import shape_table
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    table = "\n".join(shape_table(json.loads(out.read_text())))
    assert "Decode rows computed (ours" in table and "of a decode at full width" in table
