"""Shared pieces of the single-GPU benchmarks: scenarios and results, phase timers, data, trainers, table.

What ``bench_grpo.py`` (the vanilla TRL vs ``VLMGRPOTrainer`` benchmark) is built from, and what
``bench_tools.py``, ``decode_lengths.py``, ``max_fit.py``, ``scale_out.py`` and ``scale_out_worker.py``
import: ``Scenario`` / ``Result``; ``PhaseTimer``, ``timed_trainer_class``, ``OptimizerTimer``,
``time_vision`` and ``timed_fast_decode`` (seconds per phase); random images, prompts, JSONL rows and both
trainers' datasets; ``length_reward``; ``grpo_config`` and ``grpo_trainer``; ``format_table``; the shared command
line (``parse``). The policy, its variants' switches and the card's peaks are in ``bench_policy.py``, the only
benchmark script it imports, inside the functions that need it: a run that names this file as its reward plugin
(scale_out.py's ``length_reward``) loads it by path, without ``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import TrainerCallback

# "prepare_other" is the rest of input preparation (processor, rewards, advantages); "vision" is the
# vision tower's share, already counted inside the other phases.
# "decode" is fast_decode's share of generation (ours only).
PHASES = ("generation", "decode", "old_ref_logps", "prepare_other", "loss_forward", "backward", "optimizer", "vision")


@dataclass
class Scenario:
    image_size: int
    images_per_prompt: int
    completion_length: int

    @property
    def name(self) -> str:
        return f"{self.image_size}px x{self.images_per_prompt} C{self.completion_length}"


@dataclass
class Result:
    trainer: str
    scenario: str
    step_s: float
    samples_per_s: float
    tokens_per_s: float
    peak_mem_gib: float | None
    mfu: float | None
    phases_s: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    step_times_s: list[float] = field(default_factory=list)  # every step, warm-up included, in order
    gen_ms_per_token: float = 0.0  # generation phase / completion length (prefill included)
    decode_ms_per_token: float | None = None  # fast_decode's time / tokens it decoded (ours)
    floor_ms_per_token: float | None = None  # decode weights / HBM bandwidth
    floor_ratio: float | None = None  # decode (else generation) ms/token / floor
    status: str = "ok"  # or what stopped the run ("out of memory in generation", ...)
    completion_stats: dict[str, float] = field(default_factory=dict)  # realised lengths (--shape)
    cycle_times_s: list[float] = field(default_factory=list)  # every generation cycle (--shape), in order
    # Compilation, autotuning, decode warm-ups and graph captures (vlm_grpo.fastpath.startup.report): counts and
    # seconds until the end of the first optimizer step ("first_step") and over the whole run ("run").
    startup: dict[str, dict[str, float]] = field(default_factory=dict)
    decode_cache_gib: float | None = None  # the most one fast_decode call's cache held (GiB), over the run
    eos_bias: dict[str, float] = field(default_factory=dict)  # --shape: installed, corrected (bench_shape.py)


# --------------------------------------------------------------------------- timing


class PhaseTimer:
    """Accumulates wall time per phase; synchronises the device so GPU work is attributed correctly."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.totals: dict[str, float] = defaultdict(float)
        self.per_step: list[dict[str, float]] = []
        self.lengths: list[float] = []  # every completion's length, in the order the rows were prepared
        self.in_loss = False
        self.decode_cache_gib: float | None = None  # see Result
        self.startup: dict[str, dict[str, float]] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str):
        self.sync()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase:{name}"):  # for StepProfiler's training window
                yield
        finally:
            self.sync()
            self.totals[name] += time.perf_counter() - start

    def close_step(self) -> None:
        self.per_step.append(dict(self.totals))
        self.totals = defaultdict(float)


def timed_trainer_class(base: type) -> type:
    """A subclass of ``base`` whose phases are timed; the training math is untouched."""

    class Timed(base):  # type: ignore[misc, valid-type]
        timer: PhaseTimer

        def _generate(self, prompts):
            with self.timer.phase("generation"):
                return super()._generate(prompts)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if self.timer.in_loss:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with self.timer.phase("old_ref_logps"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def compute_loss(self, *args, **kwargs):
            self.timer.in_loss = True
            try:
                with self.timer.phase("loss_forward"):
                    return super().compute_loss(*args, **kwargs)
            finally:
                self.timer.in_loss = False

        def _prepare_inputs(self, generation_batch):
            before = self.timer.totals["generation"] + self.timer.totals["old_ref_logps"]
            self.timer.sync()
            start = time.perf_counter()
            with torch.profiler.record_function("phase:prepare_inputs"):  # StepProfiler: what is not generation
                inputs = super()._prepare_inputs(generation_batch)
            self.timer.sync()
            inner = self.timer.totals["generation"] + self.timer.totals["old_ref_logps"] - before
            self.timer.totals["prepare_other"] += time.perf_counter() - start - inner
            self.timer.totals["_prompt_tokens"] += float(inputs["prompt_mask"].sum())
            self.timer.totals["_completion_tokens"] += float(inputs["completion_mask"].sum())
            self.timer.lengths += inputs["completion_mask"].sum(1).tolist()
            self.timer.totals["_executed_tokens"] += executed_tokens(inputs, getattr(self.args, "share_prompt", False))
            return inputs

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.timer.sync()
            start = time.perf_counter()
            before = dict(self.timer.totals)
            with torch.profiler.record_function("phase:training_step"):
                out = super().training_step(model, inputs, num_items_in_batch)
            self.timer.sync()
            inner = sum(
                self.timer.totals[k] - before.get(k, 0.0) for k in PHASES if k not in ("vision", "decode", "backward")
            )
            self.timer.totals["backward"] += max(0.0, time.perf_counter() - start - inner)
            return out

    Timed.__name__ = f"Timed{base.__name__}"
    return Timed


def executed_tokens(inputs: dict[str, Any], shared: bool) -> float:
    """Tokens the training pass really runs: every row's prompt + completion, or with the shared-prompt
    pass each distinct prompt once plus (1 + C) per row (see vlm_grpo.fastpath.sharing). Used for MFU."""
    prompt_len = inputs["prompt_mask"].sum(1)
    width = inputs["completion_ids"].size(1)
    if not shared:
        return float(prompt_len.sum() + prompt_len.numel() * width)
    distinct = {
        tuple(ids[m.bool()].tolist()) for ids, m in zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)
    }
    return float(sum(len(p) - 1 for p in distinct) + prompt_len.numel() * (width + 1))


class OptimizerTimer(TrainerCallback):
    def __init__(self, timer: PhaseTimer) -> None:
        self.timer = timer
        self.start = 0.0
        self.step_start = 0.0
        from vlm_grpo.fastpath import startup

        self.startup_before = startup.report()  # made with the trainer: its compilation counts from here

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.timer.sync()
        self.start = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.timer.sync()
        self.timer.totals["optimizer"] += time.perf_counter() - self.start

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.sync()
        self.step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        # A step's wall time runs from the previous step's end: what the Trainer does between steps (fetching the
        # next micro-batches from the loader, logging) is part of every real step.
        self.timer.sync()
        now = time.perf_counter()
        self.timer.totals["_wall"] += now - self.step_start
        self.step_start = now
        self.timer.close_step()
        if state.global_step == 1:
            from vlm_grpo.fastpath import startup

            self.timer.startup["first_step"] = startup.since(self.startup_before)


def time_vision(model: torch.nn.Module, module: Any, timer: PhaseTimer) -> None:
    """Forward hooks on the vision tower: its share of every pass (already inside the other phases)."""
    towers = {name: m for name, m in model.named_modules() if name in module.vision_prefixes}
    tower = towers.get(module.vision_prefixes[0])
    if tower is None:
        return
    starts: list[float] = []

    def pre(_m, _a):
        timer.sync()
        starts.append(time.perf_counter())

    def post(_m, _a, _o):
        timer.sync()
        timer.totals["vision"] += time.perf_counter() - starts.pop()

    tower.register_forward_pre_hook(pre)
    tower.register_forward_hook(post)


@contextmanager
def timed_fast_decode(timer: PhaseTimer):
    """Times ``fast_decode`` (the "decode" phase) and counts the tokens it decodes, for the duration of a run."""
    from vlm_grpo.fastpath import decode
    from vlm_grpo.fastpath import decode_compact as compaction

    real = decode.fast_decode

    def timed(*args, **kwargs):
        with timer.phase("decode"):
            out = real(*args, **kwargs)
        timer.totals["_decode_tokens"] += out.size(1)
        cache = compaction.last_stats.peak_cache_bytes / 2**30
        timer.decode_cache_gib = max(timer.decode_cache_gib or 0.0, cache)
        return out

    decode.fast_decode = timed
    try:
        yield
    finally:
        decode.fast_decode = real


# --------------------------------------------------------------------------- data


def write_images(root: Path, scenario: Scenario, n_prompts: int, seed: int, vary: int = 0) -> list[list[Path]]:
    """Random images of ``scenario.image_size`` px; with ``vary`` > 0, image ``i`` is 0..vary patch pairs (28 px)
    shorter and narrower, by different amounts, so the vision tower's segments (images, and Qwen2.5-VL's edge
    windows) have several lengths, as in real data."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n_prompts):
        row = []
        for j in range(scenario.images_per_prompt):
            k = i * scenario.images_per_prompt + j  # vary == 0: both shrink by 0
            height, width = (scenario.image_size - 28 * ((k * m + m - 1) % (vary + 1)) for m in (1, 2))
            pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            path = root / f"img_{height}x{width}_{i}_{j}.png"
            Image.fromarray(pixels).save(path)
            row.append(path)
        paths.append(row)
    return paths


QUESTION = "Describe everything you can see in these pictures, object by object, with positions and colours."


def question(index: int, vary: int) -> str:
    """The prompt text of prompt ``index``: with ``vary`` > 0, 0..vary extra sentences, so prompt lengths (and
    every attention shape) change from step to step as in real data; kernels that plan per shape pay for it."""
    extra = (index * 3) % (vary + 1) if vary else 0
    return QUESTION + "".join(f" Then detail number {k}." for k in range(extra))


def vanilla_dataset(paths: list[list[Path]], vary: int = 0, questions: list[str] | None = None):
    from datasets import Dataset

    def transform(batch):
        batch = dict(batch)
        batch["images"] = [[Image.open(p).convert("RGB") for p in row] for row in batch["image_path"]]
        return batch

    prompts = [
        [{"role": "user", "content": [*({"type": "image"} for _ in row), {"type": "text", "text": text}]}]
        for row, text in zip(paths, questions or [question(i, vary) for i in range(len(paths))], strict=True)
    ]
    dataset = Dataset.from_dict({"prompt": prompts, "image_path": [[str(p) for p in row] for row in paths]})
    return dataset.with_transform(transform)


def write_rows(paths: list[list[Path]], jsonl: Path, vary: int = 0, questions: list[str] | None = None) -> Path:
    """The prompts as the package's JSONL rows (image paths on disk, ``questions[i]``, else ``question(i, vary)``),
    one per prompt."""
    with open(jsonl, "w") as f:
        for i, row in enumerate(paths):
            text = questions[i] if questions else question(i, vary)
            conversations = [
                {"from": "human", "value": "<image>" * len(row) + text},
                {"from": "gpt", "value": "<answer>none</answer>"},
            ]
            f.write(json.dumps({"id": i, "image": [str(p) for p in row], "conversations": conversations}) + "\n")
    return jsonl


def ours_dataset(
    paths: list[list[Path]], root: Path, module: Any, processor: Any, vary: int = 0, questions: list[str] | None = None
):
    from vlm_grpo.data import prepare_rows, read_rows, to_datasets

    jsonl = write_rows(paths, root / "rows.jsonl", vary, questions)
    rows, bad = read_rows([str(jsonl)], task_type="raw")
    rows = prepare_rows(rows, bad, module, processor)
    return to_datasets(rows, module)[0]


def length_reward(completions, **kwargs):
    """Cheap and text-dependent (non-zero advantages), the same for both trainers."""
    return [float(len(str(c)) % 7) for c in completions]


# --------------------------------------------------------------------------- trainers


def run_stamp() -> dict[str, Any]:
    """The date (UTC) and the versions of the measured packages, which RESULTS.md states beside every table."""
    names = ("torch", "transformers", "trl", "peft", "deepspeed")
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "versions": {m: sys.modules[m].__version__ for m in names if m in sys.modules},
    }


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (kernels on a GPU timeline: its busy time)."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy


def vary_images_arg(p: argparse.ArgumentParser) -> None:
    """``--vary_images N`` (see :func:`write_images`), shared by every script that writes images."""
    p.add_argument(
        "--vary_images",
        type=int,
        default=0,
        help="images 0..N patch pairs (28 px) smaller than the image size, by prompt: vision segments of several "
        "lengths, as in real data (default: one size)",
    )


def one_batch_args(p: argparse.ArgumentParser) -> None:
    """The arguments of the scripts that study one generated batch (``train_window.py``, ``varlen_check.py``)."""
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--image_size", type=int, default=448)
    p.add_argument("--completion_length", type=int, default=128)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--prompts_per_step", type=int, default=2)
    vary_images_arg(p)


def flag_bool(text: str) -> bool:
    """An argparse ``type`` for on/off flags written ``true``/``false`` (also 1/0, yes/no)."""
    return text.lower() in ("1", "true", "yes")


def device_defaults(args: argparse.Namespace) -> bool:
    """The scripts' shared defaults: ``--preset tiny`` names the tiny Qwen2.5-VL, and ``--dtype`` (when the script
    has one and it was left out) is bf16 on a GPU, fp32 on CPU. Returns whether the device is a GPU."""
    if args.preset == "tiny":
        args.preset = "tiny_qwen2_5_vl"
    on_gpu = args.device.startswith("cuda")
    if hasattr(args, "dtype"):
        args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    return on_gpu


def grpo_config(
    kind: str, args: argparse.Namespace, scenario: Scenario, workdir: Path, max_steps: int, **extra: Any
) -> Any:
    """``GRPOConfig`` (vanilla) or ``VLMGRPOConfig`` (ours, with the variant's overrides) for one run:
    ``args.prompts_per_step`` x G samples per step, generation forced to the full completion length.
    ``extra`` are further config fields (the variant's win)."""
    from bench_policy import BENCH_ONLY, is_vanilla, parse_variant
    from trl import GRPOConfig

    from vlm_grpo.configs import VLMGRPOConfig

    overrides = {k: v for k, v in (extra | parse_variant(kind)[1]).items() if k not in BENCH_ONLY}
    generation_kwargs = {"min_new_tokens": scenario.completion_length}
    if "cache_implementation" in overrides:
        generation_kwargs["cache_implementation"] = overrides.pop("cache_implementation")
    fields = {
        "output_dir": str(workdir / f"out_{kind.partition(':')[0]}"),
        "max_steps": max_steps,
        "per_device_train_batch_size": args.prompts_per_step * args.num_generations,
        "num_generations": args.num_generations,
        "max_completion_length": scenario.completion_length,
        "generation_kwargs": generation_kwargs,
        "beta": args.beta,
        "learning_rate": 1e-6,
        "gradient_checkpointing": args.gradient_checkpointing,
        "bf16": args.dtype == "bfloat16",
        "use_cpu": torch.device(args.device).type == "cpu",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": args.seed,
        "dataloader_num_workers": 0,
    }
    return (GRPOConfig if is_vanilla(kind) else VLMGRPOConfig)(**(fields | overrides))


def grpo_trainer(
    kind: str,
    model: Any,
    processor: Any,
    module: Any,
    config: Any,
    paths: list[list[Path]],
    workdir: Path,
    cls: type | None = None,
    vary_prompts: int = 0,
    questions: list[str] | None = None,
    **kwargs: Any,
) -> Any:
    """The trainer of ``kind`` (``cls`` overrides its class) on ``paths``: vanilla TRL on an in-memory dataset,
    ours on JSONL rows through the package's data pipeline; ``questions`` are the prompts' texts (default:
    :func:`question`). ``kwargs`` go to the trainer."""
    from bench_policy import is_vanilla
    from trl import GRPOTrainer

    from vlm_grpo.trainer import VLMGRPOTrainer

    if is_vanilla(kind):
        cls = cls or GRPOTrainer
        dataset = vanilla_dataset(paths, vary_prompts, questions)
    else:
        cls = cls or VLMGRPOTrainer
        dataset = ours_dataset(paths, workdir, module, processor, vary_prompts, questions)
        kwargs = {"vlm_module": module, **kwargs}
    return cls(
        model=model,
        reward_funcs=[length_reward],
        args=config,
        train_dataset=dataset,
        processing_class=processor,
        **kwargs,
    )


def format_table(results: list[Result]) -> str:
    header = (
        f"{'scenario':<20} {'trainer':<14} {'s/step':>7} {'samp/s':>7} {'tok/s':>8} {'peakGiB':>8} {'MFU':>6} "
        + " ".join(f"{p[:8]:>8}" for p in PHASES)
        + f" {'first s':>7} {'ms/tok':>7} {'x floor':>7} {'x vanilla':>9}"
    )
    lines = [header, "-" * len(header)]
    vanilla = {r.scenario: r for r in results if r.trainer == "vanilla"}
    for r in results:
        base = vanilla.get(r.scenario)
        ratio = f"{r.samples_per_s / base.samples_per_s:9.2f}" if base and base.samples_per_s else f"{'':>9}"
        mem = f"{r.peak_mem_gib:8.1f}" if r.peak_mem_gib is not None else f"{'-':>8}"
        mfu = f"{100 * r.mfu:5.1f}%" if r.mfu is not None else f"{'-':>6}"
        phases = " ".join(f"{r.phases_s[p]:8.3f}" for p in PHASES)
        first = r.step_times_s[0] if r.step_times_s else float("nan")
        floor = f"{r.floor_ratio:7.2f}" if r.floor_ratio is not None else f"{'-':>7}"
        lines.append(
            f"{r.scenario:<20} {r.trainer:<14} {r.step_s:7.3f} {r.samples_per_s:7.2f} {r.tokens_per_s:8.0f} "
            f"{mem} {mfu} {phases} {first:7.2f} {r.decode_ms_per_token or r.gen_ms_per_token:7.2f} {floor} {ratio}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The command line of bench_grpo.py (bench_tools.py takes the same); ``description`` heads ``--help``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="tiny", help="model preset (vlm_grpo.testing.presets); tiny = tiny_qwen2_5_vl")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--image_sizes", type=int, nargs="+", default=None, help="default: 448 896 (GPU), 56 (CPU)")
    p.add_argument("--images_per_prompt", type=int, nargs="+", default=[1])
    p.add_argument("--completion_lengths", type=int, nargs="+", default=None, help="default: 128 (GPU), 8 (CPU)")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--prompts_per_step", type=int, default=2)
    vary_images_arg(p)
    p.add_argument("--steps", type=int, default=3, help="measured steps (after warm-up)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--beta", type=float, default=0.0, help="KL coefficient (TRL's default 0); > 0 adds a reference pass"
    )
    p.add_argument("--gradient_checkpointing", type=flag_bool, default=True)
    p.add_argument("--lora_r", type=int, default=0, help="> 0: every trainer trains the same LoRA (language model)")
    p.add_argument(
        "--freeze_vision", type=flag_bool, default=False,
        help="freeze the vision tower and projector for every trainer (LoRA freezes them anyway): ours then reuses "
        "the generation's image features in every log-prob pass (reuse_vision_features)",
    )  # fmt: skip
    p.add_argument(
        "--lora_dropout", type=float, default=0.05, help="0: fast decode folds the adapters into its fused weights"
    )
    p.add_argument(
        "--trainers",
        nargs="+",
        default=["vanilla", "ours"],
        help="vanilla, and variants as name[:key=value,...] over VLMGRPOConfig (GRPOConfig for names starting with "
        "'vanilla'), e.g. 'ours' 'noshare:share_prompt=false' 'vanilla_static:cache_implementation=static'",
    )
    p.add_argument("--peak_tflops", type=float, default=None, help="card's dense bf16 peak (default: by name)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vary_prompts", type=int, default=0,
        help="add 0..N sentences to the prompts so their lengths change from step to step (default: one length)",
    )  # fmt: skip
    p.add_argument(
        "--no_cudnn_sdpa", action="store_true",
        help="take cuDNN out of sdpa's backends for every trainer, vanilla included (it builds an execution plan "
        "per new shape); without it each trainer starts from torch's default and ours turns cuDNN off itself "
        "unless cudnn_attention=true",
    )  # fmt: skip
    p.add_argument(
        "--shape", default=None,
        help="an EasyR1-shaped cycle instead of the scenario grid (benchmarks/bench_shape.py): easyr1_geo3k, "
        "easyr1_geo3k_32x8 or easyr1_geo3k_varied, with field overrides as name:prompts=4,max_completion=32; "
        "--steps / --warmup then count generation cycles",
    )  # fmt: skip
    p.add_argument(
        "--eos_bias", type=float, default=None,
        help="with --shape: the LM head's EOS bias, fixed (default: calibrated, then corrected after the first "
        "generation when --warmup counts a cycle; the result records both)",
    )  # fmt: skip
    p.add_argument("--profile_dir", default=None, help="profile one extra step per run; top ops written here")
    p.add_argument("--out", default="bench_results.json")
    args = p.parse_args(argv)
    on_gpu = device_defaults(args)
    args.image_sizes = args.image_sizes or ([448, 896] if on_gpu else [56])
    args.completion_lengths = args.completion_lengths or ([128] if on_gpu else [8])
    from bench_policy import card_peak_tflops

    args.peak_tflops = args.peak_tflops or card_peak_tflops(args.device)
    return args
