"""The worker side of ``scale_out.py``: what runs on every rank under ``torch.distributed.run``.

``scale_out.py`` starts itself under torchrun with ``SCALE_OUT_WORKER`` set to the run's spec (JSON: result folder,
warm-up and measured steps, whether to profile, device, start time) and hands over to ``worker`` here. It runs
``grpo_jsonl.main`` with ``bench_common``'s phase timers and two callbacks (``OptimizerTimer``, and ``Recorder``: the
time of every step, peak memory, which speed features ran, from ``Probe``'s counters and log lines); rank 0 also
profiles one extra step after the measured ones and sums the GPU time of its NCCL kernels, the time in collectives
(``collective_summary``). Each rank writes ``rank{N}.json`` in the spec's folder; the driver reads them. The model is
never saved (``save_model`` is a no-op here). With a shape (``scale_out.py --shape``) every rank's model gets the EOS
bias (``install_shape_bias``) before the trainer is built, and each rank writes its file after every cycle, with its
completion lengths and valid prompt tokens.

Nothing here imports the driver; torch, transformers and the package are imported inside the functions, so the
pure helpers (``collective_summary``, ``collective_kind``) import without them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class Probe:
    """Counts what the fast path really did: shared prefills, fast_decode calls (CUDA graph, compiled step),
    packed log-prob passes; keeps the package's info/warning lines (why a feature is off)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lines: list[str] = []

    def install(self) -> None:
        import logging

        import vlm_grpo.trainer as trainer_module
        from vlm_grpo.fastpath import decode

        counts = self.counts
        real_packed, real_shared = trainer_module.packed_logps, trainer_module.shared_prefill_generate

        def packed_logps(*args: Any, **kwargs: Any) -> Any:
            out = real_packed(*args, **kwargs)
            counts["packed_calls"] += 1
            counts["packed_used"] += out is not None
            return out

        def shared_prefill_generate(*args: Any, **kwargs: Any) -> Any:
            out = real_shared(*args, **kwargs)
            counts["shared_prefill_calls"] += 1
            counts["shared_prefill_used"] += out is not None
            return out

        trainer_module.packed_logps = packed_logps
        trainer_module.shared_prefill_generate = shared_prefill_generate

        class Step(decode._Step):  # one per fast_decode call: its CUDA graph and compiled step
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                counts["decode_steps"] += 1
                counts["decode_graphs"] += self.graph is not None
                counts["decode_compiled"] += bool(self.compiled)

        decode._Step = Step
        lines = self.lines

        class Capture(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                fast = record.name.startswith(("vlm_grpo.fastpath", "vlm_grpo.trainer"))
                if (fast and record.levelno >= logging.INFO) or record.levelno >= logging.WARNING:
                    line = f"{record.levelname} {record.name}: {record.getMessage()}"[:400]
                    if line not in lines and len(lines) < 40:
                        lines.append(line)

        logging.getLogger("vlm_grpo").addHandler(Capture())


def static_features(trainer: Any) -> dict[str, Any]:
    """The speed options as configured, and the attention kernels the model ended up with."""
    from vlm_grpo.utils import model_base

    a = trainer.args
    base = model_base(trainer.model)
    vision = getattr(base.config, "vision_config", None)
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return {
        "zero_stage": plugin.zero_stage if plugin is not None else None,
        "world_size": trainer.accelerator.num_processes,
        **{
            k: getattr(a, k, None)
            for k in (
                "share_prompt",
                "share_prefill",
                "fast_decode",
                "compile_decode",
                "packed_attention",
                "batch_vision_attention",
                "cudnn_attention",
                "ds3_gather_for_generation",
                "gradient_checkpointing",
                "bf16",
            )
        },
        "compile_layers": getattr(trainer, "compile_layers", None),  # as the run resolved it (None: on for a GPU)
        "text_attention": base.config.get_text_config(decoder=True)._attn_implementation,
        "vision_attention": getattr(vision, "_attn_implementation", None),
        "vision_sync": bool(getattr(trainer, "_vision_syncs", None)),
    }


# NCCL's kernels on the GPU timeline (``ncclDevKernel_AllReduce_Sum_bf16_RING_LL``, older ``ncclKernel_...``). The
# profiler also puts a GPU user annotation of each c10d op there (``nccl:all_reduce``, ``nccl:_all_gather_base``)
# spanning the same time: counting both doubles the time in collectives.
NCCL_KERNEL_PREFIXES = ("ncclDevKernel", "ncclKernel")
# Collective kinds as NCCL names them, matched against a name lower-cased without "_" ("all_reduce", "allreduce_",
# "AllReduce" alike); the longer names first (AllReduce before Reduce, SendRecv before Send).
COLLECTIVE_KINDS = (
    "AllGather",
    "ReduceScatter",
    "AllReduce",
    "AllToAll",
    "Broadcast",
    "SendRecv",
    "Reduce",
    "Gather",
    "Scatter",
    "Send",
    "Recv",
    "Barrier",
)


def collective_kind(name: str) -> str:
    """The collective an NCCL kernel, c10d op or its annotation runs (``AllReduce``...), else the name (40 chars)."""
    flat = name.lower().replace("_", "")
    return next((kind for kind in COLLECTIVE_KINDS if kind.lower() in flat), name[:40])


def profiled_spans(prof: Any) -> list[tuple[str, bool, float, float]]:
    """(name, on the GPU, start us, end us) of every event of a finished ``torch.profiler`` run: from the raw
    kineto events (building torch's event tree for a ZeRO-3 step costs many seconds), else from ``events()``."""
    from torch.autograd import DeviceType

    try:
        return [
            (e.name(), e.device_type() == DeviceType.CUDA, e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3)
            for e in prof.profiler.kineto_results.events()
        ]
    except AttributeError:
        return [(e.name, e.device_type == DeviceType.CUDA, e.time_range.start, e.time_range.end) for e in prof.events()]


def collective_summary(spans: list[tuple[str, bool, float, float]], step_s: float) -> dict[str, Any]:
    """Time in collectives of one profiled step: the GPU time of NCCL kernels (on CPU: the c10d ops' host time),
    by kind, and how many ran inside generation and inside fast_decode (phase windows of bench_common's timer).

    On the GPU only the kernels (``NCCL_KERNEL_PREFIXES``) count, not the ``nccl:*`` annotations of the same calls;
    where no event is named like a kernel, every GPU event with "nccl" in its name does (``source`` says which).
    An NCCL kernel's time includes waiting for the other ranks to reach it; the profiled rank (0) is the slowest
    one (the profiler's overhead), so it waits least."""
    gpu = [e for e in spans if e[1]]
    if gpu:
        comm = [e for e in gpu if e[0].startswith(NCCL_KERNEL_PREFIXES)]
        source = "nccl kernels (GPU time, rank 0)"
        if not comm:  # no kernel names known to us: whatever NCCL put on the GPU timeline
            comm = [e for e in gpu if "nccl" in e[0].lower()]
            source = "nccl events (GPU time, rank 0; no ncclDevKernel/ncclKernel names)"
        kernels = [e for e in gpu if not e[0].startswith("phase:")]
    else:  # gloo on CPU: the c10d ops (host time; the wiring check)
        comm = [e for e in spans if e[0].startswith("c10d::")]
        source = "c10d ops (host time, rank 0)"
        kernels = []

    def windows(name: str) -> list[tuple[float, float]]:
        named = [e for e in spans if e[0] == name]
        device = [e for e in named if e[1]]  # the phase's range on the GPU timeline, where there is one
        return [(e[2], e[3]) for e in (device or named)]

    def within(windows: list[tuple[float, float]]) -> dict[str, float]:
        hits = [e for e in comm if any(s <= e[2] < t for s, t in windows)]
        return {"count": len(hits), "s": sum(e[3] - e[2] for e in hits) / 1e6}

    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, _, start, end in comm:
        kind = collective_kind(name)
        by_kind[kind][0] += 1
        by_kind[kind][1] += (end - start) / 1e6
    total = sum(e[3] - e[2] for e in comm) / 1e6
    busy, reach = 0.0, float("-inf")
    for _, _, start, end in sorted(kernels, key=lambda e: e[2]):  # union of kernel intervals
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    generation, decode = windows("phase:generation"), windows("phase:decode")
    return {
        "source": source,
        "step_s": step_s,
        "collective_s": total,
        "share_of_step": total / step_s if step_s else None,
        "count": len(comm),
        "by_kind": {k: {"count": int(c), "s": round(s, 6)} for k, (c, s) in sorted(by_kind.items())},
        "gpu_busy_s": busy / 1e6 if kernels else None,
        "generation_calls": len(generation),
        "in_generation": within(generation),
        "fast_decode_calls": len(decode),
        "in_decode": within(decode),
    }


def make_recorder(spec: dict[str, Any], timer: Any, probe: Probe, rank: int, device: Any) -> Any:
    import torch
    from transformers import TrainerCallback

    shape = spec.get("shape")

    class Recorder(TrainerCallback):
        """Writes this rank's results after the measured steps (a later crash or time-out keeps them), again after
        the profiled step (rank 0) and at the end of training."""

        def __init__(self) -> None:
            self.trainer: Any = None
            self.measured_end = spec["warmup"] + spec["steps"]
            self.profile = bool(spec["profile"]) and rank == 0
            self.prof: Any = None
            self.data: dict[str, Any] = {"rank": rank, "counts": {}, "collectives": None}
            self.path = Path(spec["dir"]) / f"rank{rank}.json"

        def on_train_begin(self, args, state, control, **kwargs):
            self.data["train_begin_s"] = time.time() - float(spec["t0"])
            if self.trainer is not None:
                self.data["features"] = static_features(self.trainer)

        def on_step_begin(self, args, state, control, **kwargs):
            if self.profile and state.global_step == self.measured_end:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.__enter__()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.measured_end:
                self.write(peak=True)
            elif shape and state.global_step % shape["updates"] == 0:  # a cycle ended: a time-out keeps it
                self.write(peak=True)  # the peak so far
            if self.prof is not None and state.global_step == self.measured_end + 1:
                self.prof.__exit__(None, None, None)
                try:
                    step_s = timer.per_step[-1].get("_wall", 0.0) if timer.per_step else 0.0
                    start = time.time()
                    self.data["collectives"] = collective_summary(profiled_spans(self.prof), step_s)
                    self.data["collectives"]["analysis_s"] = time.time() - start
                except Exception as err:  # the measured numbers are written already; say what failed
                    self.data["collectives"] = {"error": f"{type(err).__name__}: {err}"}
                self.prof = None
                self.write()

        def on_train_end(self, args, state, control, **kwargs):
            self.write(peak="peak_alloc_gib" not in self.data)

        def write(self, peak: bool = False) -> None:
            cuda = device.type == "cuda"
            if peak and cuda:
                self.data["peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                self.data["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            if cuda:
                self.data["peak_alloc_gib_end"] = torch.cuda.max_memory_allocated(device) / 2**30
            self.data["steps"] = [{k: round(v, 6) for k, v in step.items()} for step in timer.per_step]
            self.data["lengths"] = timer.lengths
            self.data["counts"] = dict(probe.counts)
            self.data["log_lines"] = probe.lines
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            tmp.replace(self.path)

    return Recorder()


def install_shape_bias(model: Any, mean: int, device: Any, bias: float | None = None) -> float:
    """bench_shape's EOS bias on this rank's freshly loaded model (every rank computes the same bias from the same
    weights). A ZeRO-3 model is loaded partitioned: the calibration pass gathers it whole for the moment; DeepSpeed
    partitions the head's new bias with the rest when it wraps the model."""
    from bench_shape import install_eos_bias

    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    partitioned = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if partitioned:
        import deepspeed

        with deepspeed.zero.GatheredParameters(partitioned):
            return install_eos_bias(model, eos, mean, bias=bias)
    return install_eos_bias(model.to(device), eos, mean, bias=bias)


def worker(spec: dict[str, Any], argv: list[str]) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from bench_common import OptimizerTimer, PhaseTimer, timed_fast_decode, timed_trainer_class
    from bench_shape import CyclePrinter

    import vlm_grpo.trainer as trainer_module
    from vlm_grpo import grpo_jsonl

    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    cuda = spec["device"] == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    timer = PhaseTimer(device)
    probe = Probe()
    probe.install()
    recorder = make_recorder(spec, timer, probe, rank, device)
    shape = spec.get("shape")
    printer = [CyclePrinter(f"rank {rank}", shape["updates"], timer.per_step)] if shape and rank == 0 else []

    class Bench(timed_trainer_class(trainer_module.VLMGRPOTrainer)):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # OptimizerTimer closes each step's record before the Recorder reads it.
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), OptimizerTimer(timer), *printer, recorder]
            if shape:  # before TRL wraps the model (DeepSpeed, the optimizer)
                recorder.data["eos_bias"] = install_shape_bias(
                    kwargs["model"], shape["mean_completion"], device, shape.get("eos_bias")
                )
            super().__init__(*args, **kwargs)
            recorder.trainer = self

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            probe.counts["generate_calls"] += 1
            return super()._generate_single_turn(*args, **kwargs)

        def _prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
            inputs = super()._prepare_inputs(*args, **kwargs)
            if shape:  # each row's valid prompt tokens, in the order of the completion lengths
                recorder.data.setdefault("prompt_lengths", []).extend(inputs["prompt_mask"].sum(1).tolist())
            return inputs

        def save_model(self, *args: Any, **kwargs: Any) -> None:
            """No weights kept: a ZeRO-3 save at 7B gathers and writes 16 GB."""

    Bench.timer = timer
    trainer_module.VLMGRPOTrainer = Bench  # grpo_jsonl.main imports it from there when it runs
    with timed_fast_decode(timer):
        grpo_jsonl.main(*grpo_jsonl.parse_args(argv))
