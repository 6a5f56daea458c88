"""``scale_out.py --shape NAME[:field=value,...]``: the EasyR1-shaped cycle of ``bench_shape.py`` on every rank.

Every rank trains the shape's per-GPU work (``bench_shape.Shape``: e.g. 64 prompts x G=5 at 512², completions ended
by the model's own EOS, 4 optimizer steps per generation in micro-batches of 4 rows) through the flags a user of
``grpo_jsonl.py`` passes: ``--per_device_train_batch_size`` (the micro-batch), ``--gradient_accumulation_steps``,
``--steps_per_generation``, ``--num_generations``, ``--max_completion_length``; the images are written at the
shape's size (the processor's own pixel limits, as ``bench_grpo.py --shape`` uses them). ``scale_out_worker`` gives
each rank's model the EOS bias (``bench_shape.install_eos_bias``) before the trainer is built.

``--warmup`` and ``--steps`` count cycles (defaults 1 and 1): the first cycle is the cold one (compilation, graph
capture), the next one the steady cycle that is reported. Per run: the cycle time (rank 0; ranks meet at every
optimizer step), tokens/s/GPU as EasyR1 counts them (every rank's prompt + completion valid tokens of the measured
cycle, summed over ranks, / cycle seconds / GPUs), samples/s, training-phase MFU (rank 0), the phases
(generation, log-probs, update = loss forward + backward + optimizer), peak memory of every rank and the realised
completion lengths of every rank and cycle. Weak-scaling efficiency against the fewest GPUs: ``time`` =
cycle(base) / cycle(N), ``tokens`` = tokens/s/GPU(N) / tokens/s/GPU(base) (the natural lengths make each run's
work differ a little; this one divides it out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from scale_report import PHASES, fmt, median

# Rough seconds for a shaped run (launch, load, cold cycle, steady cycle, exit), for the budget.
RUN_ESTIMATE_S = {"qwen2_5_vl_3b": 240, "qwen2_5_vl_7b": 360}


def setup(args: argparse.Namespace) -> Any:
    """Parse ``args.shape`` (bench_shape's names and overrides) and set the per-device sizes from it."""
    from bench_shape import parse_shape

    shape = parse_shape(args.shape)
    sizes = ("prompts_per_device", "num_generations", "image_size", "completion_length")
    given = [f"--{k}" for k in sizes if getattr(args, k) is not None]
    given += ["--vary_prompts"] if args.vary_prompts else []
    if given:
        raise SystemExit(
            f"error: --shape {args.shape} sets the per-GPU sizes; drop {', '.join(given)} or change them in the shape "
            "(name:prompts=...,generations=...,image_size=...,max_completion=...)"
        )
    args.prompts_per_device, args.num_generations = shape.prompts, shape.generations
    args.image_size, args.completion_length = shape.image_size, shape.max_completion
    args.steps = 1 if args.steps is None else args.steps
    args.profile = False  # a profiled step past the measured cycles would start a whole new generation
    return shape


def flags(shape: Any) -> dict[str, Any]:
    """grpo_jsonl.py's batch flags for the shape: bench_shape's config fields, no forced length (the EOS bias ends
    the rows)."""
    from bench_shape import config_fields

    fields = config_fields(shape)
    fields.pop("generation_kwargs")
    return {**fields, "num_generations": shape.generations}


def spec(shape: Any, eos_bias: float | None = None) -> dict[str, Any]:
    """What the worker needs of the shape: the EOS bias (its mean, or the value given) and the optimizer steps per
    cycle."""
    return {
        "name": shape.name,
        "mean_completion": shape.mean_completion,
        "updates": shape.updates,
        "eos_bias": eos_bias,
    }


def kv_cache_gib(model_dir: Path, shape: Any) -> float | None:
    """GiB of a bf16 K/V cache holding every row of one generation at full length (prompt ~ the image's tokens + 120
    text tokens, plus ``max_completion``): what a cache sized to the longest possible row takes per GPU."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = 2 * 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim  # K and V, bf16
    return per_token * shape.rows * ((shape.image_size // 28) ** 2 + 120 + shape.max_completion) / 2**30


def peak_tflops(gpu_name: str) -> float | None:
    from bench_policy import PEAK_TFLOPS

    return next((v for k, v in PEAK_TFLOPS.items() if k in gpu_name), None)


def summarise(
    args: argparse.Namespace,
    shape: Any,
    run: dict[str, Any],
    ranks: list[dict[str, Any]],
    params: int,
    peak_tflops: float | None,
) -> None:
    """Fill ``run`` from the ranks' result files: per cycle (bench_shape.cycles sums each cycle's optimizer steps);
    MFU from the model's ``params`` and the card's ``peak_tflops`` (None: not reported)."""
    from bench_shape import cycles, length_stats

    w, s, n = args.warmup, args.steps, run["nproc"]
    per_rank = [cycles(r["steps"], shape.updates) for r in ranks]
    r0 = per_rank[0]
    run["cycle_times_s"] = [round(c["_wall"], 3) for c in r0]
    run["first_cycle_s"] = r0[0]["_wall"] if r0 else None
    run["first_step_s"] = run["first_cycle_s"]
    run["completion_stats"] = length_stats([x for r in ranks for x in r.get("lengths", [])])
    run["eos_bias"] = ranks[0].get("eos_bias")
    measured = r0[w : w + s]
    run["measured_cycles"] = len(measured)
    if not measured:
        if r0:
            run["status"] = f"partial: {len(r0)} cycle(s), none past the {w} cold one(s)"
        return
    cycle_s = median([c["_wall"] for c in measured])
    tokens = [median([c["_prompt_tokens"] + c["_completion_tokens"] for c in cs[w : w + s]]) or 0 for cs in per_rank]
    phases = {p: median([c.get(p, 0.0) for c in measured]) for p in PHASES}
    train_s = phases["loss_forward"] + phases["backward"]
    executed, peak = median([c.get("_executed_tokens", 0.0) for c in measured]), peak_tflops
    decoded = median([c.get("_decode_tokens", 0.0) for c in measured])
    run.update(
        step_s=cycle_s,
        cycle_s=cycle_s,
        step_s_slowest_rank=max(median([c["_wall"] for c in cs[w : w + s]]) or 0 for cs in per_rank),
        samples_per_s=n * shape.rows / cycle_s,
        tokens_per_cycle=tokens,
        tokens_per_s=sum(tokens) / cycle_s,
        tokens_per_s_per_gpu=sum(tokens) / cycle_s / n,
        phases_s=phases,
        update_s=train_s + phases["optimizer"],
        generation_share=phases["generation"] / cycle_s,
        decode_ms_per_token=1e3 * phases["decode"] / decoded if decoded else None,
        mfu=6 * params * executed / train_s / (peak * 1e12) if peak and train_s > 0 else None,
    )
    if len(measured) < s:
        run["status"] = f"partial ({len(measured)}/{s} measured cycles)"


def table(runs: list[dict[str, Any]]) -> str:
    """The shaped runs: one row per GPU count."""
    cols = (
        "GPUs|DeepSpeed|status|first cycle s|cycle s|tokens/s/GPU|samples/s|weak eff. time / tokens|generation s"
        "|log-prob s|update s|training MFU|peak GiB/rank|completion mean / p50 / p90 / max"
    ).split("|")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in sorted(runs, key=lambda r: r["nproc"]):
        phases, stats = r.get("phases_s") or {}, r.get("completion_stats") or {}
        peaks = [p for p in r.get("peak_alloc_gib") or [] if p is not None]
        eff, eff_t = r.get("weak_efficiency"), r.get("weak_efficiency_tokens")
        lengths = "/".join(f"{stats[k]:.0f}" for k in ("mean", "p50", "p90", "max")) if stats else "-"
        cells = [
            str(r["nproc"]),
            r["ds"],
            r["status"],
            fmt(r.get("first_cycle_s"), ".1f"),
            fmt(r.get("cycle_s"), ".2f"),
            fmt(r.get("tokens_per_s_per_gpu"), ",.0f"),
            fmt(r.get("samples_per_s"), ".2f"),
            f"{eff:.0%} / {fmt(eff_t, '.0%')} (vs {r['base']})" if eff is not None else "-",
            fmt(phases.get("generation"), ".2f"),
            fmt(phases.get("old_ref_logps"), ".2f"),
            fmt(r.get("update_s"), ".2f"),
            fmt(r.get("mfu") and 100 * r["mfu"], ".0f", "-") + ("%" if r.get("mfu") else ""),
            "/".join(f"{p:.1f}" for p in peaks) or "-",
            lengths,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(args: argparse.Namespace, shape: Any, gpu_name: str) -> str:
    from bench_shape import TOKENS_NOTE

    return (
        f"plan {args.plan}, shape {args.shape}: {args.preset}, {gpu_name}, per GPU and cycle {shape.prompts} prompts "
        f"x G={shape.generations} at {shape.image_size}px{' (sizes varied)' if shape.vary_images else ''}, "
        f"completions ended by the model's own EOS (geometric, mean {shape.mean_completion}, at most "
        f"{shape.max_completion}), {shape.updates} optimizer steps per generation in micro-batches of "
        f"{shape.micro_batch}; {args.warmup} cold + {args.steps} measured cycle(s) (median); {TOKENS_NOTE}"
    )


def shape_record(shape: Any) -> dict[str, Any]:
    """The shape's fields and how tokens are counted, for the summary file (as bench_grpo.py records them)."""
    import dataclasses

    from bench_shape import TOKENS_NOTE

    return {**dataclasses.asdict(shape), "tokens": TOKENS_NOTE}
