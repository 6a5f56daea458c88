"""Time ``fast_decode`` on a batch whose rows end at different lengths: finished rows leaving the batch, and not.

    python benchmarks/micro/decode_compact_micro.py --preset qwen2_5_vl_3b --device cuda --out compact.json
    python benchmarks/micro/decode_compact_micro.py --preset qwen2_5_vl_3b --device cuda --compare sized \\
        --unique 4 --group 4 --calls 3                             # the sized cache against the default, compacting
    python benchmarks/micro/decode_compact_micro.py --preset tiny --device cpu --unique 4 --max_new_tokens 24 \\
        --mean 6 --calls 2                                                                     # smoke test

EasyR1's geo3k shape per GPU by default: 64 random text prompts of ``--prompt_len`` tokens x G=5 rows, sampled at
temperature 1 up to ``--max_new_tokens`` (2,048), the LM head biased on EOS (``bench_shape.install_eos_bias``) so
that lengths are geometric with mean ``--mean`` (500). Each call decodes the batch once with row compaction
(``decode_compact.COMPACT``) and once without, from the same prefill and seed, and records the wall time, the rows
computed summed over the steps against a decode at full width, the widths the decode ran at and after how many
steps it narrowed (``narrowed_at_steps``), how many rows got the same tokens both ways, each row compared up to and
with its EOS (under the seed every row should; on a GPU a GEMM over fewer rows may round a logit differently, and a
sampled row then goes its own way, from the first narrowing on), and the first step at which some row differs.
``--compare sized``: both decodes compact, one with the sized cache (``decode.SIZED_CACHE``) and one with the
default cache; they run the same widths, windows and kernels on the same rows, so every row should match, in bf16
too. The first call of each variant pays compilation and graph captures and is left out of the medians. Each
record also has the most bytes the decode cache held (``peak_cache_gib``: with ``--sized_cache true``, the default,
it grows by windows and drops the rows a compaction leaves; ``false``: every row's longest possible cache from the
start) and, on a GPU, the call's peak memory.
``--windows_on_cpu true`` takes the attention windows (and the growing cache) on CPU too, as tests do; ``--window``
sets their length (``decode.ATTENTION_WINDOW``), so that a short CPU decode crosses several. ``--greedy true``
decodes greedily instead of sampling, with the EOS bias set so that EOS is the largest logit at about ``1 / --mean``
of the positions (``greedy_eos_bias``); a prompt's G rows are then the same.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common.py is in benchmarks/

import torch
from bench_common import device_defaults, flag_bool, run_stamp
from bench_shape import CALIBRATION_END, CALIBRATION_START, install_eos_bias
from decode_lengths import prefilled


def shaped_decode_args(p: argparse.ArgumentParser) -> None:
    """The decode's shape at EasyR1's recipe (64 prompts x 5 rows, lengths of mean 500 up to 2,048), the model."""
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--unique", type=int, default=64, help="unique prompts per call")
    p.add_argument("--group", type=int, default=5, help="rows per unique prompt (G)")
    p.add_argument("--prompt_len", type=int, default=400)
    p.add_argument("--max_new_tokens", type=int, default=2048)
    p.add_argument("--mean", type=int, default=500, help="mean completion length (geometric, cut at the maximum)")


def shaped_model(args: argparse.Namespace, on_gpu: bool, device: torch.device) -> tuple:
    """(model, its generation config): ``args.preset`` with random weights, EOS-biased to completions of mean
    ``args.mean``, sampled at temperature 1 (``args.greedy``, where set: greedy) up to ``args.max_new_tokens``;
    in ``args.dtype`` where set (default: bf16 on a GPU, fp32 on CPU)."""
    from vlm_grpo.testing.tiny import build_model

    dtype = getattr(torch, getattr(args, "dtype", None) or ("bfloat16" if on_gpu else "float32"))
    model, _ = build_model(args.preset, dtype=dtype, device=device)
    model.eval()
    config = model.generation_config
    eos = config.eos_token_id
    install_eos_bias(model, eos[0] if isinstance(eos, list) else eos, args.mean)
    config.max_new_tokens, config.min_new_tokens = args.max_new_tokens, None
    config.do_sample, config.temperature, config.top_p, config.top_k = True, 1.0, 1.0, 0
    if getattr(args, "greedy", False):
        config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        greedy_eos_bias(model, eos[0] if isinstance(eos, list) else eos, args.mean)
    return model, config


@torch.no_grad()
def greedy_eos_bias(model, eos_id: int, mean: int, seed: int = 0) -> float:
    """Set the EOS bias of the head (``install_eos_bias``'s) so that EOS is the largest logit at about ``1 / mean`` of
    the calibration positions: greedy rows then end at many different lengths (with the sampling bias EOS would be
    the argmax almost everywhere, a random model's distribution being nearly flat). Returns the bias."""
    from vlm_grpo.utils import peft_base

    base = peft_base(model)
    head, decoder = base.get_output_embeddings(), base.get_decoder()
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, head.weight.size(0), (2, CALIBRATION_END), generator=gen).to(head.weight.device)
    logits = decoder(input_ids=ids).last_hidden_state[:, CALIBRATION_START:].float() @ head.weight.float().T
    eos = logits[..., eos_id].clone()
    logits[..., eos_id] = -math.inf
    margin = logits.max(dim=-1).values - eos  # the bias from which EOS is the argmax at that position
    value = float(torch.quantile(margin.flatten(), 1.0 / mean))
    head.bias[eos_id] = value
    return value


def decode_once(
    model, config, ids: torch.Tensor, group: int, compile: bool, compact: bool, seed: int, sized: bool | None = None
) -> dict:
    """Prefill ``ids`` (unique prompts), decode ``group`` rows each; the call's record and its tokens.
    ``sized``: ``decode.SIZED_CACHE`` for this call (None: as the caller set it; ``decode._WINDOWS_WITHOUT_GRAPH``
    too)."""
    from vlm_grpo.fastpath import decode, decode_compact

    device = ids.device
    mask = torch.ones_like(ids)
    with torch.no_grad():
        cache, next_pos = prefilled(model, ids)
        index = torch.arange(ids.size(0), device=device).repeat_interleave(group)
        index = index[torch.randperm(index.numel(), generator=torch.Generator().manual_seed(seed)).to(device)]
        real, decode_compact.COMPACT = decode_compact.COMPACT, compact
        real_sized = decode.SIZED_CACHE
        decode.SIZED_CACHE = real_sized if sized is None else sized
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        try:
            out = decode.fast_decode(
                model, cache, index, ids[index], mask[index], next_pos, config, use_graph=device.type == "cuda",
                compile=compile,
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            decode_compact.COMPACT, decode.SIZED_CACHE = real, real_sized
    seconds = time.perf_counter() - start
    stats = decode_compact.last_stats
    return {
        "compact": compact,
        "sized_cache": decode.SIZED_CACHE if sized is None else sized,
        "seconds": seconds,
        "steps": stats.steps,
        "ms_per_step": 1e3 * seconds / max(stats.steps, 1),
        "row_steps": stats.row_steps,
        "full_row_steps": stats.full_row_steps,
        "widths": stats.widths,
        "narrowed_at_steps": stats.narrowed_at,
        "peak_cache_gib": stats.peak_cache_bytes / 2**30,
        "cache_storages": len(stats.allocations),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "tokens": out.cpu(),
    }


def ended(row: list[int], eos: set[int]) -> list[int]:
    """``row``'s tokens up to and with its first EOS (the padding after it left out)."""
    end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return row[:end]


def compared(a: torch.Tensor, b: torch.Tensor, eos: set[int]) -> tuple[int, int | None]:
    """(rows of ``a`` and ``b`` with the same tokens, each up to and with its EOS; the first step at which some row
    differs, None if none). The two outputs may have different lengths (the longest row's), so padded rows are
    never compared as they are."""
    same, first = 0, None
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        x, y = ended(x, eos), ended(y, eos)
        if x == y:
            same += 1
            continue
        step = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
        first = step if first is None else min(first, step)
    return same, first


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shaped_decode_args(p)
    p.add_argument("--calls", type=int, default=3, help="calls per variant (the first is left out of the medians)")
    p.add_argument("--compile", type=flag_bool, default=None, help="compile the decode step (default: on a GPU)")
    p.add_argument("--sized_cache", type=flag_bool, default=True, help="decode.SIZED_CACHE (false: the longest cache)")
    p.add_argument(
        "--compare", choices=("compact", "sized"), default="compact",
        help="compact: compacting against full width (the cache as --sized_cache says); sized: the sized cache "
        "against the default one, both compacting",
    )  # fmt: skip
    p.add_argument("--dtype", default=None, help="the model's dtype (default: bfloat16 on a GPU, float32 on CPU)")
    p.add_argument("--greedy", type=flag_bool, default=False, help="greedy decoding instead of sampling")
    p.add_argument("--window", type=int, default=None, help="decode.ATTENTION_WINDOW (default: the decode's)")
    p.add_argument("--windows_on_cpu", type=flag_bool, default=False, help="attention windows without CUDA graphs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from vlm_grpo.fastpath import decode

    window = decode.ATTENTION_WINDOW if args.window is None else args.window
    settings = {"SIZED_CACHE": args.sized_cache, "_WINDOWS_WITHOUT_GRAPH": args.windows_on_cpu}
    with patch.multiple(decode, ATTENTION_WINDOW=window, **settings):  # put back after the run (tests run main too)
        return run(args)


def run(args: argparse.Namespace) -> dict:
    """The calls of both variants and their summary (``main`` has set the decode's module settings)."""
    on_gpu = device_defaults(args)
    device = torch.device(args.device)
    compile = on_gpu if args.compile is None else args.compile

    model, config = shaped_model(args, on_gpu, device)
    eos = {config.eos_token_id} if isinstance(config.eos_token_id, int) else set(config.eos_token_id)
    # (compact, sized) of the two variants; the first is the one timed against the second
    variants = [(True, None), (False, None)] if args.compare == "compact" else [(True, True), (True, False)]

    calls, same_rows, all_rows, firsts = [], 0, 0, []
    for n in range(args.calls):
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(100, 1000, (args.unique, args.prompt_len), generator=g).to(device)
        pair = [decode_once(model, config, ids, args.group, compile, c, seed=n, sized=s) for c, s in variants]
        same, first = compared(pair[0]["tokens"], pair[1]["tokens"], eos)
        rows = pair[0]["tokens"].size(0)
        same_rows, all_rows = same_rows + same, all_rows + rows
        firsts.append(first)
        for record in pair:
            record["rows_with_the_same_tokens"] = f"{same}/{rows}"
            record["first_differing_step"] = first
            del record["tokens"]
            print(json.dumps(record), flush=True)
            calls.append(record)

    def median(first: bool, name: str) -> float | None:
        values = [c[name] for c in calls[2 if first else 3 :: 2]]  # calls alternate; the first of each compiles
        return statistics.median(values) if values else None

    summary = {
        **run_stamp(),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "args": vars(args),
        "calls": calls,
        "rows_with_the_same_tokens": f"{same_rows}/{all_rows}",
        "first_differing_steps": firsts,
    }
    if args.compare == "compact":
        summary |= {
            "compact_s": median(True, "seconds"),
            "full_width_s": median(False, "seconds"),
            "compact_row_steps": median(True, "row_steps"),
            "full_width_row_steps": median(False, "row_steps"),
            "compact_peak_cache_gib": max((c["peak_cache_gib"] for c in calls if c["compact"]), default=None),
        }
        if summary["compact_s"] and summary["full_width_s"]:
            summary["speedup"] = summary["full_width_s"] / summary["compact_s"]
    else:
        for sized, name in ((True, "sized"), (False, "default")):
            summary[f"{name}_s"] = median(sized, "seconds")
            summary[f"{name}_peak_cache_gib"] = max(c["peak_cache_gib"] for c in calls if c["sized_cache"] is sized)
    print(json.dumps({k: v for k, v in summary.items() if k != "calls"}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
