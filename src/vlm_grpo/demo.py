"""``make demo``: a tiny VLM that measurably gets better under GRPO, on CPU, in a few minutes.

    python -m vlm_grpo.demo [--out runs/demo] [--seed 0] [--grpo_steps 200] [--grpo_lr 3e-4] ...

Pipeline (each stage is the project's own recipe, run in this process):

1. build a tiny random Qwen2.5-VL (:mod:`vlm_grpo.testing.tiny`, seeded);
2. SFT on the true answers (``train.jsonl``): the model learns to read the colour (held-out accuracy ~1);
   then SFT on ``sft.jsonl``, a weak labeller's answers that call 3 in 5 red shapes yellow and 3 in 5 blue shapes
   green: the policy takes on the labeller's bias, so its greedy answer for red and blue shapes is wrong
   (imperfect on purpose) while the right one is still sampled often -- GRPO sharpens what the policy can
   already sometimes do. (SFT on the weak answers alone leaves most seeds unable to tell red from yellow at all:
   the labels hold too little contrast, and GRPO then plateaus for hundreds of steps.)
3. greedy held-out accuracy A0 on ``val.jsonl`` (:func:`vlm_grpo.evaluate.evaluate`, exact match);
4. GRPO on ``train.jsonl`` with the task reward only (``accuracy``, exact match: no format reward to farm);
5. greedy held-out accuracy A1 on the same rows; ``curves.png`` from the GRPO run's log history.

The last line printed is ``demo: held-out accuracy A0 -> A1 (GRPO steps N)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("vlm_grpo")

DATA = Path("data/demo/colour")
STAGES = ("model", "sft_true", "sft", "eval_sft", "grpo", "eval_grpo")  # sub-folders of --out, in order


def held_out_accuracy(model_dir: Path, val: Path, images: Path, out_dir: Path, seed: int) -> float:
    """Greedy exact-match accuracy of ``model_dir`` on every row of ``val`` (one generate call per 64 rows)."""
    from vlm_grpo.evaluate import EvalArguments, evaluate

    args = EvalArguments(
        model_name_or_path=str(model_dir),
        data_file_paths=str(val),
        image_folders=str(images),
        output_dir=str(out_dir),
        reward_funcs=["accuracy"],
        batch_size=64,
        max_new_tokens=4,
        device="cpu",
        seed=seed,
        progress=False,
    )
    return float(evaluate(args)["rewards"]["accuracy"]["mean"])


def sft_argv(a: argparse.Namespace, model: Path, out: Path, rows: str, steps: int) -> list[str]:
    """The SFT recipe's flags; ``rows``: ``train.jsonl`` (true answers) or the weak labeller's ``sft.jsonl``."""
    return [
        "--model_name_or_path", str(model),
        "--data_file_paths", str(a.data / rows),
        "--image_folders", str(a.data / "images"),
        "--output_dir", str(out),
        "--overwrite_output_dir", "true",
        "--max_steps", str(steps),
        "--per_device_train_batch_size", str(a.sft_batch),
        "--learning_rate", str(a.sft_lr),
        "--vision_encoder_lr", str(a.sft_vision_lr),
        "--lr_scheduler_type", "constant",
        "--gradient_checkpointing", "false",
        "--logging_steps", "5",
        "--save_strategy", "no",
        "--report_to", "none",
        "--dataloader_num_workers", "0",
        "--seed", str(a.seed),
    ]  # fmt: skip


def grpo_argv(a: argparse.Namespace, model: Path, out: Path) -> list[str]:
    """The GRPO recipe's flags: the task reward only (exact match), short completions, LR decaying to 0."""
    return [
        "--model_name_or_path", str(model),
        "--data_file_paths", str(a.data / "train.jsonl"),
        "--image_folders", str(a.data / "images"),
        "--output_dir", str(out),
        "--overwrite_output_dir", "true",
        "--reward_funcs", "accuracy",
        "--max_steps", str(a.grpo_steps),
        "--per_device_train_batch_size", str(a.grpo_batch),
        "--num_generations", str(a.num_generations),
        "--max_completion_length", "4",
        "--temperature", str(a.temperature),
        "--beta", str(a.beta),
        "--learning_rate", str(a.grpo_lr),
        "--lr_scheduler_type", "linear",
        "--gradient_checkpointing", "false",
        "--logging_steps", "2",
        "--save_strategy", "no",
        "--report_to", "none",
        "--dataloader_num_workers", "0",
        "--seed", str(a.seed),
    ]  # fmt: skip


def run(a: argparse.Namespace) -> tuple[float, float, int]:
    """The whole demo; returns (A0, A1, GRPO steps)."""
    import torch

    from vlm_grpo import grpo_jsonl, sft_jsonl
    from vlm_grpo.plot import plot_run
    from vlm_grpo.testing.tiny import build_tiny_model

    if a.threads:
        torch.set_num_threads(a.threads)
    out: Path = a.out
    for name in STAGES:  # a previous demo's outputs only: --out may be a folder with other things in it
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = build_tiny_model("qwen2_5_vl", out / "model", seed=a.seed)
    sft_jsonl.main(*sft_jsonl.parse_args(sft_argv(a, model, out / "sft_true", "train.jsonl", a.sft_true_steps)))
    sft_jsonl.main(*sft_jsonl.parse_args(sft_argv(a, out / "sft_true", out / "sft", "sft.jsonl", a.sft_steps)))
    a0 = held_out_accuracy(out / "sft", a.data / "val.jsonl", a.data / "images", out / "eval_sft", a.seed)
    t_sft = time.monotonic()
    grpo = grpo_jsonl.main(*grpo_jsonl.parse_args(grpo_argv(a, out / "sft", out / "grpo")))
    a1 = held_out_accuracy(out / "grpo", a.data / "val.jsonl", a.data / "images", out / "eval_grpo", a.seed)
    t_end = time.monotonic()
    steps = grpo.state.global_step
    plot_run(
        grpo.state.log_history,
        out / "curves.png",
        title=f"make demo: GRPO on the colour task (tiny Qwen2.5-VL, seed {a.seed})",
        markers={"held-out greedy accuracy": [(0, a0), (steps, a1)]},
    )
    summary = {
        "seed": a.seed,
        "held_out_accuracy_sft": a0,
        "held_out_accuracy_grpo": a1,
        "grpo_steps": steps,
        "seconds": {"build_sft_eval": round(t_sft - t0, 1), "grpo_eval": round(t_end - t_sft, 1)},
        "args": {k: str(v) for k, v in vars(a).items()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return a0, a1, steps


def add_demo_arguments(p: argparse.ArgumentParser, *, out: str, data: Path, task: str, defaults: dict) -> None:
    """The options both demos share (SFT then GRPO on a tiny model); ``defaults`` sets the step and batch counts:
    ``sft_true_steps``, ``sft_steps``, ``sft_batch``, ``grpo_steps``, ``grpo_batch``."""
    p.add_argument("--out", type=Path, default=Path(out), help="run folder (default: %(default)s)")
    p.add_argument("--data", type=Path, default=data, help=f"the {task} folder (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tiny model, SFT and GRPO (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads: tiny models run fastest on one")
    p.add_argument("--sft_true_steps", type=int, default=defaults["sft_true_steps"], help="SFT steps on true answers")
    p.add_argument("--sft_steps", type=int, default=defaults["sft_steps"], help="then SFT steps on the weak labeller's")
    p.add_argument("--sft_batch", type=int, default=defaults["sft_batch"])
    p.add_argument("--sft_lr", type=float, default=3e-3, help="SFT learning rate of the language model")
    p.add_argument("--sft_vision_lr", type=float, default=1e-3, help="SFT learning rate of the vision tower")
    p.add_argument("--grpo_steps", type=int, default=defaults["grpo_steps"])
    p.add_argument("--grpo_batch", type=int, default=defaults["grpo_batch"], help="completions per step (prompts x G)")
    p.add_argument("--num_generations", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--grpo_lr", type=float, default=3e-4)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient")
    p.add_argument("--temperature", type=float, default=1.0)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlm_grpo.demo", description=__doc__.split("\n\n")[0])
    steps = {"sft_true_steps": 200, "sft_steps": 100, "sft_batch": 16, "grpo_steps": 200, "grpo_batch": 32}
    add_demo_arguments(p, out="runs/demo", data=DATA, task="colour task", defaults=steps)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    missing = [name for name in ("sft.jsonl", "train.jsonl", "val.jsonl") if not (a.data / name).is_file()]
    if missing:
        print(
            f"error: {a.data} lacks {', '.join(missing)}: run from the repository root, pass --data, or regenerate "
            "it with python -m vlm_grpo.data.demo --out data/demo",
            file=sys.stderr,
        )
        sys.exit(2)
    a0, a1, steps = run(a)
    print(f"demo: held-out accuracy {a0:.3f} -> {a1:.3f} (GRPO steps {steps})", flush=True)


if __name__ == "__main__":
    main()
