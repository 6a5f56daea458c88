"""Flash's varlen calls against the per-segment calls and TRL, on a GPU: log-probs and gradients of one real batch.

    python benchmarks/micro/varlen_check.py --preset qwen2_5_vl_3b --device cuda --out varlen_check.json

CPUs have no flash kernel, so the CPU tests (``tests/test_varlen_blocks.py``, ``tests/test_vision_attention.py``) check
the varlen paths through a stand-in; this checks the kernel itself. One trainer generates one batch, whose rows are then
cut to different lengths; then, with gradient checkpointing and the compiled layers on, the packed pass runs with both
varlen calls (``varlen``: the text decoder's packed attention and the vision tower's segments), with the text decoder's
per-row calls (``island``), with the vision tower's per-length calls (``vision_island``), and TRL's own per-row pass
(``trl``) runs too. Reported per pair: the largest log-prob difference over the valid completion tokens and the
gradients' relative L2 difference (all parameters together, and the worst parameter). In bf16 two correct kernels differ
by rounding; a varlen call passes when it is as close to TRL as the per-segment calls are.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common.py is in benchmarks/

import torch
from bench_common import (
    Scenario,
    device_defaults,
    grpo_config,
    grpo_trainer,
    one_batch_args,
    write_images,
)
from bench_policy import build_policy
from trl import GRPOTrainer

import vlm_grpo.fastpath.block_attention as block_attention
import vlm_grpo.fastpath.varlen as varlen
import vlm_grpo.fastpath.vision_attention as vision_attention
from vlm_grpo.trainer import VLMGRPOTrainer

MM_KEYS = ("pixel_values", "image_grid_thw", "num_images", "num_tiles", "mm_token_type_ids")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    one_batch_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--cpu_stand_in",
        action="store_true",
        help="on CPU, run the varlen paths through varlen.varlen_reference (CPUs have no flash kernel)",
    )
    p.add_argument("--out")
    args = p.parse_args(argv)
    args.beta, args.lora_r, args.lora_dropout, args.gradient_checkpointing = 0.0, 0, 0.05, True
    return args


def logps_and_grads(trainer, inputs, method, weights) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.zero_grad(set_to_none=True)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    C = inputs["completion_ids"].size(1)
    with trainer.compute_loss_context_manager():
        logps = method(trainer, trainer.model, input_ids, mask, C, **{k: inputs[k] for k in MM_KEYS if k in inputs})[0]
    valid = inputs["completion_mask"].bool()
    trainer.accelerator.backward((logps.float() * weights * valid).sum())
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    return (logps.detach().float() * valid), grads


def compare(a, b) -> dict[str, float]:
    (la, ga), (lb, gb) = a, b
    worst, num, den = 0.0, 0.0, 0.0
    for name, g in ga.items():
        d, r = (g.float() - gb[name].float()).norm(), gb[name].float().norm()
        num, den = num + d.item() ** 2, den + r.item() ** 2
        worst = max(worst, (d / r.clamp_min(1e-12)).item())
    return {
        "logp_max_abs": (la - lb).abs().max().item(),
        "grad_rel_l2": (num / max(den, 1e-30)) ** 0.5,
        "grad_rel_l2_worst_param": worst,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    device_defaults(args)
    if args.cpu_stand_in:
        varlen.CPU_STAND_IN = varlen.varlen_reference
    scenario = Scenario(args.image_size, 1, args.completion_length)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        paths = write_images(workdir, scenario, args.prompts_per_step, args.seed, args.vary_images)
        model, processor, module = build_policy(args, workdir, "ours")
        config = grpo_config("ours", args, scenario, workdir, max_steps=1)
        trainer = grpo_trainer("ours", model, processor, module, config, paths, workdir, vary_prompts=6)
        inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    # Rollouts end at different lengths: the full width, then a half, a quarter and an eighth of it, row after row
    # (each packed block is its row's own length; generation here runs every row to the full width).
    width = inputs["completion_ids"].size(1)
    lengths = [max(1, width >> (row % 4)) for row in range(inputs["completion_ids"].size(0))]
    for row, keep in enumerate(lengths):
        inputs["completion_mask"][row, keep:] = 0
        inputs["completion_ids"][row, keep:] = trainer._tokenizer.pad_token_id
    trainer.model.gradient_checkpointing_enable(config.gradient_checkpointing_kwargs or {"use_reentrant": False})
    trainer.model.train()
    weights = torch.randn(inputs["completion_ids"].shape, generator=torch.Generator().manual_seed(0))
    weights = weights.to(inputs["completion_ids"].device)
    ours = VLMGRPOTrainer._get_per_token_logps_and_entropies
    results, islands = {}, {"text": [], "vision": []}
    real_island, real_vision_island = block_attention._packed_sdpa, vision_attention._segmented_sdpa
    block_attention._packed_sdpa = torch.compiler.disable(lambda *a: islands["text"].append(1) or real_island(*a))
    vision_attention._segmented_sdpa = torch.compiler.disable(
        lambda *a: islands["vision"].append(1) or real_vision_island(*a)
    )
    island_calls = {}
    for name, text_varlen, vision_varlen, method in (
        ("varlen", True, True, ours),
        ("island", False, True, ours),
        ("vision_island", True, False, ours),
        ("trl", True, True, GRPOTrainer._get_per_token_logps_and_entropies),
    ):
        block_attention.VARLEN, vision_attention.VARLEN = text_varlen, vision_varlen
        logps_and_grads(trainer, inputs, method, weights)  # compiles; the second call is the one compared
        for calls in islands.values():
            calls.clear()
        results[name] = logps_and_grads(trainer, inputs, method, weights)
        island_calls[name] = {part: len(calls) for part, calls in islands.items()}
    block_attention.VARLEN = vision_attention.VARLEN = True
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "preset": args.preset,
        "prompt_lengths": inputs["prompt_mask"].sum(1).tolist(),
        "completion_lengths": lengths,
        "island_calls": island_calls,
        "varlen_vs_island": compare(results["varlen"], results["island"]),
        "varlen_vs_vision_island": compare(results["varlen"], results["vision_island"]),
        "varlen_vs_trl": compare(results["varlen"], results["trl"]),
        "island_vs_trl": compare(results["island"], results["trl"]),
        "vision_island_vs_trl": compare(results["vision_island"], results["trl"]),
        "varlen_vs_varlen_again": compare(results["varlen"], logps_and_grads(trainer, inputs, ours, weights)),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
