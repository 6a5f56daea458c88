"""``make demo-tools``: a tiny VLM that calls a tool, then gets better at the task under GRPO, on CPU.

    python -m vlm_grpo.demo_tools [--out runs/demo_tools] [--seed 0] [--grpo_steps 120] [--control] ...

The task (``data/demo/zoom_in``, written by ``python -m vlm_grpo.data.zoom_in_demo --tool_demo``): "What colour is
the small object inside the grey frame?" on a 112-px canvas cluttered with squares of every colour; the
trajectories call ``zoom_in`` on the frame, read the tool's zoomed view and answer in ``<answer>`` tags.

1. build a tiny random Qwen2.5-VL (:mod:`vlm_grpo.testing.tiny`, seeded);
2. supervised fine-tuning on the tool trajectories, replayed through the tool loop
   (:meth:`vlm_grpo.eval_tools.ToolLoop.replay`: the prompt with the tool schemas, the call, the tool's real
   reply with its image, the answer; loss on the model's turns only): first with true answers, then with a weak
   labeller's that calls 3 in 5 red objects yellow and 3 in 5 blue ones green -- the policy calls the tool but
   answers red and blue objects wrongly when greedy, while the right answer is still sampled;
3. agentic evaluation on the held-out ``val.jsonl`` (:func:`vlm_grpo.evaluate.evaluate` with ``tools``: greedy
   tool rollouts): accuracy A0 and the tool-call rate;
4. GRPO with ``--tools zoom_in`` and the ``deepeyes`` reward on ``train.jsonl``;
5. the same evaluation: A1; with ``--control``, GRPO again at learning rate 0 and its evaluation.

The last line printed is ``demo-tools: held-out accuracy A0 -> A1, tool-call rate R0 -> R1 (...)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shlex
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("vlm_grpo")

DATA = Path("data/demo/zoom_in")
TOOLS = ["zoom_in"]
STAGES = ("model", "sft_true", "sft", "eval_sft", "grpo", "eval_grpo", "grpo_control", "eval_control")


def tool_kwargs() -> str:
    from vlm_grpo.data.zoom_in_demo import ZOOM_SIZE

    return json.dumps({"zoom_in": {"size": ZOOM_SIZE}})


def eval_argv(model_dir: Path, data: Path, out_dir: Path, seed: int, max_samples: int | None = None) -> list[str]:
    """The ``vlm-grpo-eval`` command line of the demo's evaluation: greedy tool rollouts on ``val.jsonl``."""
    return [
        "--model_name_or_path", str(model_dir),
        "--data_file_paths", str(data / "val.jsonl"),
        "--image_folders", str(data / "images"),
        "--output_dir", str(out_dir),
        "--reward_funcs", "accuracy",
        "--tools", *TOOLS,
        "--tool_kwargs", tool_kwargs(),
        "--max_tool_calling_iterations", "2",
        "--max_new_tokens", "96",
        "--batch_size", "64",
        "--device", "cpu",
        "--seed", str(seed),
        "--progress", "false",
        *(["--max_samples", str(max_samples)] if max_samples else []),
    ]  # fmt: skip


def held_out(model_dir: Path, a: argparse.Namespace, out_dir: Path) -> tuple[float, float]:
    """(accuracy, tool-call rate) of ``model_dir``'s greedy tool rollouts on the held-out rows, by
    ``vlm-grpo-eval`` (its command line is printed, to rerun it)."""
    from vlm_grpo.evaluate import evaluate, parse_args

    argv = eval_argv(model_dir, a.data, out_dir, a.seed, a.eval_rows)
    print("demo-tools: vlm-grpo-eval " + shlex.join(argv), flush=True)
    summary = evaluate(parse_args(argv))
    return float(summary["rewards"]["accuracy"]["mean"]), float(summary["tools"]["tool_call_rate"])


# ------------------------------------------------------------------------------------------------ SFT
def sft_on_trajectories(
    model_dir: Path, trajectories: Path, images: Path, out: Path, steps: int, a: argparse.Namespace
) -> float:
    """Fine-tune ``model_dir`` on replayed tool trajectories; saves to ``out``; returns the last loss.

    The rows are replayed and encoded as ``vlm-grpo-sft --tools`` does it (:mod:`vlm_grpo.sft_tools`: the GRPO
    run's tokens, loss on the model's turns); the demo trains them with its own short loop (AdamW, constant LR,
    the vision tower at its own LR, its own draw of batches), the loop its measured numbers come from."""
    import torch

    from vlm_grpo.eval_tools import ToolLoop
    from vlm_grpo.merge_lora import load_model_and_processor
    from vlm_grpo.sft_tools import ToolRolloutCollator, encode_rollout, type_key

    model, processor, module = load_model_and_processor(str(model_dir))
    loop = ToolLoop(model, processor, module, TOOLS, tool_kwargs(), max_iterations=2)
    turns = {}
    for line in trajectories.read_text().splitlines():
        row = json.loads(line)
        turns[row["id"]] = row["assistant_turns"]
    dataset = _dataset(trajectories, images, module, processor)
    examples = [encode_rollout(processor, loop.replay(row, turns[row["id"]])) for row in dataset]
    collate = ToolRolloutCollator(getattr(processor, "tokenizer", processor).pad_token_id, type_key(model))
    vision = [p for n, p in model.named_parameters() if "visual" in n]
    rest = [p for n, p in model.named_parameters() if "visual" not in n]
    optimizer = torch.optim.AdamW(
        [{"params": rest, "lr": a.sft_lr}, {"params": vision, "lr": a.sft_vision_lr}], weight_decay=0.0
    )
    rng = random.Random(a.seed)
    torch.manual_seed(a.seed)
    order: list[int] = []
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        if len(order) < a.sft_batch:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = [examples[i] for i in order[: a.sft_batch]], order[a.sft_batch :]
        loss = model(**collate(batch)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = float(loss.detach())
        if step % 10 == 0 or step == steps - 1:
            logger.info("sft %s step %d: loss %.4f", out.name, step, loss_value)
    model.eval()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return loss_value


def _dataset(path: Path, images: Path, module: Any, processor: Any) -> Any:
    """The rows as training and evaluation see them (prompt messages, decoded images, coordinate frames)."""
    from vlm_grpo.data import prepare_rows, to_datasets
    from vlm_grpo.data.sources import read_sources

    rows, bad = read_sources(str(path), str(images))
    dataset, _ = to_datasets(prepare_rows(rows, bad, module, processor), module)
    return dataset


# ----------------------------------------------------------------------------------------------- GRPO
def grpo_argv(a: argparse.Namespace, model: Path, out: Path, learning_rate: float) -> list[str]:
    """The GRPO recipe's flags: tool rollouts with zoom_in, DeepEyes' reward, short turns."""
    return [
        "--model_name_or_path", str(model),
        "--data_file_paths", str(a.data / "train.jsonl"),
        "--image_folders", str(a.data / "images"),
        "--output_dir", str(out),
        "--overwrite_output_dir", "true",
        "--tools", *TOOLS,
        "--tool_kwargs", tool_kwargs(),
        "--max_tool_calling_iterations", "2",
        "--reward_funcs", "deepeyes",
        "--max_steps", str(a.grpo_steps),
        "--per_device_train_batch_size", str(a.grpo_batch),
        "--num_generations", str(a.num_generations),
        "--max_completion_length", "192",  # the call, the tool reply (70 tokens with its image), the answer
        "--temperature", str(a.temperature),
        "--beta", str(a.beta),
        "--learning_rate", str(learning_rate),
        "--lr_scheduler_type", "constant",
        "--gradient_checkpointing", "false",
        "--logging_steps", "2",
        "--save_strategy", "no",
        "--report_to", "none",
        "--dataloader_num_workers", "0",
        "--seed", str(a.seed),
    ]  # fmt: skip


def run(a: argparse.Namespace) -> dict[str, Any]:
    """The whole demo; returns its summary (also written to ``summary.json``)."""
    import torch

    from vlm_grpo import grpo_jsonl
    from vlm_grpo.testing.tiny import build_tiny_model

    if a.threads:
        torch.set_num_threads(a.threads)
    out: Path = a.out
    for name in STAGES:  # a previous demo's outputs only: --out may be a folder with other things in it
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    out.mkdir(parents=True, exist_ok=True)
    images = a.data / "images"
    t0 = time.monotonic()
    model = build_tiny_model("qwen2_5_vl", out / "model", seed=a.seed)
    sft_on_trajectories(model, a.data / "sft_true.jsonl", images, out / "sft_true", a.sft_true_steps, a)
    sft_on_trajectories(out / "sft_true", a.data / "sft.jsonl", images, out / "sft", a.sft_steps, a)
    a0, r0 = held_out(out / "sft", a, out / "eval_sft")
    print(f"demo-tools: after SFT: held-out accuracy {a0:.3f}, tool-call rate {r0:.3f}", flush=True)
    t_sft = time.monotonic()
    summary: dict[str, Any] = {"seed": a.seed, "sft": {"accuracy": a0, "tool_call_rate": r0}}
    runs = [("grpo", "eval_grpo", a.grpo_lr)] + ([("grpo_control", "eval_control", 0.0)] if a.control else [])
    for name, eval_name, lr in runs:
        trainer = grpo_jsonl.main(*grpo_jsonl.parse_args(grpo_argv(a, out / "sft", out / name, lr)))
        accuracy, rate = held_out(out / name, a, out / eval_name)
        summary[name] = {"accuracy": accuracy, "tool_call_rate": rate, "steps": trainer.state.global_step, "lr": lr}
        print(f"demo-tools: after GRPO (lr {lr:g}): held-out accuracy {accuracy:.3f}, tool-call rate {rate:.3f}")
    summary["seconds"] = {"build_sft_eval": round(t_sft - t0, 1), "grpo_eval": round(time.monotonic() - t_sft, 1)}
    summary["args"] = {k: str(v) for k, v in vars(a).items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    from vlm_grpo.demo import add_demo_arguments

    p = argparse.ArgumentParser(prog="python -m vlm_grpo.demo_tools", description=__doc__.split("\n\n")[0])
    steps = {"sft_true_steps": 300, "sft_steps": 20, "sft_batch": 8, "grpo_steps": 120, "grpo_batch": 16}
    add_demo_arguments(p, out="runs/demo_tools", data=DATA, task="tool task", defaults=steps)
    p.add_argument("--control", action="store_true", help="also run GRPO at learning rate 0 and evaluate it")
    p.add_argument("--eval_rows", type=int, default=None, help="evaluate on the first N held-out rows (default: all)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)
    missing = [n for n in ("sft.jsonl", "sft_true.jsonl", "train.jsonl", "val.jsonl") if not (a.data / n).is_file()]
    if missing:
        print(
            f"error: {a.data} lacks {', '.join(missing)}: run from the repository root, pass --data, or regenerate "
            "it with python -m vlm_grpo.data.zoom_in_demo --tool_demo --out data/demo/zoom_in",
            file=sys.stderr,
        )
        sys.exit(2)
    s = run(a)
    line = (
        f"demo-tools: held-out accuracy {s['sft']['accuracy']:.3f} -> {s['grpo']['accuracy']:.3f}, "
        f"tool-call rate {s['sft']['tool_call_rate']:.3f} -> {s['grpo']['tool_call_rate']:.3f} "
        f"(GRPO steps {s['grpo']['steps']})"
    )
    if "grpo_control" in s:
        line += f"; learning-rate-0 control: {s['grpo_control']['accuracy']:.3f}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
