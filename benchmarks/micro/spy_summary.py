"""Summarise a ``py-spy record -f raw --threads [--native] [--idle]`` file of ``train_window.py`` or ``bench_grpo.py``.

Keeps the samples inside one Python function (``--within``, default: train_window's ``window``) on the thread
that runs it, and every sample of the other threads that is not compilation, then prints per group: samples, the
innermost frames (native or Python), the innermost Python frames, and inclusive Python functions. The raw files
are hundreds of MB; this keeps what a reader needs (a few KB of JSON).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

COMPILING = (
    "_inductor/compile_fx.py",
    "_inductor/codecache.py",
    "_inductor/async_compile.py",
    "_inductor/graph.py",
    "_inductor/scheduler.py",
    "_dynamo/convert_frame.py",
    "_dynamo/symbolic_convert.py",
)
LINE = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")


def python_frame(frame: str) -> bool:
    match = LINE.match(frame)
    return bool(match and ".py" in match["where"])


def without_line(frame: str) -> str:
    match = LINE.match(frame)
    if not match:
        return frame
    return f"{match['name']} ({match['where'].split(':')[0]})"


def summarise(path: Path, within: str, top: int) -> dict:
    groups: dict[str, dict[str, collections.Counter]] = {}
    threads: collections.Counter = collections.Counter()
    for line in path.open(errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread, frames = frames[0], frames[1:]
        threads[thread] += n
        if any(marker in stack for marker in COMPILING):
            group = "compiling"
        elif any(f.startswith(within + " (") for f in frames):
            group = "within"
        elif "MainThread" in thread:
            group = "main, elsewhere"
        else:
            group = "other threads" if frames else "other threads, no frames"
        g = groups.setdefault(group, {k: collections.Counter() for k in ("samples", "leaf", "py_leaf", "py_incl")})
        g["samples"]["all"] += n
        if not frames:
            continue
        g["leaf"][frames[-1]] += n
        py = [f for f in frames if python_frame(f)]
        if py:
            g["py_leaf"][py[-1]] += n
        for name in {without_line(f) for f in py}:
            g["py_incl"][name] += n
    out: dict = {"threads": threads.most_common(20), "groups": {}}
    for name, g in groups.items():
        out["groups"][name] = {
            "samples": g["samples"]["all"],
            "leaf": g["leaf"].most_common(top),
            "py_leaf": g["py_leaf"].most_common(top),
            "py_incl": g["py_incl"].most_common(top),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", type=Path)
    p.add_argument("--within", default="window")
    p.add_argument("--top", type=int, default=60)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = summarise(args.raw, args.within, args.top)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
