"""The tables and summaries of ``scale_out.py``: weak-scaling efficiency, the markdown tables, which speed features
ran, and ``--merge`` (several commands' results as one summary). Plain Python: no torch, no other benchmark module
(``scale_shape.py`` passes its shaped table in where a merge needs it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Seconds per step (or cycle) of rank 0, bench_common's phase timers.
PHASES = ("generation", "decode", "old_ref_logps", "prepare_other", "loss_forward", "backward", "optimizer")


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def features_report(static: dict[str, Any], counts: dict[str, int], lines: list[str]) -> dict[str, str]:
    """Which speed features ran in the run, from what the trainer did (rank 0's counters); 'off (why)'."""

    def share(used: int, calls: int) -> str:
        return "off" if not used else "on" if used == calls else f"partial {used}/{calls}"

    def why(pattern: str) -> str:
        hit = next((m.group(1) for line in lines if (m := re.search(pattern, line))), None)
        return f" ({hit})" if hit else ""

    gen, shared = counts.get("generate_calls", 0), counts.get("shared_prefill_used", 0)
    decoded = counts.get("decode_steps", 0)
    report = {
        "share_prefill": share(shared, gen) + (why(r"cannot honour (.*?): generation") if shared < gen else ""),
        "fast_decode": share(decoded, shared)
        + (why(r"fast_decode is off for this run: (.*?); decoding") if decoded < shared else ""),
        "cuda_graph": share(counts.get("decode_graphs", 0), decoded),
        "compile_decode": share(counts.get("decode_compiled", 0), decoded) + why(r"compile_decode: (.*)"),
        "share_prompt": share(counts.get("packed_used", 0), counts.get("packed_calls", 0)),
        "packed_attention": "blocks" if static.get("text_attention") == "vlm_grpo_sdpa" else "dense",
        "batch_vision_attention": "on" if str(static.get("vision_attention")).startswith("vlm_grpo") else "off",
        "compile_layers": "on" if static.get("compile_layers") else "off",
        "vision_sync": "on" if static.get("vision_sync") else "off",
    }
    if static.get("zero_stage") == 3:
        report["ds3_gather_for_generation"] = "on" if static.get("ds3_gather_for_generation") else "off"
    return report


def rounded(value: Any, digits: int = 4) -> Any:
    """``value`` with its floats to ``digits`` significant digits (the one-line summaries)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def in_phases(c: dict[str, Any]) -> str:
    """Collectives inside generation / inside fast_decode ('-' where fast_decode did not run)."""
    if "in_generation" not in c:
        return "-"
    decode = c["in_decode"]["count"] if c.get("fast_decode_calls") else "-"
    return f"{c['in_generation']['count']} / {decode}"


def table(runs: list[dict[str, Any]]) -> str:
    cols = "GPUs|DeepSpeed|status|s/step|first s|samples/s|weak eff.|gen. share|decode ms/tok|collectives s (share)"
    cols += "|collectives in gen. / decode|peak GiB/rank|features on|off"
    cols = cols.split("|")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(runs, key=lambda r: r["nproc"]):
        c = r.get("collectives") or {}
        coll = f"{c['collective_s']:.3f} ({c['share_of_step']:.0%})" if c.get("share_of_step") is not None else "-"
        peaks = [p for p in r.get("peak_alloc_gib") or [] if p is not None]
        feats = r.get("features") or {}
        eff = r.get("weak_efficiency")
        cells = [
            str(r["nproc"]),
            r["ds"],
            r["status"],
            fmt(r.get("step_s"), ".3f"),
            fmt(r.get("first_step_s"), ".1f"),
            fmt(r.get("samples_per_s"), ".2f"),
            f"{eff:.0%} (vs {r['base']})" if eff is not None else "-",
            fmt(r.get("generation_share"), ".0%"),
            fmt(r.get("decode_ms_per_token"), ".2f"),
            coll,
            in_phases(c),
            f"{max(peaks):.1f}" if peaks else "-",
            ", ".join(k for k, v in feats.items() if v in ("on", "blocks")) or "-",
            "; ".join(f"{k}: {v}" for k, v in feats.items() if v not in ("on", "blocks")) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def efficiency(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Weak-scaling efficiency of every measured run against the one with the fewest GPUs (in place); the
    measured runs, fewest GPUs first."""
    done = sorted((r for r in runs if r.get("step_s")), key=lambda r: r["nproc"])
    if not done:
        return done
    base = done[0]
    for r in done:
        r["base_nproc"] = base["nproc"]
        r["base"] = f"{base['nproc']} GPU" + (f", {base['ds']}" if base["ds"] != r["ds"] else "")
        r["weak_efficiency"] = base["step_s"] / r["step_s"]  # samples/s per GPU, relative to the base
        r["speedup"] = r["samples_per_s"] / base["samples_per_s"]
        if r.get("tokens_per_s_per_gpu") and base.get("tokens_per_s_per_gpu"):
            r["weak_efficiency_tokens"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
    return done


def efficiency_lines(done: list[dict[str, Any]]) -> list[str]:
    """One line per measured run: its speed-up and weak-scaling efficiency against the base run."""
    lines = []
    for r in done:
        what = " in cycle time" if "cycle_s" in r else ""
        eff_t = r.get("weak_efficiency_tokens")
        tokens = f", {eff_t:.0%} in tokens/s/GPU" if eff_t is not None else ""
        lines.append(
            f"[scale] {r['name']}: {r['speedup']:.2f}x the samples/s of {r['base']} (weak-scaling efficiency "
            f"{r['weak_efficiency']:.0%}{what}{tokens})"
        )
    return lines


def load_results(paths: list[Path]) -> list[dict[str, Any]]:
    """The summaries or run files ``--merge`` names; a missing or unreadable one is a clear error."""
    loaded = []
    for path in paths:
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, ValueError) as err:
            raise SystemExit(f"error: --merge {path}: {err}; give scale_out.py's *_summary.json or run files") from None
    return loaded


def merge(args: argparse.Namespace, shape_table: Callable[[list[dict[str, Any]]], str]) -> list[dict[str, Any]]:
    """``--merge``: several commands' summaries (or run files) as one summary, efficiency against the fewest GPUs.
    The summary's other fields (card, versions, args, header) are the base run's command's; ``command`` lists every
    command, then the merge."""
    loaded = load_results(args.merge)
    runs = [run for data in loaded for run in (data["runs"] if "runs" in data else [data])]
    if not runs:
        raise SystemExit(f"error: --merge {' '.join(map(str, args.merge))}: no runs in these files")
    for run in runs:  # against the merged set's base, not each command's own
        for key in ("base_nproc", "base", "weak_efficiency", "weak_efficiency_tokens", "speedup"):
            run.pop(key, None)
    done = efficiency(runs)
    text = shape_table(runs) if any("first_cycle_s" in r for r in runs) else table(runs)
    summaries = [d for d in loaded if "runs" in d]
    base = min(summaries, key=lambda d: min((r["nproc"] for r in d["runs"]), default=1 << 30), default={})
    summary = {k: v for k, v in base.items() if k not in ("runs", "table", "command")}
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "merged_summary.json"
    merge_command = f"python3 benchmarks/scale_out.py --merge {' '.join(map(str, args.merge))} --out {out}"
    summary |= {
        "command": "\n".join([*(d["command"] for d in summaries if d.get("command")), merge_command]),
        "runs": sorted(runs, key=lambda r: r["nproc"]),
        "table": text,
        "merged_from": list(map(str, args.merge)),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(f"\n{summary.get('header', '')}\n\n{text}\n", *efficiency_lines(done), f"[scale] {out}", sep="\n")
    return runs
