"""Evaluation / batch inference: generate over a test file, score with registered rewards.

    vlm-grpo-eval --model_name_or_path runs/grpo --data_file_paths test.jsonl --reward_funcs accuracy format \\
        --output_dir runs/eval [--num_samples 4 --do_sample true] [--config eval.yaml]
    python -m vlm_grpo.evaluate ...

The prompts are the training prompts (``read_rows`` -> ``prepare_rows`` -> ``build_messages`` through the
module's question template, images decoded by ``LazyImageTransform``) and the scores are the training
rewards (``build_reward_funcs``: registered names, ``file.py:fn`` plugins, ``--reward_kwargs``), each
given every dataset column like in GRPO. A reward that fails on a sample gives it no score and is counted.

Writes ``predictions.jsonl`` (one line per row: completions and each reward's scores) and
``summary.json`` (per reward: mean, scored samples, failures, pass@k; the same per task_type; counts).
``--model_name_or_path`` may be a full checkpoint or a LoRA adapter folder (its base is read from
``adapter_config.json`` or ``--base_model``).

With ``--tools`` (and ``--max_tool_calling_iterations``, ``--tool_kwargs``, ``--tool_protocol``) each sample is a
multi-turn tool rollout (:mod:`vlm_grpo.eval_tools`); rewards receive its messages as in GRPO,
``predictions.jsonl`` logs every rollout's turns, calls, errors and conversation, and ``summary.json`` adds
``tools`` (tool-call rate, calls, errors, images and turns per sample).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo.cli_errors import run_cli
from vlm_grpo.tools.protocols import TOOL_PROTOCOL_HELP

logger = logging.getLogger("vlm_grpo")


@dataclass
class EvalArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Full checkpoint or LoRA adapter folder."})
    base_model: str | None = field(
        default=None, metadata={"help": "Base of a LoRA adapter (default: base_model_name_or_path of the adapter)."}
    )
    data_file_paths: str | None = field(
        default=None, metadata={"help": "Test files (JSONL / JSON / parquet), ':'-separated."}
    )
    image_folders: str | None = field(
        default=None, metadata={"help": "Image folders, ':'-separated: one per file or one for all."}
    )
    output_dir: str = field(default="eval", metadata={"help": "Where predictions.jsonl and summary.json go."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata={"help": "Rewards scored as metrics: registered names or 'file.py:fn' / 'module:fn' plugins."},
    )
    reward_kwargs: str | None = field(
        default=None, metadata={"help": 'Keyword arguments bound to rewards, as JSON: \'{"iou": {"threshold": 0.5}}\'.'}
    )
    is_reward_customized_from_vlm_module: bool = field(
        default=False, metadata={"help": "Let the VLM module replace registered rewards of the same name."}
    )
    batch_size: int = field(default=8, metadata={"help": "Prompts per generate() call."})
    max_new_tokens: int = field(
        default=256, metadata={"help": "Most tokens generated per completion (with --tools: over all its turns)."}
    )
    num_samples: int = field(
        default=1, metadata={"help": "Completions per prompt (k of pass@k); k > 1 samples (do_sample is turned on)."}
    )
    do_sample: bool = field(default=False, metadata={"help": "Sample instead of greedy decoding."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling top-p."})
    top_k: int | None = field(default=None, metadata={"help": "Top-k sampling (default: the generation config's)."})
    pass_threshold: float = field(
        default=1.0, metadata={"help": "A sample passes a reward when its score is >= this (pass@k)."}
    )
    max_samples: int | None = field(default=None, metadata={"help": "Evaluate only the first N rows."})
    task_type: str | None = field(default=None, metadata={"help": "Task of rows without their own task_type."})
    reward_method: str | None = field(default=None, metadata={"help": "accu_reward_method of rows without one."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "Rows with longer prompts are bad rows."})
    skip_bad_rows: bool = field(default=False, metadata={"help": "Skip (and count) bad rows instead of stopping."})
    vlm_module: str | None = field(default=None, metadata={"help": "VLM module name (default: from config.json)."})
    min_pixels: int | None = field(default=None, metadata={"help": "Qwen-VL: smallest image area after resizing."})
    max_pixels: int | None = field(default=None, metadata={"help": "Qwen-VL: largest image area after resizing."})
    max_anyres_num: int | None = field(default=None, metadata={"help": "InternVL: most tiles per image."})
    dtype: str | None = field(default=None, metadata={"help": "Model dtype (default: the checkpoint's)."})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:1, ... (auto: cuda when available)."})
    seed: int = field(default=42, metadata={"help": "Seed for sampling."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the checkpoint."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Evaluate as tool rollouts: the tools the model may call (registered names or 'file.py:fn'), "
            "run in the training tool loop, greedily unless --do_sample."
        },
    )
    tool_kwargs: str | None = field(
        default=None, metadata={"help": 'Options per tool, as JSON: \'{"zoom_in": {"size": 448}}\'.'}
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "With --tools: most rounds of tool calls per rollout (default: until max_new_tokens)."},
    )
    tool_protocol: str | None = field(default=None, metadata={"help": TOOL_PROTOCOL_HELP})


def parse_args(argv: Sequence[str] | None = None) -> EvalArguments:
    from vlm_grpo.cli_parser import VLMParser  # unknown flags and bad values as one error: line, bare booleans

    (args,) = VLMParser((EvalArguments,)).parse_args_and_config(args=argv)
    return args


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _generate(model: Any, processor: Any, batch: dict[str, list], args: EvalArguments, device: Any) -> list[list[str]]:
    """k completions (text) for each prompt of the batch."""
    import torch

    texts = [processor.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in batch["prompt"]]
    images = batch["images"] if any(batch["images"]) else None
    inputs = processor(text=texts, images=images, padding=True, return_tensors="pt").to(device)
    tokenizer = getattr(processor, "tokenizer", processor)
    sampling = args.do_sample or args.num_samples > 1
    kwargs: dict[str, Any] = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": sampling,
        "num_return_sequences": args.num_samples,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if sampling:
        kwargs.update(temperature=args.temperature, top_p=args.top_p)
        if args.top_k is not None:
            kwargs["top_k"] = args.top_k
    else:  # greedy: no sampling knobs, so the generation config's do not warn
        kwargs.update(temperature=None, top_p=None, top_k=None)
    with torch.inference_mode():
        output = model.generate(**inputs, **kwargs)
    completions = tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    k = args.num_samples
    return [completions[i * k : (i + 1) * k] for i in range(len(texts))]


def _score(reward_funcs: Sequence[Any], rows: dict[str, list], completions: list[list[Any]]) -> dict[str, list]:
    """Each reward on every completion (text, or a tool rollout's messages), given every column of its row
    (repeated per sample), as in GRPO."""
    k = len(completions[0]) if completions else 0
    flat = [c for per_row in completions for c in per_row]
    columns = {key: [v for v in values for _ in range(k)] for key, values in rows.items() if key != "prompt"}
    prompts = [p for p in rows["prompt"] for _ in range(k)]
    messages = [c if isinstance(c, list) else [{"role": "assistant", "content": c}] for c in flat]
    scores = {}
    for fn in reward_funcs:
        values = fn(completions=messages, prompts=prompts, **columns)
        scores[fn.__name__] = [values[i * k : (i + 1) * k] for i in range(len(completions))]
    return scores


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarise(predictions: list[dict], reward_names: Sequence[str], k: int, threshold: float) -> dict[str, Any]:
    def block(preds: list[dict]) -> dict[str, Any]:
        out = {}
        for name in reward_names:
            values = [v for p in preds for v in (p["rewards"].get(name) or []) if v is not None]
            rows_scored = [p for p in preds if any(v is not None for v in (p["rewards"].get(name) or []))]
            passed = [p for p in rows_scored if any(v is not None and v >= threshold for v in p["rewards"][name])]
            out[name] = {
                "mean": _mean(values),
                "scored": len(values),
                "missing": len(preds) * k - len(values),
                f"pass@{k}": len(passed) / len(rows_scored) if rows_scored else None,
            }
        return out

    per_task: dict[str, list[dict]] = defaultdict(list)
    for p in predictions:
        per_task[p.get("task_type") or "default"].append(p)
    return {
        "count": len(predictions),
        "samples": sum(len(p["completions"]) for p in predictions),
        "rewards": block(predictions),
        "per_task_type": {t: {"count": len(ps), "rewards": block(ps)} for t, ps in sorted(per_task.items())},
    }


def evaluate(args: EvalArguments) -> dict[str, Any]:
    """Generate, score, write ``predictions.jsonl`` and ``summary.json``; returns the summary."""
    import torch
    from tqdm.auto import tqdm

    from vlm_grpo.data import prepare_rows, to_datasets
    from vlm_grpo.data.sources import read_sources
    from vlm_grpo.merge_lora import is_adapter, load_model_and_processor
    from vlm_grpo.modules import ImageLimits
    from vlm_grpo.rewards import build_reward_funcs

    if not args.model_name_or_path or not args.data_file_paths:
        raise ValueError("--model_name_or_path and --data_file_paths are required")
    if args.num_samples < 1:
        raise ValueError("--num_samples must be >= 1")
    if args.max_tool_calling_iterations is not None and not args.tools:
        raise ValueError("--max_tool_calling_iterations needs --tools")
    if args.tool_kwargs and not args.tools:
        raise ValueError("--tool_kwargs needs --tools")
    if args.tool_protocol and not args.tools:
        raise ValueError("--tool_protocol needs --tools")
    if args.tools:  # an unknown tool or protocol, a bad tool option: said before the model loads
        from vlm_grpo.tools.rollouts import build_tool_environment, tool_turns

        tool_turns([], build_tool_environment(args.tools, args.tool_kwargs), None, args.tool_protocol)
    if args.num_samples > 1 and not args.do_sample:
        logger.info("--num_samples %d: sampling (greedy decoding would repeat one completion)", args.num_samples)
    torch.manual_seed(args.seed)
    device = _device(args.device)
    # The cheap checks first: a missing data file or a misspelt reward is reported before the model loads.
    reward_funcs = (
        None
        if args.is_reward_customized_from_vlm_module
        else build_reward_funcs(args.reward_funcs, None, args.reward_kwargs)
    )
    rows, bad = read_sources(  # every source training reads (parquet with image bytes, name@split, verl rows, ...)
        args.data_file_paths, args.image_folders, reward_method=args.reward_method, task_type=args.task_type
    )
    path = args.model_name_or_path
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
        raise ValueError(f"--model_name_or_path {path}: no such folder (a local model folder or a Hub id)")
    model, processor, module = load_model_and_processor(
        args.model_name_or_path,
        base_model=args.base_model,
        vlm_module=args.vlm_module,
        dtype=args.dtype,
        limits=ImageLimits(args.min_pixels, args.max_pixels, args.max_anyres_num),
        trust_remote_code=args.trust_remote_code,
    )
    model.to(device)
    if reward_funcs is None:  # the module's own rewards replace registered ones of the same name
        reward_funcs = build_reward_funcs(args.reward_funcs, module.reward_overrides, args.reward_kwargs)

    loop = None
    if args.tools:
        from vlm_grpo.eval_tools import ToolLoop

        sampling = {}
        if args.do_sample or args.num_samples > 1:
            sampling = {"temperature": args.temperature, "top_p": args.top_p}
            if args.top_k is not None:
                sampling["top_k"] = args.top_k
        loop = ToolLoop(
            model,
            processor,
            module,
            args.tools,
            args.tool_kwargs,
            args.max_tool_calling_iterations,
            args.max_new_tokens,
            sampling,
            args.tool_protocol,
        )
    if args.max_samples is not None:
        keep = {r["source"] for r in rows[: args.max_samples]}
        rows = [r for r in rows if r["source"] in keep]
    rows = prepare_rows(
        rows, bad, module, processor, max_prompt_length=args.max_prompt_length, skip_bad_rows=args.skip_bad_rows
    )
    dataset, _ = to_datasets(rows, module)  # prompts and decoded images on access, as in training

    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    predictions: list[dict] = []
    generation_failures = 0
    starts = range(0, len(dataset), args.batch_size)
    with open(out_dir / "predictions.jsonl", "w", encoding="utf-8") as handle:
        for start in tqdm(starts, desc="evaluate", unit="batch", disable=not args.progress):
            batch = dataset[start : start + args.batch_size]
            n = len(batch["id"])
            error = None
            rollouts: list[list[Any]] = [[] for _ in range(n)]
            try:
                if loop is None:
                    completions = _generate(model, processor, batch, args, device)
                else:
                    rollouts = [
                        [loop.run({key: values[i] for key, values in batch.items()}) for _ in range(args.num_samples)]
                        for i in range(n)
                    ]
                    completions = [[r.messages for r in per_row] for per_row in rollouts]
                scores = _score(reward_funcs, batch, completions)
            except Exception as exc:  # one bad batch costs its rows, not the run
                logger.exception("Generation failed for rows %d-%d", start, start + n - 1)
                error = f"{type(exc).__name__}: {exc}"
                generation_failures += n
                completions, scores = [[] for _ in range(n)], {}
            for i in range(n):
                record = {
                    "id": batch["id"][i],
                    "source": batch["source"][i],
                    "task_type": batch["task_type"][i],
                    "question": batch["question"][i],
                    "solution": batch["solution"][i],
                    "completions": [_final_text(c) for c in completions[i]],
                    "rewards": {fn.__name__: (scores[fn.__name__][i] if scores else None) for fn in reward_funcs},
                    "error": error,
                }
                if loop is not None:
                    record["tool_rollouts"] = [r.log() for r in rollouts[i]]
                predictions.append(record)
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    names = [fn.__name__ for fn in reward_funcs]
    summary = {
        "model": args.model_name_or_path,
        "adapter": is_adapter(args.model_name_or_path),
        "data_files": args.data_file_paths,
        "num_samples": args.num_samples,
        "generation": {
            "do_sample": args.do_sample or args.num_samples > 1,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens,
        },
        **summarise(predictions, names, args.num_samples, args.pass_threshold),
        **({"tools": {**tool_summary(predictions), "protocol": loop.protocol}} if loop is not None else {}),
        "failures": {
            "bad_rows": len(bad),
            "generation": generation_failures,
            "rewards": {fn.__name__: fn.failures for fn in reward_funcs},
        },
        "args": {k: v for k, v in asdict(args).items() if k not in ("progress",)},
    }
    (out_dir / "summary.json").write_text(
        json.dumps(summary, indent=2, ensure_ascii=False, default=_json_default) + "\n"
    )
    shown = ", ".join(f"{name}={_fmt(summary['rewards'][name]['mean'])}" for name in names)
    if loop is not None:
        tools = summary["tools"]
        shown += (
            f"; tool-call rate {_fmt(tools['tool_call_rate'])}, calls/sample {_fmt(tools['calls_per_sample'])}, "
            f"errors/sample {_fmt(tools['errors_per_sample'])}, turns/sample {_fmt(tools['turns_per_sample'])}"
        )
    print(f"[vlm-grpo-eval] {summary['count']} rows x {args.num_samples}: {shown}; summary in {out_dir}/summary.json")
    return summary


def _final_text(completion: Any) -> str:
    """A completion as text: the model's turns of a tool rollout, joined by newlines."""
    if not isinstance(completion, list):
        return completion
    return "\n".join(str(m.get("content") or "") for m in completion if m.get("role") == "assistant")


def tool_summary(predictions: list[dict]) -> dict[str, float | None]:
    """Tool use over every rollout: the share that called a tool, and calls, errors, images, turns per rollout."""
    logs = [log for p in predictions for log in p.get("tool_rollouts") or []]

    def per_sample(key: str) -> float | None:
        return _mean([float(log[key]) for log in logs])

    return {
        "rollouts": len(logs),
        "tool_call_rate": _mean([float(log["tool_calls"] > 0) for log in logs]),
        "calls_per_sample": per_sample("tool_calls"),
        "errors_per_sample": per_sample("tool_errors"),
        "images_per_sample": per_sample("tool_images"),
        "turns_per_sample": per_sample("turns"),
        "calls_after_answer": per_sample("calls_after_answer"),
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def _json_default(value: Any) -> Any:
    return str(value)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return evaluate(parse_args(argv))


def cli() -> None:
    run_cli(main)


if __name__ == "__main__":
    cli()
