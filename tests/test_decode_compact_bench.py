"""The EasyR1-shaped benchmark reports the rows fast_decode computes against a decode at full width."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from e2e_utils import run_main

REPO = Path(__file__).resolve().parents[1]


def test_the_shaped_run_reports_row_steps_against_full_width(tmp_path, monkeypatch, capsys):
    out = tmp_path / "shape.json"
    shape = "easyr1_geo3k:prompts=4,image_size=56,max_completion=24,mean_completion=6,micro_batch=5"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--shape", shape, "--steps", "1", "--warmup", "0",
        "--trainers", "ours", "--out", str(out),
    ]  # fmt: skip
    run_main("bench_grpo.py", argv, tmp_path, monkeypatch)
    result = capsys.readouterr()
    (compacted,) = (r["completion_stats"] for r in json.loads(out.read_text())["results"])
    # 20 rows ending at geometric lengths (mean 6, at most 24): most have ended at the first check (8 steps)
    assert 0 < compacted["decode_row_steps"] < 0.8 * compacted["decode_full_row_steps"], compacted
    assert "row-steps a cycle" in result.out

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from results_tables import shape_table
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    table = "\n".join(shape_table(json.loads(out.read_text())))
    assert "Decode rows computed (ours" in table and "of a decode at full width" in table
