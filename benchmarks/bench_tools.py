"""Multi-turn tool rollouts: vanilla ``trl.GRPOTrainer``'s tool loop vs ``VLMGRPOTrainer --tools zoom_in``.

    python benchmarks/bench_tools.py --preset qwen2_5_vl_3b --device cuda --completion_lengths 128 512 --out tools.json
    python benchmarks/bench_tools.py --preset tiny --device cpu                # smoke test
    python benchmarks/bench_tools.py --preset qwen2_5_vl_3b --device cuda --tool_scenarios T4h --tool_latency 0.3 \
        --trainers vanilla ours ours:early_tool_calls=false --out tools_latency.json

Scenarios (``--tool_scenarios``): ``T2`` / ``T4``: every rollout makes 2 / 4 tool rounds (``zoom_in`` calls, each
returning a 448 px image), then answers with ``completion_length`` sampled tokens (forced with
``min_new_tokens``); ``T4h``: half the rollouts answer after one tool call, the other half make 4 tool calls.
Random weights never call tools, so a tool turn is scripted: the model decodes as many tokens as the call has,
and the call's tokens replace them (both trainers alike). Everything else, tool execution, images in the
conversation, the log-prob passes and the loss, is each trainer's own path. Same card, model, data and seed for
both. Besides bench_grpo.py's columns: tokens prefilled per step (the language model's embedding calls over more
than one token; padding counted apart), images the vision tower encodes per step, and generation seconds.

``--tool_latency S``: every ``zoom_in`` call takes ``S`` seconds more (a slow tool: a sandbox, a remote service),
and is marked parallel (the rollouts' calls run at the same time, as the python sandbox's do). The scripted calls
are then written by the decode itself (a logits processor forces their tokens, so the selection runs after each
decode step and finished rows stay in the batch, in every column alike): ``ours`` starts a rollout's call as its
turn ends (``early_tool_calls``), while the rollouts that answer still decode; ``ours:early_tool_calls=false`` starts
the calls after the round; vanilla TRL runs them one after another.
"""

from __future__ import annotations

import functools
import gc
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any
from unittest.mock import patch

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (
    PHASES,
    OptimizerTimer,
    PhaseTimer,
    Result,
    Scenario,
    format_table,
    grpo_config,
    length_reward,
    ours_dataset,
    parse,
    run_stamp,
    time_vision,
    timed_fast_decode,
    timed_trainer_class,
    vanilla_dataset,
    write_images,
)
from bench_policy import build_policy, mfu

LATENCY = {"seconds": 0.0}  # --tool_latency
CALL = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [8, 8, 40, 40], "image_index": 0}}\n</tool_call>'
SCENARIOS = ("T2", "T4", "T4h")


def rounds_of(name: str) -> tuple[int, bool]:
    """``T4h`` -> (4, True): tool rounds, and whether half the rollouts answer after the first."""
    return int(name[1:].rstrip("h")), name.endswith("h")


def scripted(base: type, rounds: int, half: bool) -> type:
    """Turns before round ``rounds`` are tool calls; with ``half``, every other rollout answers after round 1."""

    class Scripted(base):
        _round = 0
        generating = False  # inside _generate: count_work counts only there

        def _generate(self, prompts):
            Scripted.generating = True
            try:
                return super()._generate(prompts)
            finally:
                Scripted.generating = False

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            self._round = 0 if num_generations > 1 else self._round + 1
            call = self._tokenizer.encode(CALL + self._tokenizer.eos_token, add_special_tokens=False)
            answering = [
                self._round >= rounds or (half and self._round == 1 and i % 2 == 0) for i in range(len(prompt_ids))
            ]
            config = self.generation_config
            saved = config.max_new_tokens
            if not any(answering):  # the model decodes as many tokens as the call has
                # min_new_tokens stays as configured: a run's sampling settings are the same in every turn
                config.max_new_tokens = len(call)
            timer = self.timer
            timer.sync()
            start = time.perf_counter()
            FORCED.rows = [None if answers else call for answers in answering] if LATENCY["seconds"] else None
            FORCED.start = None
            try:
                ids, _ = super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            finally:
                FORCED.rows = None
                config.max_new_tokens = saved
                if self._round:  # a turn of the tool loop: its own time is not the loop's host time
                    timer.sync()
                    timer.totals["_loop_turns"] += time.perf_counter() - start
            return [list(row) if answers else list(call) for row, answers in zip(ids, answering, strict=True)], None

        def _tool_call_loop(self, *args, **kwargs):
            timer = self.timer
            timer.sync()
            start = time.perf_counter()
            try:
                return super()._tool_call_loop(*args, **kwargs)
            finally:
                timer.sync()
                timer.totals["_tool_loop"] += time.perf_counter() - start

    return Scripted


class ForcedCalls:
    """A logits processor (``--tool_latency``): rows with a scripted call (``rows[b]``: its tokens, EOS last) write it
    token by token; the others are left to the model. ``start``: the width of the first ids seen in the call."""

    def __init__(self) -> None:
        self.rows: list | None = None
        self.start: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.rows is None or input_ids.size(0) != len(self.rows):
            return scores
        if self.start is None:
            self.start = input_ids.size(1)
        n = input_ids.size(1) - self.start
        for b, call in enumerate(self.rows):
            if call is not None:
                scores[b] = float("-inf")
                scores[b, call[min(n, len(call) - 1)]] = 0.0
        return scores


FORCED = ForcedCalls()


@contextmanager
def slow_tool(model: torch.nn.Module, seconds: float) -> Iterator[None]:
    """``zoom_in`` taking ``seconds`` more a call (a parallel tool), and the model's decodes writing the scripted
    calls (:class:`ForcedCalls` among its logits processors). Nothing changes for ``seconds == 0``."""
    if not seconds:
        yield
        return
    from vlm_grpo.tools import TOOLS
    from vlm_grpo.tools.image import zoom_in

    def slow_zoom_in(env: Any, bbox_2d: list[float], image_index: int = 0, label: str | None = None) -> list:
        time.sleep(seconds)
        return zoom_in(env, bbox_2d, image_index, label)

    slow = functools.wraps(zoom_in)(slow_zoom_in)
    slow.parallel = True  # type: ignore[attr-defined]
    cls = type(model)
    processors = cls._get_logits_processor

    def with_forced(self, *args, **kwargs):
        out = processors(self, *args, **kwargs)
        out.append(FORCED)
        return out

    saved = TOOLS._entries.get("zoom_in")
    TOOLS._entries["zoom_in"] = slow
    cls._get_logits_processor = with_forced
    try:
        yield
    finally:
        TOOLS._entries["zoom_in"] = saved
        cls._get_logits_processor = processors


def count_work(model: torch.nn.Module, module: Any, pad_id: int, timer: PhaseTimer, cls: type) -> None:
    """Hooks counting, during generation (``cls.generating``), the tokens each prefill embeds (padding apart) and
    the images the vision tower encodes."""
    tower = dict(model.named_modules()).get(module.vision_prefixes[0])

    def embedded(_m, args):
        ids = args[0]
        if cls.generating and ids.dim() == 2 and ids.size(1) > 1:  # decode steps feed one token a row
            timer.totals["_prefill_tokens"] += float((ids != pad_id).sum())
            timer.totals["_prefill_padded"] += float(ids.numel())

    def encoded(_m, args, kwargs):
        if not cls.generating:
            return
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        pixels = args[0] if args else kwargs.get("pixel_values")
        timer.totals["_vision_images"] += float(grid.size(0) if grid is not None else pixels.size(0))

    model.get_input_embeddings().register_forward_pre_hook(embedded)
    if tower is not None:
        tower.register_forward_pre_hook(encoded, with_kwargs=True)


@contextmanager
def count_setups(timer: PhaseTimer, processor: Any) -> Iterator[None]:
    """Counts per step the host-side setups of generation: decode workspaces made (``fast_decode``'s static cache
    and buffers) and decode steps set up (each one's warm-ups and, on a GPU, its CUDA graph capture), chat templates
    rendered and images the image processor preprocessed (every call, the log-prob passes' included)."""
    from vlm_grpo.fastpath import decode

    workspace, step = decode._workspace, decode._Step
    processor_cls, image_cls = type(processor), type(processor.image_processor)
    render, preprocess = processor_cls.apply_chat_template, image_cls.__call__

    def counted_workspace(*args, **kwargs):
        timer.totals["_workspaces"] += 1
        return workspace(*args, **kwargs)

    class CountedStep(step):
        def __init__(self, *args, **kwargs):
            timer.totals["_decode_steps"] += 1
            super().__init__(*args, **kwargs)

    def counted_render(self, *args, **kwargs):
        timer.totals["_templates"] += 1
        return render(self, *args, **kwargs)

    def counted_preprocess(self, images=None, *args, **kwargs):
        flat = images if isinstance(images, list) else [images]
        timer.totals["_images_preprocessed"] += sum(len(x) if isinstance(x, list) else 1 for x in flat)
        return preprocess(self, images, *args, **kwargs)

    # patch.object puts back what was there: an inherited method is deleted again, not left set on the subclass
    # (where it would hide a later patch of the base class from everything in the same process)
    with (
        patch.object(decode, "_workspace", counted_workspace),
        patch.object(decode, "_Step", CountedStep),
        patch.object(processor_cls, "apply_chat_template", counted_render),
        patch.object(image_cls, "__call__", counted_preprocess),
    ):
        yield


def run_one(
    kind: str, args: Any, scenario: Scenario, tools_scenario: str, workdir: Path, paths: list
) -> tuple[Result, dict[str, float]]:
    device = torch.device(args.device)
    model, processor, module = build_policy(args, workdir, kind, freeze_vision=args.freeze_vision)
    with slow_tool(model, LATENCY["seconds"]):
        return _run_one(kind, args, scenario, tools_scenario, workdir, paths, device, model, processor, module)


def _run_one(
    kind: str, args: Any, scenario: Scenario, tools_scenario: str, workdir: Path, paths: list, device: torch.device,
    model: torch.nn.Module, processor: Any, module: Any,
) -> tuple[Result, dict[str, float]]:  # fmt: skip
    from trl import GRPOTrainer

    from vlm_grpo.tools.rollouts import build_tool_environment, prepare_for_tools
    from vlm_grpo.trainer import VLMGRPOTrainer

    steps = args.warmup + args.steps
    rounds, half = rounds_of(tools_scenario)
    # Room for the tool results (text + a 448 px image each) on top of the sampled answer.
    config = grpo_config(kind, args, scenario, workdir, steps, max_tool_calling_iterations=rounds)
    config.max_completion_length = scenario.completion_length + 1024 * rounds
    config.generation_kwargs["max_new_tokens"] = scenario.completion_length  # each sampled turn: exactly C tokens
    timer = PhaseTimer(device)
    time_vision(model, module, timer)
    if kind.partition(":")[0] == "vanilla":
        prepare_for_tools(config, processor)  # TRL's parser for the tiny template; same token rules as ours
        cls = scripted(timed_trainer_class(GRPOTrainer), rounds, half)
        dataset = vanilla_dataset(paths)
        kwargs = {"environment_factory": build_tool_environment(["zoom_in"])}
    else:
        cls = scripted(timed_trainer_class(VLMGRPOTrainer), rounds, half)
        dataset = ours_dataset(paths, workdir, module, processor)
        kwargs = {"vlm_module": module, "tools": ["zoom_in"]}
    cls.timer = timer
    count_work(model, module, processor.tokenizer.pad_token_id, timer, cls)
    trainer = cls(
        model=model, reward_funcs=[length_reward], args=config, train_dataset=dataset, processing_class=processor,
        callbacks=[OptimizerTimer(timer)], **kwargs,
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with timed_fast_decode(timer), count_setups(timer, processor):
        trainer.train()
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    measured = timer.per_step[args.warmup : steps] or timer.per_step

    def median(key: str) -> float:
        values = sorted(step.get(key, 0.0) for step in measured)
        return values[len(values) // 2]

    step_s = median("_wall")
    train_s = median("loss_forward") + median("backward")
    utilisation = mfu(model, median("_executed_tokens"), train_s, args.peak_tflops)
    samples = args.prompts_per_step * args.num_generations
    tokens = median("_prompt_tokens") + median("_completion_tokens")
    logs = [e for e in trainer.state.log_history if "tools/call_frequency" in e]
    tools = {
        "tool_calls_per_rollout": logs[-1]["tools/call_frequency"] if logs else 0.0,
        "train_wall_s": wall,
        "generation_s": median("generation"),
        "prefill_tokens_per_step": median("_prefill_tokens"),
        "prefill_padded_per_step": median("_prefill_padded"),
        "vision_images_per_step": median("_vision_images"),
        # the tool loop's own time outside its turns' generation: tool calls, templates, images, TRL's bookkeeping
        "loop_host_s_per_step": sorted(s.get("_tool_loop", 0.0) - s.get("_loop_turns", 0.0) for s in measured)[
            len(measured) // 2
        ],
        "chat_templates_per_step": median("_templates"),
        "images_preprocessed_per_step": median("_images_preprocessed"),
        "decode_workspaces_per_step": median("_workspaces"),
        "decode_steps_set_up_per_step": median("_decode_steps"),
        # tool calls started as their turn ended, while other rollouts decoded (early_tool_calls)
        "early_calls_per_step": float(getattr(getattr(trainer, "last_turn_stats", None), "early_calls", 0)),
    }
    decode_ms = 1e3 * median("decode") / median("_decode_tokens") if median("_decode_tokens") else None
    result = Result(
        kind, f"{scenario.name} {tools_scenario}", step_s, samples / step_s, tokens / step_s, peak, utilisation,
        {p: median(p) for p in PHASES}, int(median("_prompt_tokens")), int(median("_completion_tokens")),
        decode_ms_per_token=decode_ms,
    )  # fmt: skip
    del trainer, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result, tools


def main(argv: list[str] | None = None) -> list[Result]:
    argv = list(sys.argv[1:] if argv is None else argv)
    tool_scenarios = list(SCENARIOS)
    if "--tool_scenarios" in argv:  # this script's own option; the rest is bench_grpo.py's command line
        at = argv.index("--tool_scenarios")
        end = next((i for i in range(at + 1, len(argv)) if argv[i].startswith("--")), len(argv))
        tool_scenarios, argv = argv[at + 1 : end], argv[:at] + argv[end:]
    if "--tool_latency" in argv:
        at = argv.index("--tool_latency")
        LATENCY["seconds"] = float(argv[at + 1])
        argv = argv[:at] + argv[at + 2 :]
    for name in tool_scenarios:
        if name.rstrip("h")[:1] != "T" or not name.rstrip("h")[1:].isdigit():
            raise SystemExit(f"error: --tool_scenarios {name}: use T<rounds> or T<rounds>h (e.g. T2 T4 T4h)")
    args = parse(argv, __doc__.split("\n\n")[0])
    unknown = [k for k in args.trainers if k.partition(":")[0] not in ("vanilla", "ours")]
    if unknown:
        raise SystemExit(
            f"error: --trainers {' '.join(unknown)}: bench_tools.py runs vanilla and ours (variants as ours:key=value)"
        )
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    results, extras = [], {}

    def save() -> None:  # after every run: a run cut short by a time limit keeps what it measured
        payload = {
            **run_stamp(),
            "device": device,
            "args": {**vars(args), "tool_scenarios": tool_scenarios, "tool_latency": LATENCY["seconds"]},
            "results": [asdict(r) for r in results],
            "tools": extras,
        }
        Path(args.out).write_text(json.dumps(payload, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for size in args.image_sizes:
            for length in args.completion_lengths:
                scenario = Scenario(size, 1, length)
                workdir = Path(tmp) / f"{size}_{length}"
                workdir.mkdir(parents=True)
                paths = write_images(workdir, scenario, args.prompts_per_step * (args.warmup + args.steps), args.seed)
                for tools_scenario in tool_scenarios:
                    for kind in args.trainers:
                        result, tools = run_one(kind, args, scenario, tools_scenario, workdir, paths)
                        results.append(result)
                        extras[f"{result.scenario} {kind}"] = tools
                        print(f"[bench_tools] {json.dumps(asdict(result) | tools)}", flush=True)
                        save()
    print(f"\ndevice: {device}; preset: {args.preset}; G={args.num_generations}; scenarios {' '.join(tool_scenarios)}")
    print(format_table(results))
    for name, tools in extras.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in tools.items()))
    return results


if __name__ == "__main__":
    main()
