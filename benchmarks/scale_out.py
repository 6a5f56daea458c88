"""Weak scaling of ``VLMGRPOTrainer`` over 1, 2 and 4 GPUs with DeepSpeed ZeRO-2 / ZeRO-3.

    source benchmarks/device_env.sh && python3 benchmarks/scale_out.py --plan zero2      # 3B, ZeRO-2, 1/4/2 GPUs
    source benchmarks/device_env.sh && python3 benchmarks/scale_out.py --plan zero3      # 7B, ZeRO-3
    python benchmarks/scale_out.py --plan cpu                                             # wiring check, gloo

The EasyR1-shaped cycle (``--shape``, bench_shape.py's names and overrides; ``scale_shape.py`` says what is measured)
on 2 GPUs against 1, as two commands at once on one 4-GPU machine, then merged (about 540 s in all):

    source benchmarks/device_env.sh
    W=/tmp/scale_shape; S=easyr1_geo3k
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/scale_out.py --plan zero2 --shape $S --nproc 1 --work $W \
        --out $OUT/n1 --budget_s 520 > $OUT/n1.log 2>&1 &
    CUDA_VISIBLE_DEVICES=2,3 python3 benchmarks/scale_out.py --plan zero2 --shape $S --nproc 2 --work $W \
        --out $OUT/n2 --budget_s 520 > $OUT/n2.log 2>&1; wait
    python3 benchmarks/scale_out.py --merge $OUT/n1/*summary.json $OUT/n2/*summary.json --out $OUT/merged.json

``--plan zero3`` (7B) is the same, as a second such command. Commands sharing a ``--work`` folder build its model
and data once (a lock file; the other waits); torchrun's ``--standalone`` gives each run its own free port.

Every run is the CLI users run, ``src/vlm_grpo/grpo_jsonl.py``, under ``torch.distributed.run`` with the same work
per device: ``--prompts_per_device`` prompts x G samples (2 x 8), one random ``--image_size`` image per prompt,
generation forced to ``--completion_length`` tokens (``min_new_tokens``), full fine-tuning, bf16, sdpa, gradient
checkpointing, ``local_scripts/zero{2,3}.json``, the package's speed options at their defaults, no checkpoint.
The model is a preset of ``vlm_grpo.testing.presets`` with random weights, built once per machine.

This file is the driver (plans, memory gate, torchrun runs, budget and time-outs, table); torchrun starts it again
with ``SCALE_OUT_WORKER`` set, and it then hands over to ``scale_out_worker.worker`` (imported only then): on every
rank ``grpo_jsonl.main`` with ``bench_common``'s phase timers and two callbacks (``Recorder``: the time of every step,
peak memory, which speed features ran; rank 0 also profiles one extra step after the measured ones and sums the GPU
time of its NCCL kernels, the time in collectives). The model is never saved (``save_model`` is a no-op there).

Per run, one JSON file under ``--out`` (default ``$OUT``): median seconds per step after the warm-up, global
samples/s, weak-scaling efficiency against the fewest GPUs that ran (ideally 1: ``t_step(base) / t_step(N)``), peak
GPU memory of every rank, generation's share of the step, fast_decode's ms per token, the collectives, and the
features that stayed on, with the package's own log lines saying why one is off. One line per run as it ends
(``[scale] {...}``) and a markdown table at the end.

A run that cannot fit the card is not started: the model states need ``--plan``'s bytes per parameter (bf16
weights and gradients, fp32 master weights and Adam moments: ZeRO-2 ``2 + 18/N`` with the fp32 gradient partition
of the step, ZeRO-3 ``16/N + 2`` with the weights gathered once per generation call, no DeepSpeed ``8``: bf16 AdamW
states) plus ``--headroom_gib``. ZeRO-3 on one GPU at 7B (8.3 B parameters: ~139 GiB) is replaced by a run without
DeepSpeed, the only way one 80 GB card trains it (the baseline's numerics differ: no fp32 master weights), and so is a
1-GPU run that runs out of memory; ``--no_fallback`` skips both. ``--force`` starts everything. Runs go in
``--nproc`` order (default 1 4 2: baseline and the 4-GPU point first), each under a time-out that also keeps the whole
command within ``--budget_s`` (a run cut short after its measured steps still reports them).

Phases (seconds per step, rank 0) are bench_common's; under DeepSpeed the optimizer step (and ZeRO's gradient
reduction) runs inside ``accelerator.backward``, so it is counted in ``backward``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the helper modules next to this file (it also runs as a script)
    sys.path.insert(0, str(HERE))
import scale_shape  # noqa: E402
from scale_report import (  # noqa: E402
    PHASES,
    efficiency,
    efficiency_lines,
    features_report,
    fmt,
    median,
    merge,
    rounded,
    table,
)

ROOT = HERE.parent
WORKER_ENV = "SCALE_OUT_WORKER"

PLANS: dict[str, dict[str, Any]] = {
    "zero2": {"preset": "qwen2_5_vl_3b", "ds": "zero2"},
    "zero3": {"preset": "qwen2_5_vl_7b", "ds": "zero3"},
    "zero3_3b": {"preset": "qwen2_5_vl_3b", "ds": "zero3"},
    "cpu": {
        "preset": "tiny_qwen2_5_vl",
        "ds": "none",
        "device": "cpu",
        "nproc": [1, 2],
        "image_size": 56,
        "completion_length": 8,
        "steps": 2,
    },
}
# Rough seconds for a run (launch, load, first step with its compilation, 7 steps, exit), for the budget.
RUN_ESTIMATE_S = {"qwen2_5_vl_3b": 120, "qwen2_5_vl_7b": 210}


def safetensors_params(model_dir: Path) -> int:
    """Parameters stored in a checkpoint folder (from the safetensors headers; nothing is loaded)."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                n = 1
                for d in info["shape"]:
                    n *= d
                total += n
    return total


def predicted_gib(ds: str, nproc: int, params: int) -> float:
    """Model-state memory per rank for full fine-tuning with Adam in bf16 mixed precision (see the module doc)."""
    per_param = {"none": 8.0, "zero2": 2 + 18 / nproc, "zero3": 16 / nproc + 2}[ds]
    return per_param * params / 2**30


def gpu_info() -> tuple[int, float | None, str]:
    """(GPUs, GiB of the smallest, name) from nvidia-smi; the orchestrator never touches CUDA itself."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, None, "none"
    rows = [line.rsplit(",", 1) for line in out.strip().splitlines() if "," in line]
    if not rows:
        return 0, None, "none"
    return len(rows), min(float(mem) for _, mem in rows) / 1024, rows[0][0].strip()


def build_model(args: argparse.Namespace, model_dir: Path, env: dict[str, str]) -> float:
    """Random weights of the preset, once per machine (seconds spent; 0 when already there)."""
    if (model_dir / "config.json").is_file():
        return 0.0
    start = time.time()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    partial = model_dir.with_name(model_dir.name + ".partial")  # a build cut short is never taken for a model
    shutil.rmtree(partial, ignore_errors=True)
    flags = {"preset": args.preset, "out": partial, "device": args.device, "dtype": dtype}
    subprocess.run([args.python, "-m", "vlm_grpo.testing.tiny", *as_argv(flags)], check=True, env=env, timeout=600)
    partial.rename(model_dir)
    return time.time() - start


def write_data(args: argparse.Namespace, data_dir: Path, n_prompts: int) -> Path:
    """``n_prompts`` JSONL rows with one random image each (bench_common's images and prompts); with ``--shape``, its
    image sizes and Geometry3K-like problems with EasyR1's format prompt (bench_shape.geo3k_questions)."""
    jsonl = data_dir / "rows.jsonl"
    if jsonl.is_file() and sum(1 for _ in open(jsonl)) >= n_prompts:
        return jsonl
    from bench_common import Scenario, write_images, write_rows

    data_dir.mkdir(parents=True, exist_ok=True)
    scenario = Scenario(args.image_size, 1, args.completion_length)
    vary = args.shape_def.vary_images if args.shape else 0
    paths = write_images(data_dir, scenario, n_prompts, seed=0, vary=vary)
    if not args.shape:
        return write_rows(paths, jsonl, args.vary_prompts)
    from bench_shape import geo3k_questions

    return write_rows(paths, jsonl, questions=geo3k_questions(n_prompts, seed=0))


def as_argv(flags: dict[str, Any]) -> list[str]:
    return [item for key, value in flags.items() for item in (f"--{key}", str(value))]


def grpo_argv(args: argparse.Namespace, ds: str, model_dir: Path, jsonl: Path, out_dir: Path) -> list[str]:
    """grpo_jsonl.py's flags for one run: the same work per device whatever the number of GPUs."""
    flags: dict[str, Any] = {
        "model_name_or_path": model_dir,
        "data_file_paths": jsonl,
        "reward_funcs": f"{HERE / 'bench_common.py'}:length_reward",
        "output_dir": out_dir,
        "per_device_train_batch_size": args.prompts_per_device * args.num_generations,
        "num_generations": args.num_generations,
        "max_completion_length": args.completion_length,
        "generation_kwargs": json.dumps({"min_new_tokens": args.completion_length}),  # every row decodes C tokens
        "max_steps": args.warmup + args.steps + int(args.profile),
    }
    if args.shape:  # the shape's micro-batches and accumulation; its cycles count 4 optimizer steps each
        flags.pop("generation_kwargs")
        flags.update(scale_shape.flags(args.shape_def), max_steps=(args.warmup + args.steps) * args.shape_def.updates)
    flags |= {
        "learning_rate": 1e-6,
        "gradient_checkpointing": "true",
        "attn_implementation": "sdpa",
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "plot": "false",
        "disable_tqdm": "true",
        "seed": 0,
        "overwrite_output_dir": "true",
    }
    if args.device == "cuda":
        flags["bf16"] = "true"
        if ds == "none":  # bf16 weights, as DeepSpeed's bf16 mode computes in (TRL's default loads fp32)
            flags["dtype"] = "bfloat16"
    else:
        flags["use_cpu"] = "true"
    if ds != "none":
        flags["deepspeed"] = ROOT / "local_scripts" / f"{ds}.json"
    return as_argv(flags) + list(args.extra)


def failure(log: Path) -> str:
    """Why a run failed, from its log: OOM, else the last exception a rank raised (not torchrun's own)."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    if re.search(r"OutOfMemoryError|CUDA out of memory", text):
        return "OOM"
    raised = re.findall(r"^(?:\[rank\d+\]: )?([\w.]*(?:Error|Exception|Interrupt)\b:.*)$", text, re.M)
    raised = [line for line in raised if "ChildFailedError" not in line]
    return raised[-1].strip()[:300] if raised else "no result (see the log)"


def summarise(args: argparse.Namespace, run: dict[str, Any], run_dir: Path, ctx: dict[str, Any]) -> None:
    """Fill ``run`` from the ranks' result files."""
    ranks = sorted((json.loads(p.read_text()) for p in run_dir.glob("rank*.json")), key=lambda r: r["rank"])
    if not ranks:
        return
    if args.shape:
        scale_shape.summarise(args, args.shape_def, run, ranks, ctx["params"], ctx["peak_tflops"])
        run.update(peak_alloc_gib=[r.get("peak_alloc_gib") for r in ranks], startup_s=ranks[0].get("train_begin_s"))
        run.update(peak_reserved_gib=[r.get("peak_reserved_gib") for r in ranks], log_lines=ranks[0].get("log_lines"))
        r0 = ranks[0]
        run["features"] = features_report(r0.get("features") or {}, r0.get("counts") or {}, r0.get("log_lines") or [])
        return
    w, s = args.warmup, args.steps
    r0 = ranks[0]
    steps = r0["steps"][w : w + s]
    walls = [st["_wall"] for st in steps]
    step_s = median(walls)
    run["measured_steps"] = len(walls)
    run["step_times_s"] = [round(st["_wall"], 3) for st in r0["steps"]]
    if step_s is None:
        return
    n = run["nproc"]
    phases = {p: median([st.get(p, 0.0) for st in steps]) for p in PHASES}
    tokens = sum(
        median([st.get("_prompt_tokens", 0) + st.get("_completion_tokens", 0) for st in r["steps"][w : w + s]]) or 0
        for r in ranks
    )
    decoded = median([st.get("_decode_tokens", 0.0) for st in steps])
    run.update(
        step_s=step_s,
        step_s_slowest_rank=max(median([st["_wall"] for st in r["steps"][w : w + s]]) or 0 for r in ranks),
        first_step_s=r0["steps"][0]["_wall"] if r0["steps"] else None,
        samples_per_s=n * args.prompts_per_device * args.num_generations / step_s,
        tokens_per_s=tokens / step_s,
        phases_s=phases,
        generation_share=phases["generation"] / step_s,
        decode_ms_per_token=1e3 * phases["decode"] / decoded if decoded else None,
        peak_alloc_gib=[r.get("peak_alloc_gib") for r in ranks],
        peak_reserved_gib=[r.get("peak_reserved_gib") for r in ranks],
        startup_s=r0.get("train_begin_s"),
        collectives=r0.get("collectives"),
        static_features=r0.get("features"),
        counts=r0.get("counts"),
        log_lines=r0.get("log_lines"),
        features=features_report(r0.get("features") or {}, r0.get("counts") or {}, r0.get("log_lines") or []),
    )
    if len(walls) < s:
        run["status"] = f"partial ({len(walls)}/{s} measured steps)"


def run_one(args: argparse.Namespace, ds: str, n: int, ctx: dict[str, Any], note: str = "") -> dict[str, Any]:
    """One torchrun of grpo_jsonl.py on ``n`` devices with DeepSpeed ``ds``; what it measured, or why not."""
    run: dict[str, Any] = {"plan": args.plan, "preset": args.preset, "nproc": n, "status": "ok", "notes": []}
    if note:
        run["notes"].append(note)
    if args.device == "cuda":
        card, params = ctx["card_gib"], ctx["params"]
        need = predicted_gib(ds, n, params)
        if n > ctx["gpus"]:
            run["status"] = f"skipped: {n} GPUs asked, {ctx['gpus']} present"
        elif card and need + args.headroom_gib > card and not args.force:
            plain = predicted_gib("none", 1, params)
            if n == 1 and ds != "none" and not args.no_fallback and plain + args.headroom_gib <= card:
                run["notes"].append(
                    f"{ds} on one GPU needs ~{need:.0f} GiB of model states (> {card:.0f} GiB card): baseline "
                    f"without DeepSpeed (bf16 AdamW states, ~{plain:.0f} GiB)"
                )
                ds, need = "none", plain
            else:
                run["status"] = f"skipped: needs ~{need:.0f} + {args.headroom_gib:.0f} GiB > {card:.0f} GiB"
        run["predicted_model_states_gib"] = round(need, 1)
        kv = scale_shape.kv_cache_gib(ctx["model_dir"], args.shape_def) if args.shape else None
        if kv is not None:
            run["predicted_full_kv_cache_gib"] = round(kv, 1)
            if card and need + kv + args.headroom_gib > card:
                run["notes"].append(
                    f"model states ~{need:.0f} GiB + a decode cache of every row at full length ~{kv:.0f} GiB exceed "
                    f"the {card:.0f} GiB card: the run fits only if decoding holds less"
                )
    name = f"{args.plan}{'_' + args.shape_def.name if args.shape else ''}_n{n}_{ds}"
    run = {"name": name, "ds": ds, **run}
    if run["status"] != "ok":
        return run
    remaining = max(0.0, args.budget_s - (time.time() - ctx["start"]))
    timeout = min(args.timeout, remaining - 10)
    needed = max(args.min_run_s, 0.8 * ctx["estimate_s"])  # about when the measured steps are done
    if timeout < needed:
        return run | {
            "status": f"skipped: {remaining:.0f} s of the budget left, a run takes ~{ctx['estimate_s']:.0f} s"
        }
    run_dir = Path(args.work) / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = Path(args.work) / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    spec = {
        "dir": str(run_dir),
        "warmup": args.warmup,
        "steps": args.steps,
        "profile": args.profile,
        "device": args.device,
        "t0": time.time(),
        "shape": scale_shape.spec(args.shape_def, args.eos_bias) if args.shape else None,
    }
    if args.shape:  # the worker counts optimizer steps
        spec.update(warmup=args.warmup * args.shape_def.updates, steps=args.steps * args.shape_def.updates)
    cmd = [
        args.python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(n),
        str(Path(__file__)),
        *grpo_argv(args, ds, ctx["model_dir"], ctx["jsonl"], Path(args.work) / "train_out" / name),
    ]
    run["command"] = " ".join(cmd)
    env = ctx["env"] | {WORKER_ENV: json.dumps(spec)}
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the run's own process group: stragglers too
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            if sig == signal.SIGTERM:
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
    run["wall_s"] = round(time.time() - start, 1)
    if rc == 0:
        ctx["estimate_s"] = max(ctx["estimate_s"] if ctx["measured_estimate"] else 0.0, run["wall_s"])
        ctx["measured_estimate"] = True
    run["returncode"] = rc
    summarise(args, run, run_dir, ctx)
    if "step_s" not in run and not run["status"].startswith("partial"):
        run["status"] = f"timed out after {timeout:.0f} s" if rc is None else f"failed: {failure(log)}"
    elif "step_s" not in run:
        run["status"] += f", then {'timed out' if rc is None else f'rc={rc}: ' + failure(log)}"
    elif rc != 0:
        run["status"] = f"measured, then {'timed out' if rc is None else f'rc={rc}: ' + failure(log)}"
    run["log"] = str(log)
    return run


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plan", choices=list(PLANS), default="zero2", help="preset + DeepSpeed stage (see PLANS)")
    p.add_argument("--preset", default=None, help="override the plan's model preset")
    p.add_argument("--ds", choices=["zero2", "zero3", "none"], default=None, help="override the plan's stage")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--nproc", type=int, nargs="+", default=None, help="GPU counts, in run order (default 1 4 2)")
    p.add_argument("--prompts_per_device", type=int, default=None, help="default 2")
    p.add_argument("--num_generations", type=int, default=None, help="default 8")
    p.add_argument("--image_size", type=int, default=None, help="default 448 (cpu plan: 56)")
    p.add_argument("--completion_length", type=int, default=None, help="forced tokens (default 128; cpu plan: 8)")
    p.add_argument("--vary_prompts", type=int, default=0, help="bench_grpo's prompt-length variation (0: one length)")
    p.add_argument(
        "--shape", default=None,
        help="an EasyR1-shaped cycle per GPU (bench_shape.py): easyr1_geo3k, easyr1_geo3k_32x8 or easyr1_geo3k_varied, "
        "with field overrides as name:prompts=4,max_completion=32; it sets the batch and length flags, --warmup / "
        "--steps then count cycles (default 1 cold + 1 measured) and no step is profiled",
    )  # fmt: skip
    p.add_argument(
        "--eos_bias", type=float, default=None,
        help="with --shape: the EOS bias every rank installs (e.g. the corrected one a 1-GPU bench_grpo.py --shape run "
        "records under eos_bias.corrected; default: each rank calibrates the same bias on random ids)",
    )  # fmt: skip
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="measured steps (default 5; cpu plan: 2; --shape: 1 cycle)")
    p.add_argument("--no_profile", dest="profile", action="store_false", help="no extra profiled step")
    p.add_argument(
        "--timeout", type=float, default=None, help="seconds per run at most (default 330; --shape: the budget)"
    )
    p.add_argument("--budget_s", type=float, default=520.0, help="the whole command ends within this (runs skipped)")
    p.add_argument("--min_run_s", type=float, default=90.0, help="skip a run with less budget than this left")
    p.add_argument("--headroom_gib", type=float, default=5.0, help="activations etc. on top of the model states")
    p.add_argument("--force", action="store_true", help="start runs predicted not to fit")
    p.add_argument("--no_fallback", action="store_true", help="no run without DeepSpeed for a 1-GPU run that can't fit")
    p.add_argument("--work", default="/tmp/scale_out", help="models, data, logs (kept between commands)")
    p.add_argument("--out", default=None, help="result files (default $OUT, else WORK/results)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument(
        "--merge", nargs="+", type=Path, default=None, metavar="JSON",
        help="no runs: merge these commands' summaries (or run files) into one, with the weak-scaling efficiency "
        "against the fewest GPUs among them, written to --out (a .json file)",
    )  # fmt: skip
    p.add_argument("extra", nargs="*", help="after --: more grpo_jsonl.py flags for every run")
    args = p.parse_args(argv)
    if args.merge:
        return args
    plan = PLANS[args.plan]
    args.shape_def = scale_shape.setup(args) if args.shape else None
    for key, default in (
        ("preset", None),
        ("ds", None),
        ("device", "cuda"),
        ("nproc", [1, 4, 2]),
        ("prompts_per_device", 2),
        ("num_generations", 8),
        ("image_size", 448),
        ("completion_length", 128),
        ("steps", 5),
    ):
        if getattr(args, key) is None:
            setattr(args, key, plan.get(key, default))
    args.timeout = args.timeout or (args.budget_s if args.shape else 330.0)
    args.out = args.out or os.environ.get("OUT") or str(Path(args.work) / "results")
    return args


def report(out: Path, run: dict[str, Any]) -> None:
    """The run's JSON file, and its one-line summary."""
    (out / f"{run['name']}.json").write_text(json.dumps(run, indent=1))
    keys = ("name", "ds", "status", "step_s", "first_step_s", "samples_per_s", "generation_share", "wall_s")
    brief = {k: run.get(k) for k in keys} | {k: run[k] for k in ("tokens_per_s_per_gpu", "notes") if run.get(k)}
    brief["peak_gib"] = max((p for p in run.get("peak_alloc_gib") or [] if p is not None), default=None)
    brief["collective_s"] = (run.get("collectives") or {}).get("collective_s")
    brief["features"] = run.get("features")
    print(f"[scale] {json.dumps(rounded(brief))}", flush=True)


@contextlib.contextmanager
def locked(work: Path):
    """Commands sharing ``--work`` build its model and data one at a time (the other waits, then reuses them)."""
    with open(work / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def visible_gpus(gpus: int) -> int:
    """The GPUs this command may use: ``CUDA_VISIBLE_DEVICES``'s, else every one nvidia-smi lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return gpus if visible is None else len([d for d in visible.split(",") if d.strip()])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    if args.merge:
        return merge(args, scale_shape.table)
    start = time.time()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT / "src")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The same host threads per rank whatever N (torchrun sets 1 for N > 1 only).
    # On a GPU machine each rank gets its share of the host's cores (also with other commands on the other GPUs).
    gpus, card_gib, gpu_name = gpu_info() if args.device == "cuda" else (0, None, "cpu")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 4) // max(gpus, *args.nproc))))
    model_dir = work / f"model_{args.preset}"
    rows_needed = args.prompts_per_device * max(args.nproc) * (args.warmup + args.steps + int(args.profile))
    data = (
        f"data_{args.shape_def.name}_{args.shape_def.image_size}_v{args.shape_def.vary_images}_{rows_needed}"
        if args.shape
        else f"data_{args.image_size}_v{args.vary_prompts}"
    )
    with locked(work):
        build_s = build_model(args, model_dir, env)
        jsonl = write_data(args, work / data, rows_needed)
    params = safetensors_params(model_dir)
    ctx = {
        "start": start,
        "gpus": visible_gpus(gpus),
        "peak_tflops": scale_shape.peak_tflops(gpu_name),
        "card_gib": card_gib,
        "params": params,
        "model_dir": model_dir,
        "jsonl": jsonl,
        "env": env,
        "estimate_s": (scale_shape.RUN_ESTIMATE_S if args.shape else RUN_ESTIMATE_S).get(args.preset, 60.0),
        "measured_estimate": False,
    }
    print(
        f"[scale] plan {args.plan}: {args.preset} ({params / 1e9:.2f} B parameters), {args.ds}, GPUs {args.nproc} "
        f"on {gpus} x {gpu_name} ({fmt(card_gib, '.1f')} GiB); model ready in {build_s:.0f} s",
        flush=True,
    )
    runs: list[dict[str, Any]] = []
    for n in args.nproc:
        run = run_one(args, args.ds, n, ctx)
        if n == 1 and run["status"] == "failed: OOM" and run["ds"] != "none" and not args.no_fallback:
            report(out, run)
            runs.append(run)
            note = f"{run['ds']} on one GPU ran out of memory: baseline without DeepSpeed (bf16 AdamW states)"
            run = run_one(args, "none", n, ctx, note)
        report(out, run)
        runs.append(run)
    done = efficiency(runs)
    for r in done:
        (out / f"{r['name']}.json").write_text(json.dumps(r, indent=1))
    text = scale_shape.table(runs) if args.shape else table(runs)
    header = (
        f"plan {args.plan}: {args.preset}, {gpu_name}, {args.prompts_per_device} prompts x G={args.num_generations}"
        f" per GPU, {args.image_size}px, C{args.completion_length}, {args.warmup} warm-up + {args.steps} measured"
        f" steps (median)"
    )
    header = scale_shape.header(args, args.shape_def, gpu_name) if args.shape else header
    print(f"\n{header}\n\n{text}\n", *efficiency_lines(done), sep="\n", flush=True)
    from bench_common import run_stamp

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    summary = {
        **run_stamp(),
        "command": (f"CUDA_VISIBLE_DEVICES={visible} " if visible is not None else "")
        + shlex.join(["python3", "benchmarks/scale_out.py", *(sys.argv[1:] if argv is None else argv)]),
        "plan": args.plan,
        "header": header,
        "args": {k: v for k, v in vars(args).items() if k != "shape_def"},
        **({"shape": scale_shape.shape_record(args.shape_def)} if args.shape else {}),
        "gpu": gpu_name,
        "card_gib": card_gib,
        "params": params,
        "model_build_s": build_s,
        "total_s": time.time() - start,
        "runs": runs,
        "table": text,
    }
    stem = f"{args.plan}_{args.shape_def.name}_n{'-'.join(map(str, args.nproc))}" if args.shape else args.plan
    (out / f"{stem}_summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / f"{stem}_logs.txt", "w") as f:  # the end of every run's log (device runs: one file back)
        for r in runs:
            log = Path(r.get("log", ""))
            if log.is_file():
                tail = log.read_text(errors="replace").splitlines()[-150:]
                f.write(f"===== {r['name']} ({r['status']})\n" + "\n".join(tail) + "\n")
    return runs


if __name__ == "__main__":
    if os.environ.get(WORKER_ENV):  # a rank under torchrun (run_one): the worker side, in its own module
        from scale_out_worker import worker  # benchmarks/ is sys.path[0] for a script

        worker(json.loads(os.environ[WORKER_ENV]), sys.argv[1:])
    else:
        main()
