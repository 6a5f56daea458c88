"""Measure the python tool's sandbox on this machine: start latency and per-call overhead (p50 / p95).

``python -m vlm_grpo.tools.sandbox_bench [--starts 10] [--calls 200]`` prints a Markdown table:

- *start*: one isolated interpreter from nothing to ready (bwrap, Python, numpy, PIL, matplotlib imported),
  and the same without matplotlib (``preload_matplotlib: false``);
- *acquire from a warm pool*: what a rollout's first call waits for when the pool has one ready;
- *call*: a trivial cell (``x = 1``) round trip, the overhead every tool call pays;
- *call returning an image*: a cell that shows a 224x224 image (PNG encode, frame, checks, decode).
"""

from __future__ import annotations

import argparse
import statistics
import time

from PIL import Image

from vlm_grpo.tools.sandbox import Sandbox, SandboxLimits, SandboxPool


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return statistics.median(ordered), p95


def measure(starts: int, calls: int) -> dict[str, tuple[float, float]]:
    limits = SandboxLimits(pool_size=1)
    start_times = []
    for _ in range(starts):
        t = time.perf_counter()
        Sandbox(limits).close()
        start_times.append(time.perf_counter() - t)
    lean = SandboxLimits(pool_size=1, preload_matplotlib=False)
    lean_times = []
    for _ in range(starts):
        t = time.perf_counter()
        Sandbox(lean).close()
        lean_times.append(time.perf_counter() - t)
    pool = SandboxPool(limits)
    acquire_times = []
    try:
        for _ in range(starts):
            while not any(s.alive for s in pool._idle):  # wait until the pool has refilled
                time.sleep(0.05)
            t = time.perf_counter()
            sandbox = pool.acquire([])
            acquire_times.append(time.perf_counter() - t)
            sandbox.close()
    finally:
        pool.close()
    sandbox = Sandbox(limits, [Image.new("RGB", (224, 224), (10, 20, 30))])
    try:
        call_times, image_times = [], []
        for _ in range(calls):
            t = time.perf_counter()
            sandbox.run("x = 1")
            call_times.append(time.perf_counter() - t)
        for _ in range(max(1, calls // 4)):
            t = time.perf_counter()
            result = sandbox.run("display(image_clue_0.rotate(90))")
            image_times.append(time.perf_counter() - t)
            assert len(result.images) == 1
    finally:
        sandbox.close()
    return {
        "start (cold)": _percentiles(start_times),
        "start, preload_matplotlib false": _percentiles(lean_times),
        "acquire from a warm pool": _percentiles(acquire_times),
        "call (x = 1)": _percentiles(call_times),
        "call returning a 224x224 image": _percentiles(image_times),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vlm_grpo.tools.sandbox_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=10, help="interpreters to start (and to take from a pool)")
    parser.add_argument("--calls", type=int, default=200, help="trivial calls to time")
    args = parser.parse_args(argv)
    print("| what | p50 | p95 |\n| --- | --- | --- |")
    for name, (p50, p95) in measure(args.starts, args.calls).items():
        print(f"| {name} | {p50 * 1000:.1f} ms | {p95 * 1000:.1f} ms |")


if __name__ == "__main__":
    main()
