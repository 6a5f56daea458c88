"""Vanilla ``trl.GRPOTrainer`` vs ``VLMGRPOTrainer`` on the same card, model, data and seed.

    python benchmarks/bench_grpo.py --preset qwen2_5_vl_3b --device cuda --out results.json
    python benchmarks/bench_grpo.py --preset tiny --device cpu          # CI smoke test

For every scenario (image size x images per prompt x completion length) both trainers run the
same steps; generation is forced to the full completion length (``min_new_tokens``) so both do
the same work. Per phase (generation, old/ref log-probs, loss forward, backward, optimizer) it
reports seconds per step, plus samples/s, tokens/s (prompt + completion tokens of the samples, the
same work for both), peak GPU memory, training-phase MFU (6 x parameters x tokens the loss pass
really executes / its time / the card's dense bf16 peak) and the ratio ours/vanilla; the time of every
step (the first pays compilations); decode ms/token (fast_decode's time per decoded token for ours, the
generation phase per completion token otherwise) and its ratio to the HBM floor (the weights one decode
step reads / the card's memory bandwidth).
``VLMGRPOTrainer`` runs as users run it: JSONL rows with image paths on disk, checked and lazily
decoded by the package's data pipeline. Timers, data, trainers, the table and the command line are in
``bench_common.py``; this script holds the run loop and the ``--profile_dir`` profiler.
Multi-turn tool rollouts (2 tool rounds, each returning an image, vs vanilla TRL's tool loop): see
``benchmarks/bench_tools.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import re
import statistics
import sys
import tempfile
import traceback
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from bench_common import (
    PHASES,
    OptimizerTimer,
    PhaseTimer,
    Result,
    Scenario,
    busy_time,
    format_table,
    grpo_config,
    grpo_trainer,
    parse,
    run_stamp,
    time_vision,
    timed_fast_decode,
    timed_trainer_class,
    write_images,
)
from bench_policy import (
    bench_switches,
    build_policy,
    decode_weight_bytes,
    hbm_bandwidth,
    is_vanilla,
    mfu,
    parse_variant,
)
from bench_shape import (
    TOKENS_NOTE,
    CyclePrinter,
    EosRecalibration,
    Shape,
    TimeLimit,
    apply_shape,
    config_fields,
    cycles,
    geo3k_questions,
    install_eos_bias,
    length_stats,
    recalibrating_trainer_class,
    stopped_by_sigterm,
)
from transformers import TrainerCallback

# --------------------------------------------------------------------------- profiling


class StepProfiler(TrainerCallback):
    """torch.profiler over one extra step after the measured ones; writes the top ops by device time, the phase
    windows (``*.train.txt``) and, from ``cProfile`` over the same step, the Python functions by cumulative time
    (``*.python.txt``: where host time goes that no torch op accounts for, e.g. in the input preparation)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path, self.prof, self.python = step, path, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self.python = cProfile.Profile()
            self.python.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is not None:
            self.python.disable()
            text = io.StringIO()
            pstats.Stats(self.python, stream=text).sort_stats("cumulative").print_stats(80)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.with_suffix(".python.txt").write_text(text.getvalue())
            self.prof.__exit__(None, None, None)
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(self.prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))
            self.path.with_suffix(".train.txt").write_text(training_window(self.prof.events()))
            self.prof = None


def training_window(events: list[Any]) -> str:
    """What the GPU does between the start of the loss forward and the end of the backward: how much of
    that window it is busy (the rest is host-bound), and which kernels / host ops fill it. Then the same for the
    generation phase, the decode within it (``fast_decode``) and the input preparation outside generation."""
    from torch.autograd import DeviceType

    def spans(name: str) -> list[tuple[float, float]]:
        """The host-side ranges of a phase (on GPU the profiler also lists each range on the device timeline)."""
        return [
            (e.time_range.start, e.time_range.end) for e in events if e.name == name and e.device_type == DeviceType.CPU
        ]

    steps = spans("phase:training_step")
    windows = [(a, next((e for s, e in steps if s <= a <= e), b)) for a, b in spans("phase:loss_forward")]
    if not windows:
        return "no loss_forward phase in the profiled step\n"
    parts = [window_report(events, windows, "training window (loss forward + backward)")]
    for phase in ("generation", "decode"):
        if spans(f"phase:{phase}"):
            parts.append(window_report(events, spans(f"phase:{phase}"), f"{phase} phase"))
    if spans("phase:prepare_inputs"):  # the input preparation around generation ("prepare_other")
        inner = spans("phase:generation") + spans("phase:old_ref_logps")
        title = "input preparation outside generation"
        parts.append(window_report(events, spans("phase:prepare_inputs"), title, inner))
    return "\n\n".join(parts)


def window_report(
    events: list[Any], windows: list[tuple[float, float]], title: str, exclude: list[tuple[float, float]] = ()
) -> str:
    """GPU busy time (union of kernel intervals) within ``windows`` (less ``exclude``), its kernels and host ops."""
    from torch.autograd import DeviceType

    def inside(e: Any) -> bool:
        start = e.time_range.start
        return any(s <= start < t for s, t in windows) and not any(s <= start < t for s, t in exclude)

    # On the device timeline the phase ranges themselves appear as annotations: not kernels.
    device = [e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith("phase:") and inside(e)]
    device.sort(key=lambda e: e.time_range.start)
    busy = busy_time([(e.time_range.start, e.time_range.end) for e in device])
    wall = sum(t - s for s, t in windows) - sum(t - s for s, t in exclude if any(a <= s < b for a, b in windows))
    lines = [
        f"{title}: {wall / 1e3:.1f} ms wall, GPU busy {busy / 1e3:.1f} ms ({busy / max(wall, 1e-9):.0%}), "
        f"{len(device)} device events",
        "",
        f"{'device ms':>10} {'calls':>7} {'mean us':>8}  kernel",
    ]
    by_kernel: dict[str, list[float]] = defaultdict(list)
    for e in device:
        by_kernel[e.name].append(e.time_range.end - e.time_range.start)
    for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:30]:
        lines.append(f"{sum(times) / 1e3:10.2f} {len(times):7d} {statistics.mean(times):8.1f}  {name[:110]}")
    host: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.device_type == DeviceType.CPU and not e.name.startswith("phase:") and inside(e):
            host[e.name].append(e.self_cpu_time_total)
    lines += ["", f"{'host self ms':>12} {'calls':>7}  op"]
    for name, times in sorted(host.items(), key=lambda kv: -sum(kv[1]))[:30]:
        lines.append(f"{sum(times) / 1e3:12.2f} {len(times):7d}  {name[:110]}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- packed tokens

PASSES = ("old_ref", "loss")


def counted_trainer_class(base: type) -> type:
    """A subclass of a timed trainer class that counts, per log-prob pass, the tokens its forwards ran (``_ran``:
    the packed rows of ``share_prompt``, padding included, or TRL's ``rows x (prompt + C)``), the tokens of TRL's
    ``(rows, prompt + C)`` layout (``_layout``), and the loss pass's tokens without padding (``_loss_tokens``: the
    packed prefixes and blocks, or every row's prompt + C) for MFU."""

    class Counted(base):  # type: ignore[misc, valid-type]
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kw):
            self.last_packed_pass = None  # set by the packed pass (vlm_grpo.fastpath.sharing.PackedPass)
            out = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kw
            )
            record, totals = self.last_packed_pass, self.timer.totals
            name = "loss" if self.timer.in_loss else "old_ref"
            totals[f"_{name}_layout"] += input_ids.numel()
            totals[f"_{name}_ran"] += record.slots if record else input_ids.numel()
            if name == "loss":
                prompts = float(attention_mask[:, :-logits_to_keep].sum())
                totals["_loss_tokens"] += record.tokens if record else prompts + input_ids.size(0) * logits_to_keep
            return out

    Counted.__name__ = base.__name__
    return Counted


def packed_tokens_line(trainer: str, tokens: dict[str, float]) -> str:
    """One line: per pass, the tokens its forwards ran against TRL's (rows, prompt + C) layout, per cycle."""
    parts = [
        f"{name} {tokens[f'{name}_ran']:,.0f} of {tokens[f'{name}_layout']:,.0f} "
        f"({tokens[f'{name}_ran'] / tokens[f'{name}_layout']:.0%})"
        for name in PASSES
        if tokens.get(f"{name}_layout")
    ]
    return (
        f"[tokens] {trainer}: log-prob passes ran, of TRL's (rows, prompt + C) layout, per step (cycle): "
        + "; ".join(parts)
    )


# --------------------------------------------------------------------------- runs


@contextlib.contextmanager
def counted_row_steps(timer: PhaseTimer, kind: str) -> Iterator[None]:
    """Counts the rows ``fast_decode`` computes, summed over its steps (``_row_steps``), and what a decode at full
    width to its last step would (``_full_row_steps``): finished rows leave the batch (fastpath.decode_compact). The
    variant's ``compact_rows=false`` keeps every decode at full width; ``sized_cache=false`` allocates every decode's
    cache for the longest possible rows from the start (``decode.SIZED_CACHE``); ``cpu_windows=true`` takes the
    attention windows (and so the cache that grows by windows) without CUDA graphs, as tests do on CPU."""
    from vlm_grpo.fastpath import decode, decode_compact

    real, compact = decode.fast_decode, decode_compact.COMPACT
    sized, windows = decode.SIZED_CACHE, decode._WINDOWS_WITHOUT_GRAPH
    switches = parse_variant(kind)[1]

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        timer.totals["_row_steps"] += decode_compact.last_stats.row_steps
        timer.totals["_full_row_steps"] += decode_compact.last_stats.full_row_steps
        return out

    decode.fast_decode = counted
    decode_compact.COMPACT = switches.get("compact_rows", compact) is not False
    decode.SIZED_CACHE = switches.get("sized_cache", sized) is not False
    decode._WINDOWS_WITHOUT_GRAPH = switches.get("cpu_windows", windows) is True
    try:
        yield
    finally:
        decode.fast_decode, decode_compact.COMPACT = real, compact
        decode.SIZED_CACHE, decode._WINDOWS_WITHOUT_GRAPH = sized, windows


def run_one(
    kind: str, args: argparse.Namespace, scenario: Scenario, workdir: Path, paths, shape: Shape | None = None
) -> Result:
    """One trainer's run of ``scenario``; with ``shape``, EasyR1-shaped cycles (see bench_shape.py), each
    generation's 4 optimizer steps summed into one entry, and an out-of-memory error reported as the result."""
    from trl import GRPOTrainer

    from vlm_grpo.fastpath import startup
    from vlm_grpo.trainer import VLMGRPOTrainer

    device = torch.device(args.device)
    torch.backends.cuda.enable_cudnn_sdp(not args.no_cudnn_sdpa)  # a trainer before this one may have changed it
    model, processor, module = build_policy(
        args, workdir, kind.partition(":")[0], lora_r=args.lora_r, lora_dropout=args.lora_dropout,
        freeze_vision=args.freeze_vision,
    )  # fmt: skip
    per_cycle = shape.updates if shape else 1
    measured_steps = (args.warmup + args.steps) * per_cycle
    extra = config_fields(shape, vanilla=is_vanilla(kind)) if shape else {}
    config = grpo_config(kind, args, scenario, workdir, measured_steps + bool(args.profile_dir), **extra)
    cls = counted_trainer_class(timed_trainer_class(GRPOTrainer if is_vanilla(kind) else VLMGRPOTrainer))
    recalibration = None
    if shape:
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos) if isinstance(eos, list) else {eos}
        eos_id = eos[0] if isinstance(eos, list) else eos
        install_eos_bias(model, eos_id, shape.mean_completion, bias=args.eos_bias)
        recalibration = EosRecalibration(model, eos_ids, eos_id, shape.mean_completion, shape.max_completion)
        if args.eos_bias is None and args.warmup:  # the warm-up cycle's lengths correct the bias (bench_shape.py)
            cls = recalibrating_trainer_class(cls, recalibration)
    timer = PhaseTimer(device)
    time_vision(model, module, timer)
    cls.timer = timer
    optimizer_timer = OptimizerTimer(timer)
    callbacks = [optimizer_timer]
    if shape:
        callbacks.append(CyclePrinter(kind, per_cycle, timer.per_step))
    if args.profile_dir:
        name = re.sub(r"\W+", "_", f"{scenario.name}_{kind.partition(':')[0]}")
        callbacks.append(StepProfiler(measured_steps, Path(args.profile_dir) / f"{name}.txt"))
    questions = geo3k_questions(len(paths), args.seed) if shape else None
    trainer = grpo_trainer(
        kind, model, processor, module, config, paths, workdir, cls=cls, vary_prompts=args.vary_prompts,
        questions=questions, callbacks=callbacks,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    status = "ok"
    try:
        with (
            timed_fast_decode(timer),
            counted_row_steps(timer, kind),
            bench_switches(kind),
            stopped_by_sigterm(enabled=shape is not None),
        ):
            trainer.train()
    except (torch.OutOfMemoryError, TimeLimit) as err:
        if not shape:
            raise
        what = "out of memory" if isinstance(err, torch.OutOfMemoryError) else "stopped by the time limit"
        status = f"{what} in cycle {len(timer.per_step) // per_cycle + 1}"
    timer.startup["run"] = startup.since(optimizer_timer.startup_before)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    steps = cycles(timer.per_step, per_cycle) if shape else timer.per_step
    measured = steps[args.warmup : args.warmup + args.steps] or steps or [{}]

    def median(key: str) -> float:
        return statistics.median(step.get(key, 0.0) for step in measured)

    step_s = median("_wall")
    gen_ms = 1e3 * median("generation") / scenario.completion_length
    decode_ms = 1e3 * median("decode") / median("_decode_tokens") if median("_decode_tokens") else None
    bandwidth = hbm_bandwidth(args.device)
    floor_ms = 1e3 * decode_weight_bytes(model) / bandwidth if bandwidth else None
    samples = args.prompts_per_step * args.num_generations
    lengths = timer.lengths[args.warmup * samples :] or timer.lengths  # the measured cycles' rows
    tokens = median("_prompt_tokens") + median("_completion_tokens")
    train_s = median("loss_forward") + median("backward")
    # MFU over the loss pass's tokens as it ran them (packed: each rollout's own length)
    utilisation = mfu(model, median("_loss_tokens"), train_s, args.peak_tflops)
    if shape and median("_full_row_steps"):  # rows fast_decode computed, against a decode at full width to the end
        row_steps = {"decode_row_steps": median("_row_steps"), "decode_full_row_steps": median("_full_row_steps")}
    else:
        row_steps = {}
    result = Result(
        trainer=kind.partition(":")[0],
        scenario=scenario.name,
        step_s=step_s,
        samples_per_s=samples / step_s if step_s else 0.0,
        tokens_per_s=tokens / step_s if step_s else 0.0,
        peak_mem_gib=peak,
        mfu=utilisation,
        phases_s={p: median(p) for p in PHASES},
        prompt_tokens=int(median("_prompt_tokens")),
        completion_tokens=int(median("_completion_tokens")),
        step_times_s=[step["_wall"] for step in timer.per_step],
        gen_ms_per_token=gen_ms,
        decode_ms_per_token=decode_ms,
        floor_ms_per_token=floor_ms,
        floor_ratio=(decode_ms or gen_ms) / floor_ms if floor_ms else None,
        status=status,
        completion_stats={**length_stats(lengths), **row_steps} if shape else {},
        cycle_times_s=[c["_wall"] for c in steps] if shape else [],
        startup=timer.startup,
        decode_cache_gib=timer.decode_cache_gib,
        eos_bias=recalibration.record if recalibration else {},
    )
    result.packed_tokens = {f"{p}_{k}": median(f"_{p}_{k}") for p in PASSES for k in ("ran", "layout")}
    print(packed_tokens_line(result.trainer, result.packed_tokens), flush=True)
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> list[Result]:
    from vlm_grpo.fastpath.startup import line as startup_line

    args = parse(argv, __doc__.split("\n\n")[0])
    shape = apply_shape(args) if args.shape else None
    results: list[Result] = []
    scenarios = [
        Scenario(s, k, c)
        for s, k, c in itertools.product(args.image_sizes, args.images_per_prompt, args.completion_lengths)
    ]
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in scenarios:
            workdir = Path(tmp) / scenario.name.replace(" ", "_")
            workdir.mkdir(parents=True)
            n_prompts = args.prompts_per_step * (args.warmup + args.steps + bool(args.profile_dir))
            paths = write_images(workdir, scenario, n_prompts, args.seed, args.vary_images)
            for kind in args.trainers:
                result = run_one(kind, args, scenario, workdir, paths, shape)
                results.append(result)
                print(f"[bench] {json.dumps(asdict(result))}", flush=True)  # survives a time-out of the run
                payload = {**run_stamp(), "device": device_name, "args": vars(args)}
                if shape:
                    payload["shape"] = {**asdict(shape), "tokens": TOKENS_NOTE}
                payload["results"] = [{**asdict(r), "packed_tokens": r.packed_tokens} for r in results]
                Path(args.out).write_text(json.dumps(payload, indent=2))  # rewritten after every run
    print()
    for result in results:
        print(packed_tokens_line(f"{result.scenario} {result.trainer}", result.packed_tokens))
    print(f"device: {device_name}; preset: {args.preset}; G={args.num_generations}; beta={args.beta}")
    if shape:
        print(f"shape: {shape}; per cycle; {TOKENS_NOTE}")
    for r in results:
        if "first_step" in r.startup:
            print(f"{r.trainer} start-up until the first optimizer step: {startup_line(r.startup['first_step'])}")
    print(format_table(results))
    for r in results:
        computed, full = r.completion_stats.get("decode_row_steps"), r.completion_stats.get("decode_full_row_steps")
        if full:
            print(
                f"{r.trainer}: fast_decode computed {computed:.0f} row-steps a cycle, {computed / full:.0%} of the "
                f"{full:.0f} a decode at full width to its last step computes"
            )
        if shape and r.decode_cache_gib is not None:
            print(f"{r.trainer}: the largest decode cache held {r.decode_cache_gib * 1024:.1f} MiB")
    return results


if __name__ == "__main__":
    try:
        main()
    except SystemExit:  # --help, and the command line's errors
        raise
    except BaseException:
        # A failed run must not hold the card: compilation workers and other non-daemon threads can keep the
        # interpreter alive after the traceback, until an outer time limit kills it.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
