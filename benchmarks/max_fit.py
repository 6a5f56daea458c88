"""The largest GRPO batch that trains on one card: prompts per step for full fine-tuning and for LoRA.

    python benchmarks/max_fit.py --preset qwen2_5_vl_7b --modes full lora --out max_fit_7b.json
    python benchmarks/max_fit.py --preset tiny --device cpu --max_prompts 2          # CI smoke test

For each mode the model is built once (random weights of the preset's real shapes, bf16, sdpa) and
every try builds a fresh ``VLMGRPOTrainer`` the way ``bench_grpo.py`` does (JSONL rows with image
files through the package's data pipeline, generation forced to the full completion length,
gradient checkpointing on, TRL's default AdamW) and trains ``--steps`` full optimizer steps with
``prompts x G`` samples per device. AdamW's state only exists after the first optimizer step, so
before the first step the state is allocated by one AdamW step on zero gradients (a no-op update
with weight decay 0): every step measured already holds weights + AdamW state, and its optimizer
step holds the gradients too, as every step after the first of a real run does.

Search: 1, 2, 4, ... prompts until a try runs out of memory (``torch.OutOfMemoryError``) or reaches
``--max_prompts``, then bisection between the last fit and the first OOM. Peak memory is
``torch.cuda.max_memory_allocated`` of the try. ``--memory_limit_gib`` caps the card (a CUDA
allocator limit, for asking "does it fit 80 GB" on a bigger card); on the CPU, where nothing runs out
of memory, a try whose peak process memory (peak RSS) exceeds it counts as not fitting.
``--simulate_oom_above N`` (testing) raises ``torch.OutOfMemoryError`` inside the step of tries with
more than N prompts, so the CPU smoke test walks the whole search and its recovery path.

The table goes to stdout; the JSON (``--out``) is rewritten after every try, so a run cut short
keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from bench_common import (
    Scenario,
    device_defaults,
    flag_bool,
    grpo_config,
    grpo_trainer,
    run_stamp,
    write_images,
)
from bench_policy import build_policy
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

GIB = 2**30


@dataclass
class Try:
    prompts: int
    samples: int
    fits: bool
    peak_gib: float | None
    reserved_gib: float | None  # CUDA: peak reserved by the caching allocator
    base_gib: float | None  # allocated before the try (model, LoRA): should not grow from try to try
    seconds: float
    error: str | None = None


@dataclass
class ModeResult:
    preset: str
    mode: str
    image_size: int
    completion_length: int
    num_generations: int
    max_prompts: int
    status: str = "ok"  # ok | no_fit (not even 1 prompt) | model_oom (weights alone) | stopped | error
    largest_prompts: int = 0
    samples_per_step: int = 0
    peak_gib: float | None = None
    first_oom_prompts: int | None = None
    fits_one_prompt: bool = False
    capped: bool = False  # every size up to --max_prompts fit: the real limit is higher
    params: int = 0
    trainable_params: int = 0
    static_gib: float | None = None  # weights + gradients + AdamW state of the trainable parameters
    model_gib: float | None = None  # measured after building the model (CUDA)
    note: str = ""
    tries: list[Try] = field(default_factory=list)


# --------------------------------------------------------------------------- memory


def memory_reset(device: torch.device) -> None:
    """Start a try's peak measurement."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: "5" resets the process's peak RSS (VmHWM)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def memory_peak(device: torch.device) -> tuple[float | None, float | None]:
    """(peak GiB, peak reserved GiB) since :func:`memory_reset`: CUDA allocated / reserved; CPU peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB, None
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB, None


def memory_now(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def static_gib(model: torch.nn.Module) -> float:
    """Weights + (gradient + AdamW's two moments) per trainable parameter, in the parameters' dtypes."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size() * (4 if p.requires_grad else 1)
    return total / GIB


# --------------------------------------------------------------------------- trainer pieces


class Phase:
    """Where in a try we are, for the OOM message."""

    name = "trainer init"


class AllocateOptimizerState(TrainerCallback):
    """One AdamW step on zero gradients before the first real step: the optimizer state exists from then on.

    With zero gradients both moments stay 0 and the update is 0 (weight decay is 0 by default); the
    state tensors are the optimizer's own, so their size and layout are exactly a real run's.
    """

    def __init__(self, phase: Phase) -> None:
        self.phase = phase

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.phase.name = "optimizer state"
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        params = [p for group in inner.param_groups for p in group["params"] if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        self.phase.name = "step"

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.phase.name = "optimizer step"

    def on_step_end(self, args, state, control, **kwargs):
        self.phase.name = "step"


def fit_trainer_class(phase: Phase, simulate_oom_above: int | None, num_generations: int) -> type:
    """``VLMGRPOTrainer`` that records its phase (and, for tests, runs out of memory on purpose)."""
    from vlm_grpo.trainer import VLMGRPOTrainer

    class FitTrainer(VLMGRPOTrainer):
        def _prepare_inputs(self, generation_batch):
            phase.name = "input preparation"
            return super()._prepare_inputs(generation_batch)

        def _generate(self, prompts):
            phase.name = "generation"
            try:
                return super()._generate(prompts)
            finally:
                phase.name = "input preparation"

        def compute_loss(self, model, inputs, *args, **kwargs):
            phase.name = "loss forward"
            rows = inputs["completion_ids"].size(0)
            if simulate_oom_above is not None and rows > simulate_oom_above * num_generations:
                raise torch.OutOfMemoryError(f"simulated: {rows} rows > --simulate_oom_above {simulate_oom_above}")
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            phase.name = "backward"
            return loss

    return FitTrainer


# --------------------------------------------------------------------------- one mode


class ModeRun:
    """The model of one mode, built once; :meth:`attempt` trains one try on it."""

    def __init__(self, args: argparse.Namespace, mode: str, scenario: Scenario, workdir: Path, paths) -> None:
        self.args, self.mode, self.scenario, self.workdir, self.paths = args, mode, scenario, workdir, paths
        self.device = torch.device(args.device)
        self.phase = Phase()
        # LoRA on the language model, vision frozen (the package picks the targets), built once so tries reuse it.
        lora_r = args.lora_r if mode == "lora" else 0
        model, processor, module = build_policy(args, workdir, mode, lora_r=lora_r)
        self.model, self.processor, self.module = model, processor, module

    def attempt(self, prompts: int) -> Try:
        args = argparse.Namespace(**{**vars(self.args), "prompts_per_step": prompts})
        steps = args.warmup_steps + args.steps
        quiet = {"disable_tqdm": True, "logging_strategy": "no"}
        config = grpo_config("ours", args, self.scenario, self.workdir, max_steps=steps, **quiet)
        cls = fit_trainer_class(self.phase, args.simulate_oom_above, args.num_generations)
        self.phase.name = "trainer init"
        base = memory_now(self.device)
        memory_reset(self.device)
        start = time.perf_counter()
        error = None
        trainer = None
        try:
            trainer = grpo_trainer(
                "ours",
                self.model,
                self.processor,
                self.module,
                config,
                self.paths[: prompts * steps],
                self.workdir,
                cls=cls,
                callbacks=[AllocateOptimizerState(self.phase)],
            )
            trainer.remove_callback(PrinterCallback)  # the per-try metrics would bury the search's own lines
            trainer.train()
        except Exception as exc:
            if not is_oom(exc):
                raise
            error = f"OOM in {self.phase.name}: {str(exc).strip().splitlines()[0][:300]}"
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
            peak, reserved = memory_peak(self.device)
            del trainer
            self.model.zero_grad(set_to_none=True)
            release(self.device)
        fits = error is None
        limit = args.memory_limit_gib
        if fits and limit is not None and self.device.type != "cuda" and peak is not None and peak > limit:
            fits, error = False, f"peak {peak:.2f} GiB > --memory_limit_gib {limit}"
        return Try(prompts, prompts * args.num_generations, fits, peak, reserved, base, seconds, error)


def search(attempt, cap: int, out_of_time) -> tuple[int, int | None, dict[int, Try], bool]:
    """Doubling from 1 until a try fails or reaches ``cap``, then bisection between the last fit and the
    first failure. Returns (largest fit or 0, first failure or None, tries, stopped early)."""
    tries: dict[int, Try] = {}
    last_fit, first_oom = 0, None
    n = 1
    while True:
        if out_of_time():
            return last_fit, first_oom, tries, True
        tries[n] = attempt(n)
        if not tries[n].fits:
            first_oom = n
            break
        last_fit = n
        if n >= cap:
            return last_fit, None, tries, False
        n = min(2 * n, cap)
    while first_oom - last_fit > 1:
        if out_of_time():
            return last_fit, first_oom, tries, True
        mid = (last_fit + first_oom) // 2
        tries[mid] = attempt(mid)
        if tries[mid].fits:
            last_fit = mid
        else:
            first_oom = mid
    return last_fit, first_oom, tries, False


def run_mode(args, mode, scenario, workdir, paths, card_gib, out_of_time, on_try) -> ModeResult:
    result = ModeResult(
        preset=args.preset,
        mode=mode,
        image_size=scenario.image_size,
        completion_length=scenario.completion_length,
        num_generations=args.num_generations,
        max_prompts=args.max_prompts,
    )
    device = torch.device(args.device)
    release(device)
    run = None
    try:
        run = ModeRun(args, mode, scenario, workdir, paths)
    except Exception as exc:
        if not is_oom(exc):
            raise
        release(device)
        result.status = "model_oom"
        result.note = (
            f"the model's weights alone do not fit ({card_gib:.1f} GiB card): {str(exc).splitlines()[0][:200]}"
        )
        return result
    result.params = sum(p.numel() for p in run.model.parameters())
    result.trainable_params = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    result.static_gib = static_gib(run.model)
    result.model_gib = memory_now(device)

    def attempt(n: int) -> Try:
        t = run.attempt(n)
        result.tries.append(t)
        on_try(result, t)
        return t

    last_fit, first_oom, tries, stopped = search(attempt, args.max_prompts, out_of_time)
    run = None  # the model goes before the next mode builds its own
    release(device)
    result.largest_prompts = last_fit
    result.samples_per_step = last_fit * args.num_generations
    result.peak_gib = tries[last_fit].peak_gib if last_fit else None
    result.first_oom_prompts = first_oom
    result.fits_one_prompt = 1 in tries and tries[1].fits
    result.capped = last_fit >= args.max_prompts
    if stopped:
        result.status = "stopped"
        result.note = "search stopped by --time_budget_s; the limit lies between the two sizes shown"
    elif last_fit == 0 and 1 in tries:
        result.status = "no_fit"
        one = tries[1]
        if result.static_gib > card_gib or "optimizer state" in (one.error or ""):
            result.note = (
                f"the model itself does not fit: weights + gradients + AdamW state = {result.static_gib:.1f} GiB "
                f"on a {card_gib:.1f} GiB card"
            )
        else:
            result.note = (
                f"weights + gradients + AdamW state ({result.static_gib:.1f} GiB) fit, "
                f"but not one prompt x {args.num_generations} samples"
            )
    elif result.capped:
        result.note = f"every size up to --max_prompts {args.max_prompts} fit"
    return result


# --------------------------------------------------------------------------- output


def fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[ModeResult]) -> str:
    header = (
        f"{'preset':<16} {'mode':<5} {'image':>6} {'C':>5} {'G':>3} {'prompts':>8} {'samples':>8} "
        f"{'peakGiB':>8} {'firstOOM':>9} {'staticGiB':>9}  note"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        largest = f"{r.largest_prompts}{'+' if r.capped else ''}"
        lines.append(
            f"{r.preset:<16} {r.mode:<5} {r.image_size:>6} {r.completion_length:>5} {r.num_generations:>3} "
            f"{largest:>8} {r.samples_per_step:>8} {fmt(r.peak_gib):>8} {fmt(r.first_oom_prompts, 'd'):>9} "
            f"{fmt(r.static_gib):>9}  {r.status if r.status != 'ok' else ''}{' ' if r.status != 'ok' else ''}"
            f"{r.note}"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset", default="qwen2_5_vl_7b", help="model preset (vlm_grpo.testing.presets); tiny = tiny_qwen2_5_vl"
    )
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--image_size", type=int, default=None, help="default: 448 (GPU), 56 (CPU)")
    p.add_argument("--completion_length", type=int, default=None, help="default: 128 (GPU), 8 (CPU)")
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--max_prompts", type=int, default=32, help="cap of the search (prompts per step)")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps per try")
    p.add_argument("--warmup_steps", type=int, default=0, help="extra real steps before them (the AdamW state is "
                   "allocated anyway; these also expose allocator fragmentation)")  # fmt: skip
    p.add_argument("--lora_r", type=int, default=64)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (TRL's default 0)")
    p.add_argument("--gradient_checkpointing", type=flag_bool, default=True)
    p.add_argument("--memory_limit_gib", type=float, default=None, help="CUDA: cap the allocator at this much (a "
                   "smaller card on a bigger one); CPU: a try whose peak RSS exceeds it does not fit")  # fmt: skip
    p.add_argument("--simulate_oom_above", type=int, default=None, help="testing: tries with more prompts raise OOM")
    p.add_argument("--time_budget_s", type=float, default=None, help="start no try after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="max_fit.json")
    args = p.parse_args(argv)
    on_gpu = device_defaults(args)
    args.image_size = args.image_size or (448 if on_gpu else 56)
    args.completion_length = args.completion_length or (128 if on_gpu else 8)
    if args.max_prompts < 1:
        p.error("--max_prompts must be >= 1")
    return args


def card_memory_gib(args: argparse.Namespace) -> float:
    """The card's memory, or --memory_limit_gib (applied to the CUDA allocator here) when smaller."""
    device = torch.device(args.device)
    if device.type != "cuda":
        return args.memory_limit_gib or float("inf")
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    if args.memory_limit_gib is not None and args.memory_limit_gib < total:
        torch.cuda.set_per_process_memory_fraction(args.memory_limit_gib / total, device)
        return args.memory_limit_gib
    return total


def main(argv: list[str] | None = None) -> list[ModeResult]:
    args = parse(argv)
    start = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    card_gib = card_memory_gib(args)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    scenario = Scenario(args.image_size, 1, args.completion_length)
    results: list[ModeResult] = []

    def write() -> None:
        payload = {
            "device": device_name,
            "card_gib": card_gib if card_gib != float("inf") else None,
            "peak": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process peak RSS (VmHWM)",
            "args": vars(args),
            "env": {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if k in os.environ},
            **run_stamp(),
            "wall_s": time.perf_counter() - start,
            "results": [asdict(r) for r in results],
        }
        Path(args.out).write_text(json.dumps(payload, indent=2))

    def on_try(result: ModeResult, t: Try) -> None:
        if not any(r is result for r in results):
            results.append(result)
        status = "fits" if t.fits else f"does not fit ({t.error})"
        print(
            f"[max_fit] {result.preset} {result.mode}: {t.prompts} prompts ({t.samples} samples): {status}; "
            f"peak {fmt(t.peak_gib, '.2f')} GiB, reserved {fmt(t.reserved_gib, '.2f')} GiB, "
            f"base {fmt(t.base_gib, '.2f')} GiB, {t.seconds:.1f} s",
            flush=True,
        )
        write()

    def out_of_time() -> bool:
        return args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        paths = write_images(workdir, scenario, args.max_prompts * (args.warmup_steps + args.steps), args.seed)
        for mode in args.modes:
            t0 = time.perf_counter()
            try:
                result = run_mode(args, mode, scenario, workdir, paths, card_gib, out_of_time, on_try)
            except Exception as exc:  # keep the other modes' results; exit non-zero at the end
                traceback.print_exc()
                failed = True
                result = next((r for r in results if r.mode == mode), None) or ModeResult(
                    args.preset, mode, args.image_size, args.completion_length, args.num_generations, args.max_prompts
                )
                result.status, result.note = "error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            release(device)  # after the except block: the traceback no longer holds the model
            if not any(r is result for r in results):
                results.append(result)
            print(f"[max_fit] {args.preset} {mode}: done in {time.perf_counter() - t0:.0f} s", flush=True)
            write()
    print(
        f"\ndevice: {device_name} ({fmt(card_gib if card_gib != float('inf') else None)} GiB); "
        f"G={args.num_generations}; steps per try {args.steps} (+{args.warmup_steps} warm-up); "
        f"peak = {'max_memory_allocated' if device.type == 'cuda' else 'peak RSS'}; "
        f"'+' = the cap was reached; wall {time.perf_counter() - start:.0f} s"
    )
    print(format_table(results))
    if failed:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
