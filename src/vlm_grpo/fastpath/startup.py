"""Where a process's start-up time goes: compilation (dynamo, inductor, their caches), Triton autotuning, and the
decode step's warm-up passes and CUDA graph captures.

torch keeps its own tallies per process (``torch._dynamo.utils.counters`` and ``compilation_time_metrics``, the
seconds of each timed compiler phase); the decode's warm-ups and captures are timed here (:func:`timed`, called by
:mod:`vlm_grpo.fastpath.decode`). :func:`report` reads both into one flat dict of counts and seconds, for the
benchmarks' results and the trainer's log. A warm start shows as ``fxgraph_cache_miss`` 0 (nothing compiled by
inductor, every graph loaded from the compile cache) and few ``dynamo_graphs`` (dynamo still traces each function
once per process, but with the dynamic dimensions the cache's profile recorded, so it does not trace it again when a
shape first changes).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

# Seconds of each timed event of this process, by name ("decode_warmup", "decode_capture").
_events: defaultdict[str, list[float]] = defaultdict(list)

# report()'s counters: (its key, torch's counter group, the counter).
_COUNTERS = (
    ("dynamo_frames", "frames", "ok"),
    ("dynamo_graphs", "stats", "unique_graphs"),
    ("fxgraph_cache_hit", "inductor", "fxgraph_cache_hit"),
    ("fxgraph_cache_miss", "inductor", "fxgraph_cache_miss"),
    ("autograd_cache_hit", "aot_autograd", "autograd_cache_hit"),
    ("autograd_cache_miss", "aot_autograd", "autograd_cache_miss"),
)
# report()'s seconds: (its key, the phases of compilation_time_metrics it sums).
_PHASES = (
    ("dynamo_seconds", ("_compile.compile_inner",)),  # all of it: tracing, then the backend (inductor)
    ("tracing_seconds", ("bytecode_tracing",)),
    ("backend_seconds", ("OutputGraph.call_user_compiler",)),
)


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Add the block's seconds (wall clock: a caller that times device work synchronizes first) to ``name``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _events[name].append(time.perf_counter() - start)


def _autotune(metrics: dict[str, list[float]]) -> list[float]:
    """The seconds of every Triton autotuning run: a kernel's configs benchmarked at its first launch
    (``CachingAutotuner.*``) and templates chosen at compile time (``*_template_autotuning``)."""
    return [s for name, times in metrics.items() if name.startswith("CachingAutotuner.") or
            name.endswith("_template_autotuning") for s in times]  # fmt: skip


def report() -> dict[str, float | int]:
    """This process's start-up counts and seconds so far (seconds rounded to ms)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    out: dict[str, float | int] = {key: int(counters[group][name]) for key, group, name in _COUNTERS}
    for key, phases in _PHASES:
        out[key] = round(sum(s for phase in phases for s in compilation_time_metrics.get(phase, ())), 3)
    tuned = _autotune(compilation_time_metrics)
    out["autotune_runs"], out["autotune_seconds"] = len(tuned), round(sum(tuned), 3)
    for name in ("decode_warmup", "decode_capture"):
        times = _events.get(name, [])
        out[f"{name}s"], out[f"{name}_seconds"] = len(times), round(sum(times), 3)
    return out


def reset() -> None:
    """Forget this module's timings (torch's own counters are torch's: ``torch._dynamo.utils.counters.clear()``)."""
    _events.clear()


def since(before: dict[str, float | int], after: dict[str, float | int] | None = None) -> dict[str, float | int]:
    """What :func:`report` counted between ``before`` and ``after`` (default: now), e.g. over one run."""
    after = report() if after is None else after
    return {key: round(value - before.get(key, 0), 3) for key, value in after.items()}


def line(counts: dict[str, float | int]) -> str:
    """One log line of :func:`report`'s counts."""
    c = counts
    return (
        f"dynamo traced {c['dynamo_graphs']} graph(s) in {c['dynamo_seconds']:.1f} s (inductor "
        f"{c['backend_seconds']:.1f} s; compile cache: {c['fxgraph_cache_hit']} loaded, {c['fxgraph_cache_miss']} "
        f"compiled); Triton autotuning: {c['autotune_runs']} run(s), {c['autotune_seconds']:.1f} s; decode steps: "
        f"{c['decode_warmups']} warm-up(s) {c['decode_warmup_seconds']:.1f} s, {c['decode_captures']} CUDA graph "
        f"capture(s) {c['decode_capture_seconds']:.1f} s"
    )


class StartupLog(TrainerCallback):
    """Logs once, at the end of the first optimizer step, what the process spent on compilation and graph capture
    since the callback was made (with the trainer)."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger, self.before, self.done = logger, report(), False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.done:
            self.done = True
            self.logger.info("start-up until the first optimizer step: %s", line(since(self.before)))
