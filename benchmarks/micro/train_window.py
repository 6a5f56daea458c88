"""The training window alone (the loss pass's forward + backward), variants interleaved on one batch.

    python benchmarks/micro/train_window.py --preset qwen2_5_vl_3b --device cuda \\
        --variants ours text:compile_vision=false --repeats 20 --profile --out window.json
    python benchmarks/micro/train_window.py --preset tiny --device cpu --repeats 2          # smoke test

Whole-step medians move by 0.1 s from one trainer to the next in a process (generation, the allocator, the
host), more than a change to the loss pass is worth. Here one ``VLMGRPOTrainer`` generates one batch, and
then the variants (``bench_grpo.py``'s benchmark-only ``name:key=value`` switches, e.g. ``compile_vision``)
take turns on it: each repeat runs every variant once, in a rotating order, and times
``compute_loss`` + ``backward`` (no optimizer step, so the weights stay the same). ``--batches N`` generates N
batches whose prompt lengths differ and cycles through them (the shapes change as in real steps; 1: the same
shapes every time). The first ``--warmup`` repeats compile (with N batches, at least N of them). Reports the
median per variant, every time, and with ``--profile`` one profiled window per variant: wall against GPU-busy
time, the count of kernel launches, and the host's costliest ops.

``--micro_batch M`` times an optimizer step's update pass instead: the generated batch (``--prompts_per_step`` x
G rows, shuffled as TRL shuffles it) cut into micro-batches of M rows, run two ways in turn: ``micro`` (TRL: one
loss forward + backward per micro-batch) and ``fused`` (``--update_chunk_tokens``: the trainer's fused update,
:mod:`vlm_grpo.fastpath.fused_update`). Besides the times it counts, per window, the model's forwards and the
torch ops dispatched (forward and backward; on a GPU each is one or more kernel launches), on any device::

    python benchmarks/micro/train_window.py --preset qwen2_5_vl_3b --device cuda --image_size 512 \
        --completion_length 340 --num_generations 5 --prompts_per_step 16 --micro_batch 4 \
        --update_chunk_tokens 16384 --repeats 5 --warmup 2 --profile --out fused_window.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common.py is in benchmarks/

import torch
from bench_common import (
    Scenario,
    busy_time,
    device_defaults,
    grpo_config,
    grpo_trainer,
    one_batch_args,
    write_images,
)
from bench_policy import BENCH_ONLY, bench_switches, build_policy, parse_variant


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    one_batch_args(p)
    p.add_argument(
        "--trainer",
        default="ours",
        help="the trainer's config, as a bench_grpo.py variant "
        "(e.g. ours:compile_layers=true, which CPU runs need for compile_vision to mean anything)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=["ours", "text:compile_vision=false"],
        help="name[:switch=value,...] with benchmark-only switches (bench_common.BENCH_ONLY)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=1,
        help="generated batches the repeats cycle through (prompt lengths change from one to the next, as in "
        "real steps; 1: every window runs the same shapes)",
    )
    p.add_argument(
        "--micro_batch",
        type=int,
        help="time an optimizer step's update pass over micro-batches of this many rows, TRL's way (micro) and "
        "fused (--update_chunk_tokens); --variants are not used",
    )
    p.add_argument(
        "--update_chunk_tokens", type=int, default=16384, help="with --micro_batch: the fused update's token budget"
    )
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    for variant in args.variants:
        if unknown := set(parse_variant(variant)[1]) - BENCH_ONLY:
            p.error(f"variant {variant!r}: {sorted(unknown)} are config fields; give them to --trainer")
    args.beta, args.lora_r, args.lora_dropout, args.gradient_checkpointing = 0.0, 0, 0.05, True
    args.vary_prompts = 6
    return args


def rows(trainer, count: int) -> list:
    """``count`` batches of the trainer's dataloader, starting it again when it runs out."""
    out: list = []
    while len(out) < count:
        out += list(itertools.islice(trainer.get_train_dataloader(), count - len(out)))
    return out


def window(trainer, inputs, sync) -> float:
    """One loss forward + backward, as ``Trainer.training_step`` runs them; seconds."""
    sync()
    start = time.perf_counter()
    with trainer.compute_loss_context_manager():
        loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    sync()
    elapsed = time.perf_counter() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed


def micro_batches(trainer, batch: dict, rows: int) -> list[dict]:
    """``batch`` shuffled and cut into micro-batches of ``rows`` rows, as TRL's ``_prepare_inputs`` buffers them."""
    from trl.trainer.utils import (
        shuffle_sequence_dict,
        split_pixel_values_by_grid,
        split_tensor_dict,
        unsplit_pixel_values_by_grid,
    )

    n = batch["prompt_ids"].size(0)
    if n % rows:
        raise SystemExit(f"error: --micro_batch {rows} does not divide the batch's {n} rows")
    parts = split_tensor_dict(shuffle_sequence_dict(split_pixel_values_by_grid(batch)), n // rows)
    return [trainer._micro_batch(unsplit_pixel_values_by_grid(p)) for p in parts]


def update_window(trainer, mbs: list[dict], fused: bool, sync) -> float:
    """One optimizer step's update pass (no optimizer step): TRL's micro-batches, or the fused update; seconds."""
    from vlm_grpo.fastpath.fused_update import run_window

    model = trainer.model
    trainer.current_gradient_accumulation_steps = len(mbs)
    sync()
    start = time.perf_counter()
    with trainer.compute_loss_context_manager():
        if fused:  # what the trainer runs at a window's first micro-step, then its last micro-batch as TRL's
            run_window(
                trainer, model, mbs[:-1], lambda mb: trainer._trl_loss(model, mb), trainer.args.update_chunk_tokens
            )
        for mb in mbs[-1:] if fused else mbs:
            trainer.accelerator.backward(trainer._trl_loss(model, mb))
    sync()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def counted(run) -> dict[str, int]:
    """The model's forwards and the leaf torch ops (forward and backward; on a GPU each launches one kernel or a
    few) while ``run()`` runs, through the profiler's CPU events."""
    forwards = [0]
    handle = run.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
    finally:
        handle.remove()
    ops = sum(
        e.name.startswith("aten::") and not any(c.name.startswith("aten::") for c in e.cpu_children)
        for e in prof.events()
    )
    return {"forwards": forwards[0], "leaf_ops": ops}


def profiled(trainer, inputs, sync, run=None) -> dict[str, float]:
    """Wall, GPU-busy (union of kernel intervals), kernel launches and the host's costliest ops (self time) of
    one window under the profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        wall = run() if run is not None else window(trainer, inputs, sync)
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]
    host = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:25]
    return {
        "wall_s": wall,
        "gpu_busy_s": busy_time(kernels) / 1e6,
        "device_events": len(kernels),
        "host_self_ms": [[a.key, round(a.self_cpu_time_total / 1e3, 2), a.count] for a in host],
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    on_gpu = device_defaults(args)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    scenario = Scenario(args.image_size, 1, args.completion_length)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        paths = write_images(workdir, scenario, args.prompts_per_step * args.batches, args.seed, args.vary_images)
        model, processor, module = build_policy(args, workdir, "ours")
        config = grpo_config(args.trainer, args, scenario, workdir, max_steps=1)
        trainer = grpo_trainer(args.trainer, model, processor, module, config, paths, workdir, vary_prompts=6)
        batches = [trainer._generate_and_score_completions(batch) for batch in rows(trainer, args.batches)]
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, read by TRL's loss
    trainer.model.gradient_checkpointing_enable(config.gradient_checkpointing_kwargs or {"use_reentrant": False})
    trainer.model.train()
    if args.micro_batch:
        return update_main(args, trainer, batches, sync, on_gpu, device)
    times: dict[str, list[float]] = {parse_variant(v)[0]: [] for v in args.variants}
    for repeat in range(args.warmup + args.repeats):
        shift = repeat % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            with bench_switches(variant):
                elapsed = window(trainer, batches[repeat % len(batches)], sync)
            if repeat >= args.warmup:
                times[parse_variant(variant)[0]].append(elapsed)
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "args": vars(args),
        "prompt_lengths": [int(b["prompt_mask"].sum(1).max()) for b in batches],
        "median_s": {name: statistics.median(t) for name, t in times.items()},
        "times_s": times,
    }
    if args.profile and on_gpu:
        result["profiled"] = {}
        for variant in args.variants:
            with bench_switches(variant):
                result["profiled"][parse_variant(variant)[0]] = profiled(trainer, batches[-1], sync)
    return finish(result, args, on_gpu, device)


def finish(result: dict, args, on_gpu: bool, device) -> dict:
    """Peak memory on a GPU; the result printed (without every time) and written to ``--out``."""
    if on_gpu:
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(json.dumps({k: v for k, v in result.items() if k != "times_s"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def update_main(args, trainer, batches, sync, on_gpu, device) -> dict:
    """``--micro_batch``: TRL's micro-batches against the fused update, interleaved on the same micro-batches."""
    import types

    from trl import GRPOTrainer

    trainer.args.update_chunk_tokens = args.update_chunk_tokens
    trainer._trl_loss = types.MethodType(GRPOTrainer.compute_loss, trainer)
    windows = [micro_batches(trainer, b, args.micro_batch) for b in batches]
    modes = {"micro": False, "fused": True}
    times: dict[str, list[float]] = {name: [] for name in modes}
    for repeat in range(args.warmup + args.repeats):
        order = list(modes) if repeat % 2 == 0 else list(modes)[::-1]
        for name in order:
            elapsed = update_window(trainer, windows[repeat % len(windows)], modes[name], sync)
            if repeat >= args.warmup:
                times[name].append(elapsed)
    counts = {}
    for name, fused in modes.items():
        run = functools.partial(update_window, trainer, windows[-1], fused, sync)
        run.model = trainer.model
        counts[name] = counted(run)
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "args": vars(args),
        "micro_batches": len(windows[-1]),
        "rows": args.micro_batch * len(windows[-1]),
        "tokens": int(sum(int(mb["prompt_mask"].sum() + mb["completion_mask"].sum()) for mb in windows[-1])),
        "median_s": median,
        "speedup": median["micro"] / median["fused"],
        "per_window": counts,
        "times_s": times,
    }
    if args.profile and on_gpu:
        result["profiled"] = {
            name: profiled(trainer, None, sync, functools.partial(update_window, trainer, windows[-1], fused, sync))
            for name, fused in modes.items()
        }
    return finish(result, args, on_gpu, device)


if __name__ == "__main__":
    main(sys.argv[1:])
