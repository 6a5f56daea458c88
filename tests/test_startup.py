"""Start-up instrumentation (``fastpath.startup``): the decode steps' warm-ups and captures counted, torch's compile
counters read, and one log line after the first optimizer step."""

from __future__ import annotations

import logging

import pytest
import torch

from test_decode_compact import _batch, _config, _ragged_eos, _run, _tiny_qwen
from vlm_grpo.fastpath import decode, decode_compact, startup

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_decode_step_made_counts_its_warm_ups(tiny_models, monkeypatch):
    """A windowed decode that narrows makes a step per (width, window) reached; on CPU each runs its warm-up passes
    (2 for the first, 1 after) and captures no graph."""
    monkeypatch.setattr(decode, "_CHECK_EVERY", 2)
    monkeypatch.setattr(decode_compact, "COMPACT", True)
    monkeypatch.setattr(decode, "ATTENTION_WINDOW", 4)
    monkeypatch.setattr(decode, "_WINDOWS_WITHOUT_GRAPH", True)
    made: list[tuple[int, int]] = []
    real = decode._Step.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append((self.tokens.size(0), self.mask.size(-1)))

    monkeypatch.setattr(decode._Step, "__init__", spy)
    model = _tiny_qwen(tiny_models)
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    made.clear()
    before = startup.report()
    ours, plain, _ = _run(model, _config(model, False, eos), batch)
    counted = startup.since(before)
    assert ours == plain and len(decode_compact.last_stats.widths) >= 3 and len(set(made)) == len(made) >= 4
    assert counted["decode_warmups"] == len(made) and counted["decode_captures"] == 0, (counted, made)
    assert counted["decode_warmup_seconds"] > 0 and counted["dynamo_graphs"] == 0


def test_report_reads_torchs_compile_counters(monkeypatch):
    from torch._dynamo.utils import compilation_time_metrics, counters

    monkeypatch.setitem(counters["inductor"], "fxgraph_cache_hit", 3)
    monkeypatch.setitem(counters["stats"], "unique_graphs", 5)
    monkeypatch.setitem(compilation_time_metrics, "CachingAutotuner.benchmark_all_configs", [0.5, 0.25])
    monkeypatch.setitem(compilation_time_metrics, "mm_template_autotuning", [1.0])
    monkeypatch.setitem(compilation_time_metrics, "bytecode_tracing", [2.0])
    out = startup.report()
    assert out["fxgraph_cache_hit"] == 3 and out["dynamo_graphs"] == 5
    assert out["autotune_runs"] == 3 and out["autotune_seconds"] == 1.75 and out["tracing_seconds"] == 2.0
    assert "5 graph(s)" in startup.line(out) and "3 loaded" in startup.line(out)


def test_the_startup_line_is_logged_once_after_the_first_step(caplog):
    log = startup.StartupLog(logging.getLogger("vlm_grpo.test"))
    with caplog.at_level(logging.INFO, logger="vlm_grpo.test"):
        with startup.timed("decode_capture"):
            torch.zeros(1)
        log.on_step_end(None, None, None)
        log.on_step_end(None, None, None)
    assert caplog.text.count("start-up until the first optimizer step") == 1
    assert "1 CUDA graph capture(s)" in caplog.text
