"""Multi-turn tool rollouts: vanilla ``trl.GRPOTrainer``'s tool loop vs ``VLMGRPOTrainer --tools zoom_in``.

    python benchmarks/bench_tools.py --preset qwen2_5_vl_3b --device cuda --out tools.json
    python benchmarks/bench_tools.py --preset tiny --device cpu                # smoke test

Scenario: every rollout makes 2 tool rounds (two ``zoom_in`` calls, each returning a 448 px image), then
answers with ``completion_length`` sampled tokens (forced with ``min_new_tokens``). The two tool calls are
scripted (random weights never call tools); everything else, tool execution, images in the conversation,
the log-prob passes and the loss, is each trainer's own path. Same card, model, data and seed for both;
the table has bench_grpo.py's columns (the vision column counts the tool images too).
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    PHASES,
    OptimizerTimer,
    PhaseTimer,
    Result,
    Scenario,
    build_policy,
    format_table,
    grpo_config,
    length_reward,
    ours_dataset,
    parse,
    run_stamp,
    time_vision,
    timed_trainer_class,
    vanilla_dataset,
    write_images,
)

TOOL_ROUNDS = 2
CALL = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [8, 8, 40, 40], "image_index": 0}}\n</tool_call>'


def scripted(base: type) -> type:
    """The first turn and the first TOOL_ROUNDS - 1 post-tool turns are tool calls; the last turn is sampled."""

    class Scripted(base):
        _round = 0

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            self._round = 0 if num_generations > 1 else self._round + 1
            if self._round < TOOL_ROUNDS:
                ids = self._tokenizer.encode(CALL + self._tokenizer.eos_token, add_special_tokens=False)
                return [list(ids) for _ in prompt_ids], None
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )

    return Scripted


def run_one(kind: str, args: Any, scenario: Scenario, workdir: Path, paths: list) -> tuple[Result, dict[str, float]]:
    from trl import GRPOTrainer

    from vlm_grpo.tools.rollouts import build_tool_environment, prepare_for_tools
    from vlm_grpo.trainer import VLMGRPOTrainer

    device = torch.device(args.device)
    model, processor, module = build_policy(args, workdir, kind)
    n_params = sum(p.numel() for p in model.parameters())
    steps = args.warmup + args.steps
    # Room for the two tool results (text + a 448 px image each) on top of the sampled answer.
    config = grpo_config(kind, args, scenario, workdir, steps, max_tool_calling_iterations=TOOL_ROUNDS)
    config.max_completion_length = scenario.completion_length + 2048
    config.generation_kwargs["max_new_tokens"] = scenario.completion_length  # each sampled turn: exactly C tokens
    timer = PhaseTimer(device)
    time_vision(model, module, timer)
    if kind == "vanilla":
        prepare_for_tools(config, processor)  # TRL's parser for the tiny template; same token rules as ours
        cls = scripted(timed_trainer_class(GRPOTrainer))
        dataset = vanilla_dataset(paths)
        kwargs = {"environment_factory": build_tool_environment(["zoom_in"])}
    else:
        cls = scripted(timed_trainer_class(VLMGRPOTrainer))
        dataset = ours_dataset(paths, workdir, module, processor)
        kwargs = {"vlm_module": module, "tools": ["zoom_in"]}
    cls.timer = timer
    trainer = cls(
        model=model, reward_funcs=[length_reward], args=config, train_dataset=dataset, processing_class=processor,
        callbacks=[OptimizerTimer(timer)], **kwargs,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    measured = timer.per_step[args.warmup : steps] or timer.per_step

    def median(key: str) -> float:
        values = sorted(step.get(key, 0.0) for step in measured)
        return values[len(values) // 2]

    step_s = median("_wall")
    train_s = median("loss_forward") + median("backward")
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    mfu = 6 * n_params * median("_executed_tokens") / train_s / peak_flops if peak_flops and train_s > 0 else None
    samples = args.prompts_per_step * args.num_generations
    tokens = median("_prompt_tokens") + median("_completion_tokens")
    logs = [e for e in trainer.state.log_history if "tools/call_frequency" in e]
    tools = {"tool_calls_per_rollout": logs[-1]["tools/call_frequency"] if logs else 0.0, "train_wall_s": wall}
    result = Result(
        kind, scenario.name + f" T{TOOL_ROUNDS}", step_s, samples / step_s, tokens / step_s, peak, mfu,
        {p: median(p) for p in PHASES}, int(median("_prompt_tokens")), int(median("_completion_tokens")),
    )  # fmt: skip
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, tools


def main(argv: list[str] | None = None) -> list[Result]:
    args = parse(argv, __doc__.split("\n\n")[0])
    results, extras = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.image_sizes:
            for length in args.completion_lengths:
                scenario = Scenario(size, 1, length)
                workdir = Path(tmp) / f"{size}_{length}"
                workdir.mkdir(parents=True)
                paths = write_images(workdir, scenario, args.prompts_per_step * (args.warmup + args.steps), args.seed)
                for kind in ("vanilla", "ours"):
                    result, tools = run_one(kind, args, scenario, workdir, paths)
                    results.append(result)
                    extras[f"{result.scenario} {kind}"] = tools
                    print(f"[bench_tools] {json.dumps(asdict(result) | tools)}", flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\ndevice: {device}; preset: {args.preset}; G={args.num_generations}; {TOOL_ROUNDS} tool rounds per rollout")
    print(format_table(results))
    payload = {
        **run_stamp(),
        "device": device,
        "args": vars(args),
        "results": [asdict(r) for r in results],
        "tools": extras,
    }
    Path(args.out).write_text(json.dumps(payload, indent=2))
    return results


if __name__ == "__main__":
    main()
